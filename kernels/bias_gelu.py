"""Bias add fused with GELU: ``gelu(x + bias)``.

BERT's FFN computes ``gelu(x @ W1^T + b1)`` on a (T, 4H) tensor, the largest
activation of the layer; fusing the bias into the activation saves one full read
and write of it. The model therefore runs the GEMM without its bias and passes
the bias here. ``approximate`` is "none" for the exact erf form (original BERT)
or "tanh" for the tanh approximation, as in ``torch.nn.functional.gelu``. The
arithmetic is done in fp32 and returned in the input dtype.

The fused path (``kernels/csrc/bias_gelu.cu``) takes float32, float16 and bfloat16
inputs, a bias of the input dtype or float32, any width, strided inputs (copied once
to contiguous); its backward sums dbias over rows in fp32.

The native path (:func:`bias_gelu_native`) is ``F.gelu(x + bias)`` in the input
dtype: PyTorch's GELU already computes in fp32 for half inputs, so the reference's
fp32 copies only cost memory traffic; the sum is rounded to the input dtype once.
A bias of another dtype than ``x`` takes the reference (its sum would promote).

``kernels=auto`` also races the reference under ``torch.compile`` (:data:`bias_gelu_compiled`,
``kernels/compiled.py``), which Inductor fuses into one kernel each way.
"""

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from bert_ds.kernels.compiled import CompiledReference
from bert_ds.kernels.dispatch import Backend, Impl, choose, fused_extension

Approximate = Literal["none", "tanh"]
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bias_gelu_ref(x: torch.Tensor, bias: torch.Tensor, approximate: Approximate) -> torch.Tensor:
    """x: (..., N); bias: (N,). Returns (..., N) in x.dtype."""
    return F.gelu(x.float() + bias.float(), approximate=approximate).to(x.dtype)


def bias_gelu_native(x: torch.Tensor, bias: torch.Tensor, approximate: Approximate) -> torch.Tensor:
    """:func:`bias_gelu_ref` through PyTorch's own GELU, without fp32 copies of one-dtype inputs."""
    if bias.dtype != x.dtype:
        return bias_gelu_ref(x, bias, approximate)
    return F.gelu(x + bias, approximate=approximate)


def bias_gelu_fused(x: torch.Tensor, bias: torch.Tensor, approximate: Approximate) -> torch.Tensor:
    """:func:`bias_gelu_ref` on the fused kernels."""
    return FusedBiasGelu.apply(x, bias, approximate)


bias_gelu_compiled = CompiledReference(bias_gelu_ref, rows=(0,))  # x: (T, I), T the batch's token count

IMPLEMENTATIONS: dict[Impl, Callable[..., torch.Tensor]] = {
    "native": bias_gelu_native, "fused": bias_gelu_fused, "compiled": bias_gelu_compiled}


def bias_gelu(
    x: torch.Tensor,
    bias: torch.Tensor,
    approximate: Approximate,
    *,
    backend: Backend,
) -> torch.Tensor:
    """:func:`bias_gelu_ref` on the resolved ``backend``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    impl = choose("bias_gelu", backend, lambda name: _unsupported(name, x, bias))
    return IMPLEMENTATIONS[impl](x, bias, approximate)


def _unsupported(impl: Impl, x, bias) -> str:
    """Why candidate ``impl`` ("fused" or "compiled") cannot take these inputs ("" if it can)."""
    if impl == "compiled":  # the reference, which takes any input; raced on a CUDA device
        return "" if x.is_cuda and bias.is_cuda else "its inputs are not all on a CUDA device"
    if x.dtype not in FUSED_DTYPES:
        return f"{x.dtype} input (it takes {', '.join(map(str, FUSED_DTYPES))})"
    if bias.dtype not in (x.dtype, torch.float32):
        return f"a {bias.dtype} bias for {x.dtype} input (it must be {x.dtype} or float32)"
    if not (x.is_cuda and bias.is_cuda):
        return "its inputs are not all on a CUDA device"
    return ""


class FusedBiasGelu(torch.autograd.Function):
    """``gelu(x + bias)`` on the fused kernels; the same arguments as :func:`bias_gelu_ref`."""

    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.tanh = approximate == "tanh"
        ctx.save_for_backward(x, bias)
        return fused_extension().bias_gelu_fwd(x, bias, ctx.tanh)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, dbias = fused_extension().bias_gelu_bwd(dy, x, bias, ctx.tanh)
        return dx, dbias, None
