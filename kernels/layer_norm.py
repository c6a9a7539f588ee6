"""LayerNorm with an optional fused residual add: ``LayerNorm(x + residual)``, with or without a bias.

Post-LN BERT ends every sublayer with ``LayerNorm(dropout(dense(h)) + h_in)``;
taking the residual as an argument lets the fused kernel read both inputs once
instead of materialising the sum. The sum and the statistics are computed in fp32
whatever the input dtype, because a bf16 mean/variance over ~1000 features loses
most of its precision; the output is returned in the input dtype. ``bias=None`` is a LayerNorm
without one (``nn.LayerNorm(bias=False)``, ModernBERT's): every implementation then computes no bias
gradient, and the fused kernels read no bias.

The fused path (``kernels/csrc/layer_norm.cu``) takes float32, float16 and bfloat16
inputs with a residual and weights of the input dtype or float32 (what autocast over
fp32 parameters produces), any hidden size (768 and 1024 are the fast ones), strided
inputs (copied once to contiguous). It saves the per-row mean and rstd (fp32) and
recomputes ``x + residual`` in the backward, where one pass gives the gradient of
both ``x`` and ``residual`` (written twice only when their dtypes differ).

The native path (:func:`layer_norm_native`) is ``F.layer_norm`` on the inputs as
they are where that accumulates in fp32: on CUDA, for every dtype (statistics and
weight gradients alike), so the reference's fp32 copies only cost memory traffic;
the residual sum is then rounded to the input dtype once, as in Hugging Face's BERT.
Elsewhere the reference runs: a CPU's half-precision backward sums the weight
gradients in the input dtype, and inputs of mixed dtypes (float32 weights under
autocast) are not what ``F.layer_norm`` takes.

Two more candidates under ``kernels=auto`` (``kernels/choice.py``), each run only where it
is correct and the fastest on the device at the model's shapes: the reference under
``torch.compile`` (:data:`layer_norm_compiled`, ``kernels/compiled.py``), where NVIDIA
apex is installed and passes the same self-check, its fused LayerNorm
(``fused_layer_norm_affine``), and where liger-kernel is installed, its Triton LayerNorm
(``kernels/liger.py``).
"""

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bert_ds.kernels.compiled import CompiledReference
from bert_ds.kernels.dispatch import Backend, Impl, choose, fused_extension
from bert_ds.kernels.liger import layer_norm_liger, liger_problem

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def find_apex_layer_norm() -> Callable[..., torch.Tensor] | None:
    """apex's functional fused LayerNorm ``(x, weight, bias, normalized_shape, eps)``, where installed."""
    try:
        module = importlib.import_module("apex.normalization.fused_layer_norm")
    except ImportError:
        return None
    return getattr(module, "fused_layer_norm_affine", None)


APEX_LAYER_NORM = find_apex_layer_norm()


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x, residual: (..., H); weight, bias: (H,) (bias None: none). Returns (..., H) in x.dtype."""
    summed = x.float() if residual is None else x.float() + residual.float()
    out = F.layer_norm(summed, summed.shape[-1:], weight.float(), None if bias is None else bias.float(), eps)
    return out.to(x.dtype)


def layer_norm_native(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`layer_norm_ref` through PyTorch's own LayerNorm, without fp32 copies where it needs none."""
    if _mixed_dtypes(x, weight, bias, residual) or not (x.is_cuda or x.dtype == torch.float32):
        return layer_norm_ref(x, weight, bias, eps, residual)
    summed = x if residual is None else x + residual
    # CUDA autocast runs layer_norm in fp32; the op's contract is x's dtype (a no-op elsewhere).
    return F.layer_norm(summed, summed.shape[-1:], weight, bias, eps).to(x.dtype)


def layer_norm_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`layer_norm_ref` on the fused kernels."""
    return FusedLayerNorm.apply(x, weight, bias, eps, residual)


def layer_norm_apex(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`layer_norm_ref` on apex's fused LayerNorm (which has no residual input: summed first)."""
    if APEX_LAYER_NORM is None:
        raise RuntimeError("apex is not installed")
    summed = x if residual is None else x + residual
    return APEX_LAYER_NORM(summed, weight, bias, summed.shape[-1:], eps)


# x and residual: (T, H), T the batch's token count
layer_norm_compiled = CompiledReference(layer_norm_ref, rows=(0, 4))

IMPLEMENTATIONS: dict[Impl, Callable[..., torch.Tensor]] = {
    "native": layer_norm_native, "fused": layer_norm_fused, "compiled": layer_norm_compiled, "apex": layer_norm_apex,
    "liger": layer_norm_liger}


def _mixed_dtypes(x, weight, bias, residual) -> bool:
    return any(t is not None and t.dtype != x.dtype for t in (weight, bias, residual))


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    backend: Backend,
) -> torch.Tensor:
    """:func:`layer_norm_ref` on the resolved ``backend``."""
    impl = choose("layer_norm", backend, lambda name: _unsupported(name, x, weight, bias, residual))
    return IMPLEMENTATIONS[impl](x, weight, bias, eps, residual)


def _unsupported(impl: Impl, x, weight, bias, residual) -> str:
    """Why candidate ``impl`` ("fused", "compiled", "apex" or "liger") cannot take these inputs ("" if it can)."""
    on_cuda = all(t.is_cuda for t in (x, weight, bias, residual) if t is not None)
    if impl == "compiled":  # the reference, which takes any input; raced on a CUDA device
        return "" if on_cuda else "its inputs are not all on a CUDA device"
    if impl == "apex" and _mixed_dtypes(x, weight, bias, residual):
        return f"mixed dtypes ({x.dtype} input; apex's LayerNorm takes one dtype)"
    if impl == "apex" and bias is None:
        return "no bias (apex's affine LayerNorm takes one)"
    if impl == "liger" and _mixed_dtypes(x, weight, bias, residual):
        return f"mixed dtypes ({x.dtype} input; liger's LayerNorm is raced in one dtype)"
    if impl == "liger":
        return liger_problem(x, weight, bias, residual)
    if x.dtype not in FUSED_DTYPES:
        return f"{x.dtype} input (it takes {', '.join(map(str, FUSED_DTYPES))})"
    if weight.dtype not in (x.dtype, torch.float32) or (bias is not None and bias.dtype != weight.dtype):
        return (f"{weight.dtype}/{None if bias is None else bias.dtype} weight/bias for {x.dtype} input "
                f"(they must be {x.dtype} or float32)")
    if residual is not None and residual.dtype not in (x.dtype, torch.float32):
        return f"a {residual.dtype} residual for {x.dtype} input (it must be {x.dtype} or float32)"
    if not on_cuda:
        return "its inputs are not all on a CUDA device"
    return ""


class FusedLayerNorm(torch.autograd.Function):
    """``LayerNorm(x + residual)`` on the fused kernels; the same arguments as :func:`layer_norm_ref`."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, residual):
        y, mean, rstd = fused_extension().layer_norm_fwd(x, weight, bias, residual, eps)
        ctx.save_for_backward(x, weight, mean, rstd, residual)
        ctx.with_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd, residual = ctx.saved_tensors
        dx, dweight, dbias, dresidual = fused_extension().layer_norm_bwd(dy, x, residual, weight, mean, rstd,
                                                                         ctx.with_bias)
        return dx, dweight, dbias, None, dresidual
