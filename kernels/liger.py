"""liger-kernel's Triton kernels as candidates of ``kernels=auto``, where the package is installed and
imports (it needs Triton and a CUDA device; bert-ds does not depend on it). Its functional API,
``liger_kernel.functional`` (0.8 and newer), is what is called.

- GeGLU (:func:`geglu_liger`, a candidate of the ``geglu`` op): liger's ``geglu(a, b)`` is
  ``gelu(a) * b`` with the tanh approximation only, so it computes the op where the model's GELU is
  ``gelu_tanh``; with the erf GELU (ModernBERT's) it says so and is no candidate. It takes the two
  halves of ``Wi``'s output (views; liger copies what is not contiguous, which the race pays).
- LayerNorm (:func:`layer_norm_liger`, a candidate of ``layer_norm``): ``layer_norm(x, weight, bias,
  eps)``, whose Triton kernel always has a bias: for a bias-free LayerNorm (ModernBERT's) liger
  hands it zeros, whose gradient it computes and the race pays; a residual is added first, as for
  apex's LayerNorm.
- liger's RoPE is no candidate: it rotates q and k laid out (batch, heads, seq, hd), and the
  rotation is not an op of the race (a rotary model's race times every attention candidate but
  the fused kernels after PyTorch's rotation: ``rotary_attention.rotary_form``).

Each is held to its op's reference at the race's inputs like every other candidate, and a call it
cannot take raises a ``ValueError`` that says why (the race records it as the reason it is out).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch


@functools.cache
def liger_functional() -> ModuleType | str:
    """liger-kernel's functional API (``liger_kernel.functional``), or why it cannot be used: not
    installed, or not importable (no Triton, a build for another torch, a version before 0.8)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "the liger-kernel package is not installed"
    try:
        return importlib.import_module("liger_kernel.functional")
    except Exception as error:  # Triton or torch it cannot work with: say so, as a reason
        lines = str(error).strip().splitlines()
        return f"liger-kernel does not import: {lines[0] if lines else type(error).__name__}"


def on_cuda(*tensors: torch.Tensor | None) -> bool:
    return all(t.is_cuda for t in tensors if t is not None)


def liger_problem(*tensors: torch.Tensor | None) -> str:
    """Why liger-kernel cannot run on these tensors ("" if it can): the device first, so that off
    CUDA the package is never imported."""
    if not on_cuda(*tensors):
        return "its inputs are not all on a CUDA device"
    api = liger_functional()
    return api if isinstance(api, str) else ""


def _refuse(problem: str) -> None:
    if problem:
        raise ValueError(f"liger-kernel cannot take these inputs: {problem}")


def geglu_liger(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """``geglu_ref`` on liger's GeGLU: ``gelu_tanh(input) * gate`` of x's halves."""
    _refuse(liger_problem(x) or ("" if approximate == "tanh" else
                                 f"approximate={approximate!r} (liger's GeGLU is the tanh approximation)"))
    inputs, gate = x.chunk(2, dim=-1)
    return liger_functional().geglu(inputs, gate)


def layer_norm_liger(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``layer_norm_ref`` on liger's LayerNorm (no residual input: summed first)."""
    _refuse(liger_problem(x, weight, bias, residual))
    summed = x if residual is None else x + residual
    return liger_functional().layer_norm(summed, weight, bias, eps)
