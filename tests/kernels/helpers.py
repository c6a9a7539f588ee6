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
    h = x.double() if residual is None else x.double() + residual.double()
    mean = h.mean(dim=-1, keepdim=True)
    var = ((h - mean) ** 2).mean(dim=-1, keepdim=True)
    return (h - mean) / torch.sqrt(var + eps) * weight.double() + bias.double()


def layer_norm_same_dtype(x, weight, bias, eps, residual=None):
    """What PyTorch computes in the input dtype (with the weights cast to it)."""
    summed = x if residual is None else x + residual
    return F.layer_norm(summed, summed.shape[-1:], weight.to(x.dtype), bias.to(x.dtype), eps)


# --------------------------------------------------------------------------- bias + gelu

def gelu_fp64(x, bias, approximate):
    h = x.double() + bias.double()
    if approximate == "tanh":
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
    return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))


def gelu_same_dtype(x, bias, approximate):
    return F.gelu(x + bias.to(x.dtype), approximate=approximate)


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
