"""The rotary attention's reference (kernels/rotary_attention.py) is the model's rotary then the
attention's reference, and a layer runs the fused rotary path exactly where its op runs its fused
kernel. The kernels themselves are held to this reference on the CPU emulator
(test_attention_options_emulated.py) and on a GPU by the self-check."""

from __future__ import annotations

import pytest
import torch

from bert_ds.kernels import dispatch, rotary_attention
from bert_ds.kernels.attention import varlen_attention_ref
from bert_ds.kernels.dispatch import KernelUnavailable, OpPlan
from bert_ds.kernels.local_attention import local_attention_ref
from bert_ds.kernels.rotary_attention import apply_rotary, rotary_tables
from bert_ds.model.padding import positions, unpad

LENGTHS = [5, 1, 12, 7]


def _packed(dtype: torch.dtype, head_dim: int = 16):
    """A right-padded batch's tokens packed as the model packs them: (qkv (T, 3, 2, hd), cu_seqlens,
    each token's position as the model computes it)."""
    mask = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    layout = unpad(mask)
    qkv = torch.randn(int(mask.sum()), 3, 2, head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    return qkv, layout.cu_seqlens, positions(layout.token_indices, max(LENGTHS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("theta", [10000.0, 160000.0])
def test_the_reference_s_rotary_is_the_model_s(dtype, theta):
    """Bit for bit, from cu_seqlens alone: positions restart at every sequence, as the model's (from
    its padded layout) do."""
    qkv, cu_seqlens, position_ids = _packed(dtype)
    cos, sin = rotary_tables(position_ids, 16, theta, dtype)
    for x in qkv.unbind(1)[:2]:
        assert torch.equal(rotary_attention.rotary_ref(x, cu_seqlens, theta), apply_rotary(x, cos, sin))
    assert torch.equal(rotary_attention.sequence_positions(cu_seqlens, qkv.shape[0]), position_ids)


@pytest.mark.parametrize("window", [None, 2])
def test_the_reference_rotates_q_and_k_then_attends(window):
    qkv, cu_seqlens, position_ids = _packed(torch.float32)
    cos, sin = rotary_tables(position_ids, 16, 10000.0, torch.float32)
    q, k, v = qkv.unbind(1)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    expected = (varlen_attention_ref(q, k, v, cu_seqlens, max(LENGTHS)) if window is None
                else local_attention_ref(q, k, v, cu_seqlens, max(LENGTHS), window))
    got = rotary_attention.rotary_attention_ref(qkv, cu_seqlens, max(LENGTHS), 10000.0, window)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_fused_rotary_path_runs_where_the_op_runs_its_fused_kernel(caplog):
    """Under a plan, where the layer's op won with its fused kernel and it takes the inputs; never
    under kernels=torch, nor for an op the plan did not race; under kernels=cuda, or an error."""
    dispatch._log_fallback.cache_clear()  # said once per process: this test's own process may have said it
    qkv, cu_seqlens, _ = _packed(torch.bfloat16, head_dim=32)
    fused_local = OpPlan((("varlen_attention", "native"), ("local_attention", "fused")), "shapes")
    assert rotary_attention.rotary_impl(qkv, cu_seqlens, None, 0.0, fused_local) == "native"  # global: native won
    assert rotary_attention.rotary_impl(qkv, cu_seqlens, 4, 0.0, "torch") == "native"
    assert rotary_attention.rotary_impl(qkv, cu_seqlens, 4, 0.0, OpPlan((("varlen_attention", "fused"),),
                                                                        "bert")) == "native"
    # the winner cannot take CPU tensors: the native op runs, said once
    assert rotary_attention.rotary_impl(qkv, cu_seqlens, 4, 0.0, fused_local) == "native"
    assert "local_attention runs the native op where fused cannot: its inputs are not all on a CUDA device" in caplog.text
    with pytest.raises(KernelUnavailable, match=r"^kernels=cuda: local_attention cannot run fused: "):
        rotary_attention.rotary_impl(qkv, cu_seqlens, 4, 0.0, "cuda")


@pytest.mark.parametrize("window", [None, 4])
def test_a_rotary_layer_s_attention_is_the_reference_on_the_op_s_choice(monkeypatch, window):
    """rotary_attention runs the implementation the op chose, once: the native one after PyTorch's
    rotation by the layer's tables, which equals the reference; the fused one on the unrotated
    projection with the layer's base and window."""
    qkv, cu_seqlens, position_ids = _packed(torch.float32)
    tables = rotary_tables(position_ids, 16, 10000.0, torch.float32)
    got = rotary_attention.rotary_attention(qkv, cu_seqlens, max(LENGTHS), 10000.0, tables, window, backend="torch")
    torch.testing.assert_close(got, rotary_attention.rotary_attention_ref(qkv, cu_seqlens, max(LENGTHS), 10000.0,
                                                                          window))
    calls = []
    monkeypatch.setattr(rotary_attention, "rotary_impl", lambda *args: "fused")
    monkeypatch.setitem(rotary_attention.ROTARY_IMPLEMENTATIONS, "fused", lambda *args: calls.append(args) or got)
    assert rotary_attention.rotary_attention(qkv, cu_seqlens, max(LENGTHS), 10000.0, tables, window, 0.0,
                                             backend="cuda") is got
    (fused_qkv, _, max_seqlen, theta, fused_window, dropout_p), = calls
    assert fused_qkv is qkv and (max_seqlen, theta, fused_window, dropout_p) == (max(LENGTHS), 10000.0, window, 0.0)


def test_a_rotary_base_must_be_positive():
    qkv, cu_seqlens, _ = _packed(torch.bfloat16, head_dim=32)
    with pytest.raises(ValueError, match="rope_theta must be a positive rotary base, got 0.0"):
        rotary_attention.rotary_attention_fused(qkv, cu_seqlens, max(LENGTHS), 0.0)
