"""GeGLU: ``gelu(input) * gate`` over the two halves of the last dimension.

ModernBERT's MLP computes ``Wo(gelu(input) * gate)`` with ``(input, gate) = Wi(x).chunk(2, dim=-1)``;
its (T, 2I) projection is the largest activation of the layer. The op takes that projection
whole, ``x`` = ``[input | gate]``, so the fused kernel reads both halves in place and returns their
gradients in one (T, 2I) tensor, which Wi's GEMM backward reads as it is (no concatenation).
``approximate`` is "none" for the exact erf form (ModernBERT's ``gelu``) or "tanh" for the tanh
approximation (``gelu_tanh``), as in ``torch.nn.functional.gelu``.

- :func:`geglu_ref`: the definition, in fp32 and returned in x's dtype.
- :func:`geglu_native`: what the model computed before this op, ``F.gelu(input) * gate`` in x's
  dtype, bit for bit (transformers' ``ModernBertMLP`` does the same).
- :func:`geglu_fused`: ``kernels/csrc/geglu.cu`` through an autograd Function: float32, float16
  and bfloat16, any even width (16-byte vectors where the half width and the pointers allow),
  strided inputs (copied once to contiguous). It saves only x for the backward, where the native
  path also keeps ``gelu(input)``.
- :data:`geglu_compiled`: the reference under ``torch.compile`` (``kernels/compiled.py``).
- ``liger``: liger-kernel's GeGLU where it is installed, for the tanh approximation alone
  (``kernels/liger.py``).

``kernels=auto`` races them at the model's shapes where the model has a GeGLU MLP
(``OpShapes.geglu``); BERT's models have none, and race none.
"""

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from bert_ds.kernels.compiled import CompiledReference
from bert_ds.kernels.dispatch import Backend, Impl, choose, fused_extension
from bert_ds.kernels.liger import geglu_liger, liger_problem

Approximate = Literal["none", "tanh"]
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_FUSED_WIDTH = 2 ** 31 - 1  # the kernels index a half row with a 32-bit int


def geglu_ref(x: torch.Tensor, approximate: Approximate) -> torch.Tensor:
    """x: (..., 2I), ``[input | gate]``. Returns (..., I) in x.dtype."""
    inputs, gate = x.float().chunk(2, dim=-1)
    return (F.gelu(inputs, approximate=approximate) * gate).to(x.dtype)


def geglu_native(x: torch.Tensor, approximate: Approximate) -> torch.Tensor:
    """:func:`geglu_ref` in x's dtype with PyTorch's own ops (its GELU computes half inputs in fp32)."""
    inputs, gate = x.chunk(2, dim=-1)
    return F.gelu(inputs, approximate=approximate) * gate


def geglu_fused(x: torch.Tensor, approximate: Approximate) -> torch.Tensor:
    """:func:`geglu_ref` on the fused kernels."""
    return FusedGeglu.apply(x, approximate)


geglu_compiled = CompiledReference(geglu_ref, rows=(0,))  # x: (T, 2I), T the batch's token count

IMPLEMENTATIONS: dict[Impl, Callable[..., torch.Tensor]] = {
    "native": geglu_native, "fused": geglu_fused, "compiled": geglu_compiled, "liger": geglu_liger}


def geglu(x: torch.Tensor, approximate: Approximate, *, backend: Backend) -> torch.Tensor:
    """:func:`geglu_ref` on the resolved ``backend``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must end in an input half and a gate half (an even last dimension), got shape "
                         f"{tuple(x.shape)}")
    impl = choose("geglu", backend, lambda name: _unsupported(name, x))
    return IMPLEMENTATIONS[impl](x, approximate)


def _unsupported(impl: Impl, x: torch.Tensor) -> str:
    """Why candidate ``impl`` ("fused", "compiled" or "liger") cannot take ``x`` ("" if it can)."""
    if impl == "compiled":  # the reference, which takes any input; raced on a CUDA device
        return "" if x.is_cuda else "its inputs are not all on a CUDA device"
    if impl == "liger":  # raced only where the model's GELU is its tanh form: it refuses the erf one
        return liger_problem(x)
    if not 0 < x.shape[-1] // 2 <= MAX_FUSED_WIDTH:
        return f"a width of {x.shape[-1]} (it takes halves of 1 to {MAX_FUSED_WIDTH} columns)"
    if x.dtype not in FUSED_DTYPES:
        return f"{x.dtype} input (it takes {', '.join(map(str, FUSED_DTYPES))})"
    if not x.is_cuda:
        return "its inputs are not all on a CUDA device"
    return ""


class FusedGeglu(torch.autograd.Function):
    """``gelu(input) * gate`` on the fused kernels; the same arguments as :func:`geglu_ref`."""

    @staticmethod
    def forward(ctx, x, approximate):
        ctx.tanh = approximate == "tanh"
        ctx.save_for_backward(x)
        return fused_extension().geglu_fwd(x, ctx.tanh)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return fused_extension().geglu_bwd(dy, x, ctx.tanh), None
