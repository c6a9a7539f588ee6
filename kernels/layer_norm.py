"""LayerNorm with an optional fused residual add: ``LayerNorm(x + residual)``.

Post-LN BERT ends every sublayer with ``LayerNorm(dropout(dense(h)) + h_in)``;
taking the residual as an argument lets the fused kernel read both inputs once
instead of materialising the sum. The sum and the statistics are computed in fp32
whatever the input dtype, because a bf16 mean/variance over ~1000 features loses
most of its precision; the output is returned in the input dtype.

The fused path (``kernels/csrc/layer_norm.cu``) takes float32, float16 and bfloat16
inputs with a residual and weights of the input dtype or float32 (what autocast over
fp32 parameters produces), any hidden size (768 and 1024 are the fast ones), strided
inputs (copied once to contiguous). It saves the per-row mean and rstd (fp32) and
recomputes ``x + residual`` in the backward, where one pass gives the gradient of
both ``x`` and ``residual`` (written twice only when their dtypes differ).
"""

import torch
import torch.nn.functional as F

from kernels.dispatch import Backend, fused_extension, runs_fused

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x, residual: (..., H); weight, bias: (H,). Returns (..., H) in x.dtype."""
    summed = x.float() if residual is None else x.float() + residual.float()
    out = F.layer_norm(summed, summed.shape[-1:], weight.float(), bias.float(), eps)
    return out.to(x.dtype)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    backend: Backend,
) -> torch.Tensor:
    """:func:`layer_norm_ref` on the resolved ``backend``."""
    if runs_fused("layer_norm", backend, _unsupported(x, weight, bias, residual)):
        return FusedLayerNorm.apply(x, weight, bias, eps, residual)
    return layer_norm_ref(x, weight, bias, eps, residual)


def _unsupported(x, weight, bias, residual) -> str:
    """Why the fused kernel cannot take these inputs ("" if it can)."""
    if x.dtype not in FUSED_DTYPES:
        return f"{x.dtype} input (it takes {', '.join(map(str, FUSED_DTYPES))})"
    if weight.dtype not in (x.dtype, torch.float32) or bias.dtype != weight.dtype:
        return f"{weight.dtype}/{bias.dtype} weight/bias for {x.dtype} input (they must be {x.dtype} or float32)"
    if residual is not None and residual.dtype not in (x.dtype, torch.float32):
        return f"a {residual.dtype} residual for {x.dtype} input (it must be {x.dtype} or float32)"
    if not all(t.is_cuda for t in (x, weight, bias, residual) if t is not None):
        return "its inputs are not all on a CUDA device"
    return ""


class FusedLayerNorm(torch.autograd.Function):
    """``LayerNorm(x + residual)`` on the fused kernels; the same arguments as :func:`layer_norm_ref`."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, residual):
        y, mean, rstd = fused_extension().layer_norm_fwd(x, weight, bias, residual, eps)
        ctx.save_for_backward(x, weight, mean, rstd, residual)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd, residual = ctx.saved_tensors
        dx, dweight, dbias, dresidual = fused_extension().layer_norm_bwd(dy, x, residual, weight, mean, rstd)
        return dx, dweight, dbias, None, dresidual
