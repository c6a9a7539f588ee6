"""Inputs, high-precision references and the error rule shared by the kernel tests.

The rule is flash-attention's: a kernel's error against an fp64 (or fp32) reference
may be at most ``2x`` the error of the same computation done by PyTorch in the
kernel's dtype, plus a small ``atol`` for the cases where PyTorch happens to be exact.
"""

import math

import torch
import torch.nn.functional as F

ATOL = {torch.float32: 2e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3}


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0,
         shift: float = 0.0, device: str | torch.device = "cpu") -> torch.Tensor:
    """Seeded normal values (never zeros), generated on the CPU so that every device sees the same."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale + shift).to(device=device, dtype=dtype)


def non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values as ``x``, laid out with a stride-2 last dimension."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    out = wide[..., ::2]
    assert not out.is_contiguous()
    return out


def misaligned(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` whose data pointer is one element past a 16-byte boundary."""
    flat = torch.empty(x.numel() + 16, dtype=x.dtype, device=x.device)
    out = flat[1:1 + x.numel()].view(x.shape).copy_(x)
    assert out.is_contiguous() and out.data_ptr() % 16 != 0
    return out


def scaled_atol(dtype: torch.dtype, truth: torch.Tensor) -> float:
    """ATOL[dtype] relative to the size of the values (gradients summed over many rows are large)."""
    return ATOL[dtype] * max(1.0, truth.abs().max().item() if truth.numel() else 0.0)


def max_err(x: torch.Tensor, reference: torch.Tensor) -> float:
    return (x.double() - reference.double()).abs().max().item() if x.numel() else 0.0


def assert_close_to_reference(name: str, ours: torch.Tensor, same_dtype: torch.Tensor, truth: torch.Tensor,
                              atol: float, factor: float = 2.0) -> None:
    """``ours`` may be at most ``factor`` times as far from ``truth`` as ``same_dtype`` is, plus atol."""
    assert ours.shape == truth.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(truth.shape)}"
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    ours_err, torch_err = max_err(ours, truth), max_err(same_dtype, truth)
    bound = factor * torch_err + atol
    assert ours_err <= bound, f"{name}: error {ours_err:.3g} > {factor} x PyTorch's {torch_err:.3g} + {atol:g}"


# --------------------------------------------------------------------------- layer norm

def layer_norm_fp64(x, weight, bias, eps, residual=None):
    """bias None: a LayerNorm without one."""
    h = x.double() if residual is None else x.double() + residual.double()
    mean = h.mean(dim=-1, keepdim=True)
    var = ((h - mean) ** 2).mean(dim=-1, keepdim=True)
    scaled = (h - mean) / torch.sqrt(var + eps) * weight.double()
    return scaled if bias is None else scaled + bias.double()


def layer_norm_same_dtype(x, weight, bias, eps, residual=None):
    """What PyTorch computes in the input dtype (with the weights cast to it)."""
    summed = x if residual is None else x + residual
    return F.layer_norm(summed, summed.shape[-1:], weight.to(x.dtype), None if bias is None else bias.to(x.dtype),
                        eps)


def dropout_layer_norm_fp64(x, bias, residual, weight, ln_bias, eps, dropout_p, keep):
    """LayerNorm(dropout(x + bias) + residual) in fp64, dropout's mask given (``keep``, bool)."""
    h = torch.where(keep, (x.double() + bias.double()) / (1.0 - dropout_p), 0.0)
    return layer_norm_fp64(h, weight, ln_bias, eps, residual)


def dropout_layer_norm_same_dtype(x, bias, residual, weight, ln_bias, eps, dropout_p, keep):
    """What PyTorch computes in the input dtype: each op rounded to it, the weights cast to it."""
    h = torch.where(keep, (x + bias.to(x.dtype)) * (1.0 / (1.0 - dropout_p)), torch.zeros((), dtype=x.dtype))
    return layer_norm_same_dtype(h, weight, ln_bias, eps, residual.to(x.dtype))


# --------------------------------------------------------------------------- bias + gelu

def gelu_fp64(x, bias, approximate):
    h = x.double() + bias.double()
    if approximate == "tanh":
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
    return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))


def gelu_same_dtype(x, bias, approximate):
    return F.gelu(x + bias.to(x.dtype), approximate=approximate)


# --------------------------------------------------------------------------- GeGLU

def geglu_fp64(x, approximate):
    """gelu(input) * gate over x's halves [input | gate], in fp64 by the formula."""
    inputs, gate = x.double().chunk(2, dim=-1)
    return gelu_fp64(inputs, torch.zeros((), dtype=torch.float64), approximate) * gate


def geglu_same_dtype(x, approximate):
    """What PyTorch computes in x's dtype: the GELU and the product each rounded to it."""
    inputs, gate = x.chunk(2, dim=-1)
    return F.gelu(inputs, approximate=approximate) * gate


# --------------------------------------------------------------------------- MLM cross-entropy

def mlm_cross_entropy_fp64(logits, labels, ignore_index=-100):
    """(the summed cross-entropy of the rows whose label is not ``ignore_index``, the count of those
    rows whose first maximal logit is the label), in fp64, from log-softmax."""
    x = logits.double()
    scored = labels != ignore_index
    log_probs = torch.log_softmax(x, dim=1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    loss = -log_probs.masked_fill(~scored, 0.0).sum()
    first_max = (x == x.max(dim=1, keepdim=True).values).int().argmax(dim=1)  # argmax of 0/1: its first 1
    return loss, (scored & (first_max == labels)).sum()


# --------------------------------------------------------------------------- attention

def cu_seqlens_of(lengths: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def attention_per_sequence(q, k, v, lengths, softmax_scale=None, upcast=True):
    """Explicit softmax(scale q k^T) v per sequence and head.

    ``upcast``: computed in fp64 (the reference); otherwise in the input dtype, every
    intermediate rounded to it (PyTorch's same-dtype path, as in flash-attention's tests).
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    outs, start = [], 0
    for length in lengths:
        rows = slice(start, start + length)
        qs, ks, vs = (x[rows].transpose(0, 1) for x in (q, k, v))  # (nh, L, hd)
        scores = torch.matmul(qs * scale, ks.transpose(1, 2))  # (nh, L, L)
        probs = torch.softmax(scores, dim=-1)
        outs.append(torch.matmul(probs, vs).transpose(0, 1))  # (L, nh, hd)
        start += length
    return torch.cat(outs)  # (T, nh, hd)


# --------------------------------------------------------------------------- dropout's Philox stream

# Philox4x32-10 as Salmon, Moraes, Dror and Shaw define it ("Parallel random numbers: as easy as
# 1, 2, 3", SC 2011, section 4 and Random123's philox.h): per round, with (c0, c1, c2, c3) the
# counter and (k0, k1) the round key,
#     c0, c1, c2, c3 <- hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0)
# and the key bumped by the Weyl constants (W0, W1) between rounds. Written on numpy arrays,
# without reference to kernels/csrc, so that the kernel's stream is checked against the definition.
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32_10(counters, key: tuple[int, int]):
    """counters: (n, 4) uint32 array; key: two 32-bit ints. Returns the (n, 4) uint32 output blocks."""
    import numpy as np

    c = [np.asarray(counters, dtype=np.uint64)[:, i] for i in range(4)]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    low = np.uint64(0xFFFFFFFF)
    for round_ in range(10):
        if round_:
            k0, k1 = (k0 + np.uint64(PHILOX_W[0])) & low, (k1 + np.uint64(PHILOX_W[1])) & low
        product0 = np.uint64(PHILOX_M[0]) * c[0]  # < 2^64: exact in uint64
        product1 = np.uint64(PHILOX_M[1]) * c[2]
        c = [(product1 >> np.uint64(32)) ^ c[1] ^ k0, product1 & low,
             (product0 >> np.uint64(32)) ^ c[3] ^ k1, product0 & low]
    return np.stack(c, axis=1).astype(np.uint32)


def dropout_keep(shape: tuple[int, ...], dropout_p: float, seed: int, offset: int) -> torch.Tensor:
    """The mask dropout_add_layer_norm's contract defines: element e (row-major over ``shape``) is
    kept iff (word e % 4 of block Philox(key = seed, counter = (offset / 4, e / 4) as two 64-bit
    halves, low words first)) / 2^32, cut to 24 bits, is below 1 - p in float32."""
    import numpy as np

    numel = math.prod(shape)
    groups = np.arange((numel + 3) // 4, dtype=np.uint64)
    base, low = np.uint64(offset // 4), np.uint64(0xFFFFFFFF)
    counters = np.stack([np.full_like(groups, base & low), np.full_like(groups, base >> np.uint64(32)),
                         groups & low, groups >> np.uint64(32)], axis=1)
    words = philox4x32_10(counters, (seed & 0xFFFFFFFF, seed >> 32)).reshape(-1)[:numel]
    uniform = (words >> np.uint32(8)).astype(np.float64) / 2.0 ** 24
    keep_probability = float(np.float32(1.0) - np.float32(dropout_p))
    return torch.from_numpy(uniform < keep_probability).reshape(shape)


def _sequences(cu_seqlens: torch.Tensor):
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


class StandInAttentionExtension:
    """The binding's attention entry points (kernels/csrc/bindings.cpp), in fp32 math on the CPU:
    ``varlen_attention_fwd`` -> (out (T, nh, hd), lse (nh, T) float32), and the packed backward.
    Attention written out per sequence, independently of the reference's padded SDPA (which
    tests/kernels/test_attention_op.py checks it against); ``calls`` counts the forwards."""

    transpose_lse = False  # a planted mistake: lse as (T, nh), not the layout the op declares

    def __init__(self) -> None:
        self.calls = 0

    def varlen_attention_fwd(self, q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, window=-1, rope_theta=0.0):
        assert window < 0 and rope_theta == 0.0, "the stand-in attends globally, to q and k as they are"
        self.calls += 1
        out, lse = torch.empty_like(q, memory_format=torch.contiguous_format), []
        for lo, hi in _sequences(cu_seqlens):
            scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k[lo:hi].float()) * scale
            lse.append(torch.logsumexp(scores, dim=-1))
            out[lo:hi] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v[lo:hi].float()).to(q.dtype)
        lse = torch.cat(lse, dim=1)  # (nh, T)
        return out, (lse.t().contiguous() if self.transpose_lse else lse)

    def varlen_attention_bwd_packed(self, dout, qkv, out, lse, cu_seqlens, max_seqlen, scale, window=-1,
                                    rope_theta=0.0):
        assert window < 0 and rope_theta == 0.0, "the stand-in attends globally, to q and k as they are"
        dqkv = torch.zeros(qkv.shape, dtype=torch.float32)
        for lo, hi in _sequences(cu_seqlens):
            q, k, v = qkv[lo:hi].float().unbind(1)
            do = dout[lo:hi].float()
            p = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * scale, dim=-1)
            dp = torch.einsum("qhd,khd->hqk", do, v)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # the softmax's gradient
            dqkv[lo:hi, 0] = torch.einsum("hqk,khd->qhd", ds, k) * scale
            dqkv[lo:hi, 1] = torch.einsum("hqk,qhd->khd", ds, q) * scale
            dqkv[lo:hi, 2] = torch.einsum("hqk,qhd->khd", p, do)
        return dqkv.to(qkv.dtype)
