"""The local layers' windowed attention (kernels/local_attention.py) against a definition written
apart from it: for each query, a softmax over the keys of its own sequence at most ``window``
positions away, on ragged lengths, with windows smaller and larger than the sequences; and the
candidates that run on a CPU held to the same."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from bert_ds.kernels import local_attention as local

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)

LENGTHS = (13, 1, 7, 30)


def _definition(q, k, v, lengths, window):
    """Query by query: the keys of the same sequence within the window, their softmax, the values."""
    out = torch.empty_like(q)
    start = 0
    for n in lengths:
        for i in range(start, start + n):
            keys = [j for j in range(start, start + n) if abs(i - j) <= window]
            scores = torch.einsum("hd,jhd->hj", q[i].double(), k[keys].double()) / math.sqrt(q.shape[-1])
            out[i] = torch.einsum("hj,jhd->hd", scores.softmax(-1), v[keys].double()).to(q.dtype)
        start += n
    return out


def _inputs(lengths=LENGTHS, heads=2, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, generator=g) for _ in range(3))
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return q, k, v, cu_seqlens


@pytest.mark.parametrize("window", [0, 1, 4, 29, 100])  # none beside itself, within, whole sequences and past them
def test_the_reference_is_the_definition(window):
    q, k, v, cu_seqlens = _inputs()
    got = local.local_attention_ref(q, k, v, cu_seqlens, max(LENGTHS), window)
    torch.testing.assert_close(got, _definition(q, k, v, LENGTHS, window), rtol=1e-5, atol=1e-6)


def test_the_native_op_on_a_cpu_is_the_definition_with_its_gradients():
    q, k, v, cu_seqlens = (t.requires_grad_() if t.is_floating_point() else t for t in _inputs())
    out = local.local_attention(q, k, v, cu_seqlens, max(LENGTHS), 4, backend="torch")
    torch.testing.assert_close(out, _definition(q.detach(), k.detach(), v.detach(), LENGTHS, 4), rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = local.local_attention_ref(*leaves, cu_seqlens, max(LENGTHS), 4)
    theirs = torch.autograd.grad(ref, leaves, grad.double())
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-6)


def test_flex_attention_s_block_mask_is_the_definition():
    """FlexAttention's forward (its backward has no CPU kernel): one packed sequence, the
    "same sequence and within the window" mask."""
    q, k, v, cu_seqlens = _inputs()
    with torch.no_grad(), pytest.warns(UserWarning, match="without torch.compile"):
        got = local.local_attention_flex(q, k, v, cu_seqlens, max(LENGTHS), 3)
    torch.testing.assert_close(got, _definition(q, k, v, LENGTHS, 3), rtol=1e-5, atol=1e-5)


def test_off_a_cuda_device_the_gpu_candidates_say_why_not():
    q, k, v, cu_seqlens = _inputs()
    assert local._unsupported("flex", q, k, v, cu_seqlens, 0.0, None) == "its inputs are not on a CUDA device"
    assert "CUDA device" in local._unsupported("varlen_attn", q, k, v, cu_seqlens, 0.0, None)
    assert "attention dropout" in local._unsupported("flex", q, k, v, cu_seqlens, 0.1, None)
    with pytest.raises(ValueError, match="varlen_attn cannot take these inputs"):
        local.local_attention_varlen_attn(q, k, v, cu_seqlens, max(LENGTHS), 3)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """A stand-in for the flash-attn package on this CPU: its ``flash_attn_varlen_func`` computes the
    definition (window_size's -1 as flash-attn's "no limit") and records each call's arguments."""
    import types

    from bert_ds.kernels import attention

    calls = []

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               window_size=(-1, -1)):
        calls.append({"cu_seqlens": (cu_seqlens_q, cu_seqlens_k), "max_seqlen": (max_seqlen_q, max_seqlen_k),
                      "softmax_scale": softmax_scale, "window_size": window_size})
        lengths = cu_seqlens_q.diff().tolist()
        return _definition(q, k, v, lengths, max(lengths) if window_size[0] < 0 else window_size[0])

    attention.flash_attn_api.cache_clear()
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    monkeypatch.setattr(attention, "cuda_capability", lambda device: (9, 0))  # the rules past the device's
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object())
    yield calls
    attention.flash_attn_api.cache_clear()


def test_flash_attn_is_a_candidate_of_both_attention_ops_that_says_why_not_where_it_cannot_run():
    from bert_ds.kernels import attention, speed

    q, k, v, cu_seqlens = _inputs()
    assert "flash_attn" in speed.candidate_names()["varlen_attention"]
    assert "flash_attn" in speed.candidate_names()["local_attention"]
    off = "its inputs are not on a CUDA device of compute capability 8.0 or newer"
    assert local._unsupported("flash_attn", q, k, v, cu_seqlens, 0.0, None) == off
    assert attention._unsupported("flash_attn", q, k, v, cu_seqlens, 0.0, None) == off
    with pytest.raises(ValueError, match=f"flash-attn cannot take these inputs: {off}"):
        local.local_attention_flash_attn(q, k, v, cu_seqlens, max(LENGTHS), 3)


def test_without_the_package_flash_attn_says_it_is_not_installed(monkeypatch):
    from bert_ds.kernels import attention

    attention.flash_attn_api.cache_clear()
    monkeypatch.setattr(attention, "cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: None)
    q, k, v, cu_seqlens = _inputs()
    try:
        assert attention.flash_attn_problem(q, k, v, cu_seqlens, 0.0) == "the flash-attn package is not installed"
    finally:
        attention.flash_attn_api.cache_clear()


def test_flash_attn_candidates_hand_flash_attn_the_packed_tokens_and_the_window(fake_flash_attn):
    """Both ops' flash_attn candidates: cu_seqlens and max_seqlen for queries and keys alike, the scale,
    window_size (w, w) for the local layers and (-1, -1) for the global ones; the results the definition's."""
    from bert_ds.kernels import attention

    q, k, v, cu_seqlens = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in _inputs())
    assert attention.flash_attn_problem(q, k, v, cu_seqlens, 0.0) == ""
    wide = [t.to(torch.bfloat16) for t in _inputs(head_dim=12)[:3]]
    assert "head_dim 12 (it takes multiples of 8" in attention.flash_attn_problem(*wide, cu_seqlens, 0.0)
    got = local.local_attention_flash_attn(q, k, v, cu_seqlens, max(LENGTHS), 3, softmax_scale=0.25)
    assert torch.equal(got, _definition(q, k, v, LENGTHS, 3))
    attention.varlen_attention_flash_attn(q, k, v, cu_seqlens, max(LENGTHS))
    (local_call, global_call) = fake_flash_attn
    assert local_call["window_size"] == (3, 3) and global_call["window_size"] == (-1, -1)
    assert local_call["softmax_scale"] == 0.25 and global_call["softmax_scale"] is None
    assert all(all(c is cu_seqlens for c in call["cu_seqlens"]) and call["max_seqlen"] == (30, 30)
               for call in fake_flash_attn)


def test_the_self_check_passes_the_reference_and_fails_a_window_off_by_one():
    """What kernels=auto holds the fused candidate to (selfcheck.check_local_attention), on the CPU:
    the reference itself passes it, and an implementation that sees one key too far does not."""
    from bert_ds.kernels import selfcheck

    def one_too_far(q, k, v, cu_seqlens, max_seqlen, window, *rest):
        return local.local_attention_ref(q, k, v, cu_seqlens, max_seqlen, window + 1, *rest)
    assert selfcheck.check_local_attention(local.local_attention_ref, torch.device("cpu")) == []
    problems = selfcheck.check_local_attention(one_too_far, torch.device("cpu"))
    assert problems and all("window" in p for p in problems), problems
