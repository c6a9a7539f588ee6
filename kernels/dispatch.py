"""Chooses between the fused CUDA kernels and the PyTorch reference path.

The choice is explicit and made once: the model calls :func:`resolve_backend` on
its ``kernels`` setting at construction and hands the resolved name to every op
call. Nothing is switched by environment variables or import-time probing, so the
same config always runs the same code, and a request that cannot be met is an
error rather than a silent fallback.
"""

import functools
import logging
from types import ModuleType
from typing import Literal

import torch

from data_tools.errors import UserError
from kernels._build import load_extension

Backend = Literal["cuda", "torch"]  # what an op runs on, after resolution
REQUESTS = ("auto", "cuda", "torch")  # what a config may ask for

logger = logging.getLogger(__name__)


class KernelUnavailable(UserError):
    """``kernels=cuda`` was requested where the fused extension cannot load."""


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
        return "cuda"
    if requested == "auto":
        return _auto_backend()
    raise UnknownKernelBackend(f"kernels must be one of {', '.join(REQUESTS)}; got {requested!r}")


@functools.cache
def _auto_backend() -> Backend:
    # Cached so that the choice is logged once per process, not once per model.
    extension, reason = load_extension()
    if extension is not None:
        logger.info("kernels=auto: running the fused CUDA kernels")
        return "cuda"
    # A GPU without the kernels is a slow run the user probably did not intend.
    log = logger.warning if torch.cuda.is_available() else logger.info
    log("kernels=auto: running the PyTorch reference kernels (%s)", reason)
    return "torch"


def require_extension(backend: str) -> ModuleType:
    """The loaded extension, for an op called with ``backend="cuda"``.

    Raises :class:`KernelUnavailable` when it cannot load, so that the CUDA branch
    of an op is never a silent fallback, and ``ValueError`` for a name that
    :func:`resolve_backend` would never return (a programming error).
    """
    if backend != "cuda":
        raise ValueError(f"backend must be 'cuda' or 'torch' (see resolve_backend); got {backend!r}")
    extension, reason = load_extension()
    if extension is None:
        raise KernelUnavailable(f"the fused CUDA kernels cannot load: {reason}")
    return extension
