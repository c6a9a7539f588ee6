"""The local layers' windowed attention (kernels/local_attention.py) against a definition written
apart from it: for each query, a softmax over the keys of its own sequence at most ``window``
positions away, on ragged lengths, with windows smaller and larger than the sequences; and the
candidates that run on a CPU held to the same."""

from __future__ import annotations

import math

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
