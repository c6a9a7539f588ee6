"""Chooses, per op, between the fused CUDA kernels and PyTorch's native ops.

The choice is explicit and made once: the model calls :func:`resolve_backend` on
its ``kernels`` setting (and its shapes) at construction and hands the resolved name
to every op call. Nothing is switched by environment variables or import-time
probing, so the same config on the same device always runs the same code, and a
request that cannot be met is an error rather than a silent fallback.

Resolved backends, and what each op runs under them (:func:`choose`):

- ``"torch"``: the native PyTorch op everywhere (``<op>_native``: the fastest op
  PyTorch has for the inputs, e.g. its varlen FlashAttention on a GPU).
- ``"cuda"`` (from ``kernels=cuda``): the fused kernel for every op, or an error
  that says why not (the extension does not load, an op failed its self-check, an
  op cannot take these inputs, e.g. float32 attention or attention dropout).
- ``"prefer_cuda"`` (from ``kernels=auto`` on a CUDA device with a candidate to the
  native ops): per op, the fastest correct candidate on this device (the fused
  kernel, the native op, apex's LayerNorm), timed once per device at the model's
  shapes (``kernels/_build.py``, ``kernels/speed.py``) and logged once with the
  timings. Inputs the winner cannot take run the native op, with one warning per op
  and reason.

``kernels=auto`` with no candidate (no CUDA device, no extension and no apex)
resolves to ``"torch"`` and logs why.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Literal

import torch

from bert_ds.base.errors import UserError
from bert_ds.kernels._build import load_extension, op_choices, op_verdicts, verdict_path

if TYPE_CHECKING:  # bert_ds.kernels.speed imports the ops, which import this module
    from bert_ds.kernels.speed import OpShapes

Backend = Literal["cuda", "prefer_cuda", "torch"]  # what an op runs on, after resolution
Impl = Literal["fused", "native", "apex"]  # an op's implementations: ours, PyTorch's, apex's
REQUESTS = ("auto", "cuda", "torch")  # what a config may ask for
OPS = ("layer_norm", "bias_gelu", "varlen_attention")

logger = logging.getLogger(__name__)


class KernelUnavailable(UserError):
    """``kernels=cuda`` was requested where a fused kernel cannot run."""


class UnknownKernelBackend(UserError):
    """The ``kernels`` setting names no known backend."""


def resolve_backend(requested: str, shapes: OpShapes | None = None) -> Backend:
    """Maps a ``kernels`` setting ("auto" | "cuda" | "torch") to the backend the ops run.

    ``shapes``: the model's, at which ``auto`` times the candidates the first time it
    meets a device (a BERT-Base's when None).
    """
    if requested == "torch":
        return "torch"
    if requested == "cuda":
        extension, reason = load_extension()
        if extension is None:
            raise KernelUnavailable(
                f"kernels=cuda was requested but the fused CUDA kernels cannot load: {reason}; "
                "use kernels=torch (or auto) to run the native PyTorch ops"
            )
        failed = {op: why for op, why in op_verdicts().items() if why}
        if failed:
            raise KernelUnavailable(
                "kernels=cuda was requested but fused kernels failed their self-check on this device: "
                + "; ".join(f"{op}: {why}" for op, why in sorted(failed.items()))
                + f" (recorded in {verdict_path()}; `python -m bert_ds.kernels.build --recheck` checks again); "
                "use kernels=auto to run the native op for those ops"
            )
        return "cuda"
    if requested == "auto":
        return _auto_backend(shapes)
    raise UnknownKernelBackend(f"kernels must be one of {', '.join(REQUESTS)}; got {requested!r}")


@functools.cache
def _auto_backend(shapes: OpShapes | None) -> Backend:
    from bert_ds.kernels.layer_norm import APEX_LAYER_NORM  # the ops import this module

    extension, reason = load_extension()
    apex_on_a_gpu = APEX_LAYER_NORM is not None and torch.cuda.is_available()
    if extension is None and not apex_on_a_gpu:  # nothing to choose from but the native ops
        # A GPU without the kernels is a slower run than the user may have intended.
        log = logger.warning if torch.cuda.is_available() else logger.info
        log("kernels=auto: running the native PyTorch ops (%s)", reason)
        return "torch"
    for op, why in sorted(op_verdicts().items()):
        if why:
            _log_once(logging.WARNING, f"kernels=auto: {op} never runs its fused kernel here: "
                                       f"it failed the self-check ({why})")
    for op, choice in op_choices(shapes).items():
        _log_once(logging.INFO, f"kernels=auto: {op} {choice.describe()}")
    return "prefer_cuda"


@functools.cache
def _log_once(level: int, message: str) -> None:
    # Once per process, whatever the number of models (the choice is the device's, not the model's).
    logger.log(level, message)


def choose(op: str, backend: Backend, unsupported: Callable[[Impl], str]) -> Impl:
    """Which implementation of ``op`` runs under ``backend`` for the inputs at hand.

    ``unsupported(impl)`` is the op's reason why ``impl`` cannot take these inputs ("" when
    it can). Under "cuda" any obstacle to the fused kernel is a :class:`KernelUnavailable`;
    under "prefer_cuda" the op's recorded winner runs where it takes the inputs, else the
    native op (logged once per op and reason). A name that :func:`resolve_backend` never
    returns is a ``ValueError`` (a programming error).
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
    winner = op_choices()[op].runs
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
    failed = op_verdicts().get(op, "")
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
