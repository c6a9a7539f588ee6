"""LayerNorm with an optional fused residual add: ``LayerNorm(x + residual)``.

Post-LN BERT ends every sublayer with ``LayerNorm(dropout(dense(h)) + h_in)``;
taking the residual as an argument lets the fused kernel read both inputs once
instead of materialising the sum. The sum and the statistics are computed in fp32
whatever the input dtype, because a bf16 mean/variance over ~1000 features loses
most of its precision; the output is returned in the input dtype.
"""

import torch
import torch.nn.functional as F

from kernels.dispatch import Backend, require_extension


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
    if backend == "torch":
        return layer_norm_ref(x, weight, bias, eps, residual)
    return require_extension(backend).layer_norm(x, weight, bias, eps, residual)
