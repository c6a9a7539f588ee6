"""Bias add fused with GELU: ``gelu(x + bias)``.

BERT's FFN computes ``gelu(x @ W1^T + b1)`` on a (T, 4H) tensor, the largest
activation of the layer; fusing the bias into the activation saves one full read
and write of it. The model therefore runs the GEMM without its bias and passes
the bias here. ``approximate`` is "none" for the exact erf form (original BERT)
or "tanh" for the tanh approximation, as in ``torch.nn.functional.gelu``. The
arithmetic is done in fp32 and returned in the input dtype.
"""

from typing import Literal

import torch
import torch.nn.functional as F

from kernels.dispatch import Backend, require_extension

Approximate = Literal["none", "tanh"]


def bias_gelu_ref(x: torch.Tensor, bias: torch.Tensor, approximate: Approximate) -> torch.Tensor:
    """x: (..., N); bias: (N,). Returns (..., N) in x.dtype."""
    return F.gelu(x.float() + bias.float(), approximate=approximate).to(x.dtype)


def bias_gelu(
    x: torch.Tensor,
    bias: torch.Tensor,
    approximate: Approximate,
    *,
    backend: Backend,
) -> torch.Tensor:
    """:func:`bias_gelu_ref` on the resolved ``backend``."""
    if backend == "torch":
        return bias_gelu_ref(x, bias, approximate)
    return require_extension(backend).bias_gelu(x, bias, approximate)
