"""Runs, per op call, the implementation the resolved backend names.

The choice is explicit and made once per model: the model resolves its ``kernels`` setting
with :func:`bert_ds.kernels.choice.resolve_backend` (and its shapes) at construction and
hands the resolved backend to every op call. Nothing is switched by environment variables
or import-time probing, so the same config on the same device always runs the same code,
and a request that cannot be met is an error rather than a silent fallback.

Resolved backends, and what each op runs under them (:func:`choose`):

- ``"torch"``: the native PyTorch op everywhere (``<op>_native``: the fastest op
  PyTorch has for the inputs, e.g. its varlen FlashAttention on a GPU).
- ``"cuda"`` (from ``kernels=cuda``): the fused kernel for every op, or an error
  that says why not (the extension does not load, an op failed its self-check, an
  op cannot take these inputs, e.g. float32 attention or attention dropout).
- an :class:`OpPlan` (from ``kernels=auto`` on a CUDA device): per op, the implementation that won the race at the model's shapes
  (``kernels/choice.py``, ``kernels/speed.py``): the fused kernel, the native op, the
  reference under ``torch.compile``, apex's LayerNorm, torch's ``varlen_attn`` or one SDPA
  backend. The plan travels with the model, not with the process: two models built at
  different shapes (the two phases of BERT's recipe) each run their own winners. Inputs the
  winner cannot take run the native op, with one warning per op, winner and reason.

``kernels=auto`` without a CUDA device to race on resolves to ``"torch"`` and logs why.

The ops import this module, and the self-check's verdicts are made by running the ops: so
they are handed in (:func:`consult`, which :mod:`~bert_ds.kernels.choice` calls as it is
imported) rather than imported, and the imports point one way: loader, dispatch, ops, verdicts. The race's
verdicts need no such door: they reach the ops inside the plan.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Literal, get_args

from bert_ds.base.errors import UserError
from bert_ds.kernels._build import load_extension

# An op's implementations: the native op; our fused kernel; its reference under torch.compile;
# apex's LayerNorm; liger-kernel's LayerNorm and GeGLU; torch's varlen FlashAttention, flash-attn's;
# SDPA restricted to one backend around a padded (or, for flash, nested) batch; FlexAttention.
Impl = Literal["native", "fused", "compiled", "apex", "liger", "varlen_attn", "flash_attn", "sdpa_flash",
               "sdpa_efficient", "sdpa_cudnn", "flex"]
OPS = ("layer_norm", "dropout_add_layer_norm", "bias_gelu", "varlen_attention", "mlm_cross_entropy", "lamb_update",
       "geglu", "local_attention")
# Every op has a fused kernel and is raced; a model races only the ops it has (speed.OpShapes.has):
# BERT neither GeGLU nor the local layers' windowed attention (kernels/local_attention.py).

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpPlan:
    """``kernels=auto`` resolved at one model's shapes: per op, the implementation that won there.

    Frozen and hashable, so that a model holds it as a constant: ``torch.compile`` guards on it
    instead of tracing it, and a model of other shapes holds another plan.
    """

    runs: tuple[tuple[str, Impl], ...]  # (op, winner) for each op raced
    shapes: str  # the key of the shapes it was raced at (``OpShapes.key``), as the record files it

    def winner(self, op: str) -> Impl:
        for name, impl in self.runs:
            if name == op:
                return impl
        raise ValueError(f"{op} was not raced for this plan (it names {', '.join(name for name, _ in self.runs)})")

    def has(self, op: str) -> bool:
        """Whether ``op`` was raced for this plan."""
        return any(name == op for name, _ in self.runs)

    def describe(self) -> str:
        return "auto: " + ", ".join(f"{op} {impl}" for op, impl in self.runs)


KernelSetting = Literal["auto", "cuda", "torch"]  # what a config may ask for (resolved by choice.resolve_backend)
SETTINGS = get_args(KernelSetting)
Backend = Literal["cuda", "torch"] | OpPlan  # what an op runs on, after resolution


class KernelUnavailable(UserError):
    """``kernels=cuda`` was requested where a fused kernel cannot run."""


# What choose() consults under "cuda", handed in by consult(): per op, "" or why its fused
# kernel failed the self-check.
_verdicts: Callable[[], Mapping[str, str]] | None = None


def consult(verdicts: Callable[[], Mapping[str, str]]) -> None:
    """Where :func:`choose` reads the device's self-check verdicts
    (:func:`bert_ds.kernels.choice.op_verdicts`, computed the first time they are read)."""
    global _verdicts
    _verdicts = verdicts


def choose(op: str, backend: Backend, unsupported: Callable[[Impl], str]) -> Impl:
    """Which implementation of ``op`` runs under ``backend`` for the inputs at hand.

    ``unsupported(impl)`` is the op's reason why ``impl`` cannot take these inputs ("" when
    it can). Under "cuda" any obstacle to the fused kernel is a :class:`KernelUnavailable`;
    under a plan the op's winner runs where it takes the inputs, else the native op (logged
    once per op, winner and reason). A backend that
    :func:`~bert_ds.kernels.choice.resolve_backend` never returns is a ``ValueError`` (a
    programming error).
    """
    if isinstance(backend, OpPlan):
        winner = backend.winner(op)
        if winner == "native":
            return "native"
        problem = unsupported(winner)
        if problem:
            _log_fallback(op, winner, problem)
            return "native"
        return winner
    if backend == "torch":
        return "native"
    if backend == "cuda":
        problem = _fused_problem(op) or unsupported("fused")
        if problem:
            raise KernelUnavailable(f"kernels=cuda: {op} cannot run fused: {problem}")
        return "fused"
    raise ValueError(f"backend must be 'cuda', 'torch' or an OpPlan (see resolve_backend); got {backend!r}")


def _fused_problem(op: str) -> str:
    extension, reason = load_extension()
    if extension is None:
        return f"the fused CUDA kernels cannot load: {reason}"
    if _verdicts is None:
        raise RuntimeError("bert_ds.kernels.dispatch.consult() was never called (importing bert_ds.kernels.choice "
                           "calls it, and so does importing bert_ds.kernels.ops)")
    failed = _verdicts().get(op, "")
    return f"its fused kernel failed the self-check ({failed})" if failed else ""


@functools.cache
def _log_fallback(op: str, winner: str, problem: str) -> None:
    logger.warning("kernels=auto: %s runs the native op where %s cannot: %s", op, winner, problem)


def fused_extension() -> ModuleType:
    """The loaded extension, for the autograd Functions (after :func:`choose` said "fused")."""
    extension, reason = load_extension()
    if extension is None:
        raise KernelUnavailable(f"the fused CUDA kernels cannot load: {reason}")
    return extension
