"""Runs, per op call, the implementation the resolved backend names.

The choice is explicit and made once: the model resolves its ``kernels`` setting with
:func:`bert_ds.kernels.choice.resolve_backend` (and its shapes) at construction and hands
the resolved name to every op call. Nothing is switched by environment variables or
import-time probing, so the same config on the same device always runs the same code,
and a request that cannot be met is an error rather than a silent fallback.

Resolved backends, and what each op runs under them (:func:`choose`):

- ``"torch"``: the native PyTorch op everywhere (``<op>_native``: the fastest op
  PyTorch has for the inputs, e.g. its varlen FlashAttention on a GPU).
- ``"cuda"`` (from ``kernels=cuda``): the fused kernel for every op, or an error
  that says why not (the extension does not load, an op failed its self-check, an
  op cannot take these inputs, e.g. float32 attention or attention dropout).
- ``"prefer_cuda"`` (from ``kernels=auto`` on a CUDA device with a candidate to the
  native ops): per op, the fastest correct candidate on this device (the fused
  kernel, the native op, apex's LayerNorm), timed once per device at the model's
  shapes (``kernels/choice.py``, ``kernels/speed.py``) and logged once with the
  timings. Inputs the winner cannot take run the native op, with one warning per op
  and reason.

``kernels=auto`` with no candidate (no CUDA device, no extension and no apex)
resolves to ``"torch"`` and logs why.

The ops import this module, and the device's verdicts (self-check, race) are made by
running the ops: so the verdicts are handed in (:func:`consult`, called by the package's
``__init__``) rather than imported, and the imports point one way: loader, dispatch,
ops, verdicts.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from bert_ds.base.errors import UserError
from bert_ds.kernels._build import load_extension

if TYPE_CHECKING:  # bert_ds.kernels.speed imports the ops, which import this module
    from bert_ds.kernels.speed import Choice

Backend = Literal["cuda", "prefer_cuda", "torch"]  # what an op runs on, after resolution
Impl = Literal["fused", "native", "apex"]  # an op's implementations: ours, PyTorch's, apex's
OPS = ("layer_norm", "bias_gelu", "varlen_attention", "lamb_update")

logger = logging.getLogger(__name__)


class KernelUnavailable(UserError):
    """``kernels=cuda`` was requested where a fused kernel cannot run."""


# What choose() consults, handed in by consult(): per op, "" or why its fused kernel failed the
# self-check; per op, the race's winner on this device.
_verdicts: Callable[[], Mapping[str, str]] | None = None
_choices: Callable[[], Mapping[str, Choice]] | None = None


def consult(verdicts: Callable[[], Mapping[str, str]], choices: Callable[[], Mapping[str, Choice]]) -> None:
    """Where :func:`choose` reads the device's verdicts (:func:`bert_ds.kernels.choice.op_verdicts`
    and :func:`~bert_ds.kernels.choice.op_choices`, computed the first time they are read)."""
    global _verdicts, _choices
    _verdicts, _choices = verdicts, choices


def _consulted(verdicts: Callable[[], Mapping[str, Any]] | None) -> Mapping[str, Any]:
    if verdicts is None:
        raise RuntimeError("bert_ds.kernels.dispatch.consult() was never called (bert_ds/kernels/__init__.py calls it)")
    return verdicts()


def choose(op: str, backend: Backend, unsupported: Callable[[Impl], str]) -> Impl:
    """Which implementation of ``op`` runs under ``backend`` for the inputs at hand.

    ``unsupported(impl)`` is the op's reason why ``impl`` cannot take these inputs ("" when
    it can). Under "cuda" any obstacle to the fused kernel is a :class:`KernelUnavailable`;
    under "prefer_cuda" the op's recorded winner runs where it takes the inputs, else the
    native op (logged once per op and reason). A name that
    :func:`~bert_ds.kernels.choice.resolve_backend` never returns is a ``ValueError`` (a
    programming error).
    """
    if backend == "torch":
        return "native"
    if backend == "cuda":
        problem = _fused_problem(op) or unsupported("fused")
        if problem:
            raise KernelUnavailable(f"kernels=cuda: {op} cannot run fused: {problem}")
        return "fused"
    if backend != "prefer_cuda":
        raise ValueError(f"backend must be 'cuda', 'prefer_cuda' or 'torch' (see resolve_backend); got {backend!r}")
    winner = _consulted(_choices)[op].runs
    if winner == "native":
        return "native"
    problem = unsupported(winner)
    if problem:
        _log_fallback(op, winner, problem)
        return "native"
    return winner


def _fused_problem(op: str) -> str:
    extension, reason = load_extension()
    if extension is None:
        return f"the fused CUDA kernels cannot load: {reason}"
    failed = _consulted(_verdicts).get(op, "")
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
