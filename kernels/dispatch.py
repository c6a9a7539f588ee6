"""Chooses between the fused CUDA kernels and the PyTorch reference path.

The choice is explicit and made once: the model calls :func:`resolve_backend` on
its ``kernels`` setting at construction and hands the resolved name to every op
call. Nothing is switched by environment variables or import-time probing, so the
same config always runs the same code, and a request that cannot be met is an
error rather than a silent fallback.

Resolved backends:

- ``"torch"``: the reference everywhere.
- ``"cuda"`` (from ``kernels=cuda``): the fused kernel for every op, or an error
  that says why not (the extension does not load, an op failed its self-check, an
  op cannot take these inputs, e.g. float32 attention or attention dropout).
- ``"prefer_cuda"`` (from ``kernels=auto`` where the extension loads): the fused
  kernel where the op passed its self-check and takes the inputs, else the reference,
  with one warning per op and reason.

``kernels=auto`` without a loadable extension resolves to ``"torch"`` and logs why.
"""

import functools
import logging
from types import ModuleType
from typing import Literal

import torch

from data_tools.errors import UserError
from kernels._build import load_extension, op_verdicts, verdict_path

Backend = Literal["cuda", "prefer_cuda", "torch"]  # what an op runs on, after resolution
REQUESTS = ("auto", "cuda", "torch")  # what a config may ask for
OPS = ("layer_norm", "bias_gelu", "varlen_attention")

logger = logging.getLogger(__name__)


class KernelUnavailable(UserError):
    """``kernels=cuda`` was requested where a fused kernel cannot run."""


class UnknownKernelBackend(UserError):
    """The ``kernels`` setting names no known backend."""


def resolve_backend(requested: str) -> Backend:
    """Maps a ``kernels`` setting ("auto" | "cuda" | "torch") to the backend the ops run."""
    if requested == "torch":
        return "torch"
    if requested == "cuda":
        extension, reason = load_extension()
        if extension is None:
            raise KernelUnavailable(
                f"kernels=cuda was requested but the fused CUDA kernels cannot load: {reason}; "
                "use kernels=torch (or auto) to run the PyTorch reference path"
            )
        failed = {op: why for op, why in op_verdicts().items() if why}
        if failed:
            raise KernelUnavailable(
                "kernels=cuda was requested but fused kernels failed their self-check on this device: "
                + "; ".join(f"{op}: {why}" for op, why in sorted(failed.items()))
                + f" (recorded in {verdict_path()}; `python -m kernels.build --recheck` checks again); "
                "use kernels=auto to run the reference for those ops"
            )
        return "cuda"
    if requested == "auto":
        return _auto_backend()
    raise UnknownKernelBackend(f"kernels must be one of {', '.join(REQUESTS)}; got {requested!r}")


@functools.cache
def _auto_backend() -> Backend:
    # Cached so that the choice is logged once per process, not once per model.
    extension, reason = load_extension()
    if extension is None:
        # A GPU without the kernels is a slow run the user probably did not intend.
        log = logger.warning if torch.cuda.is_available() else logger.info
        log("kernels=auto: running the PyTorch reference kernels (%s)", reason)
        return "torch"
    failed = {op: why for op, why in op_verdicts().items() if why}
    if failed:
        for op, why in sorted(failed.items()):
            logger.warning("kernels=auto: %s runs the PyTorch reference: its fused kernel failed the self-check (%s)",
                           op, why)
    fused = [op for op in OPS if op not in failed]
    logger.info("kernels=auto: running the fused CUDA kernels (%s)", ", ".join(fused) or "none")
    return "prefer_cuda"


def runs_fused(op: str, backend: Backend, unsupported: str = "") -> bool:
    """Whether ``op`` runs its fused kernel under ``backend`` for the inputs at hand.

    ``unsupported`` is the op's own reason why these inputs cannot run fused ("" when
    they can). Under "cuda" any obstacle is a :class:`KernelUnavailable`; under
    "prefer_cuda" it means the reference runs (logged once per op and reason). A name
    that :func:`resolve_backend` never returns is a ``ValueError`` (a programming error).
    """
    if backend == "torch":
        return False
    if backend not in ("cuda", "prefer_cuda"):
        raise ValueError(f"backend must be 'cuda', 'prefer_cuda' or 'torch' (see resolve_backend); got {backend!r}")
    extension, reason = load_extension()
    if extension is None:
        problem = f"the fused CUDA kernels cannot load: {reason}"
    else:
        failed = op_verdicts().get(op, "")
        problem = f"its fused kernel failed the self-check ({failed})" if failed else unsupported
    if not problem:
        return True
    if backend == "cuda":
        raise KernelUnavailable(f"kernels=cuda: {op} cannot run fused: {problem}")
    _log_fallback(op, problem)
    return False


@functools.cache
def _log_fallback(op: str, problem: str) -> None:
    logger.warning("kernels=auto: %s runs the PyTorch reference: %s", op, problem)


def fused_extension() -> ModuleType:
    """The loaded extension, for the autograd Functions (after :func:`runs_fused` said yes)."""
    extension, reason = load_extension()
    if extension is None:
        raise KernelUnavailable(f"the fused CUDA kernels cannot load: {reason}")
    return extension
