"""Every host-device synchronisation of the profiled steps, by the source line that made it.

On a GPU, ``torch.cuda.set_sync_debug_mode("warn")`` makes each call that waits for the
device (``.item()``, ``.cpu()``, ``bool()`` of a device tensor, a copy to the host,
``torch.cuda.synchronize()``, a ``nonzero``) raise the warning "called a synchronizing CUDA
operation". :class:`SyncRecorder` turns that mode on for the steps that
:class:`~bert_ds.train.profiling.StepProfiler` profiles and counts each warning by its
caller: the innermost frame outside torch (DeepSpeed's line, or ours) and the innermost of
bert_ds that led to it. The profile's summary lists them (``host_syncs``), so a GPU session
names every sync left in the step instead of counting them.

The warning is raised from C++ through Python's ``warnings`` machinery while the calling
Python frames are still on the stack; the recorder reads the stack there, in its
``showwarning``. Other warnings pass through to the previous ``showwarning`` unchanged.
"""

from __future__ import annotations

import collections
import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

MESSAGE = "called a synchronizing CUDA operation"  # torch's text (c10/cuda/CUDAFunctions.cpp)
_SKIP = (os.sep + "torch" + os.sep, os.sep + "warnings.py", __file__)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _short(filename: str) -> str:
    """A path as the report shows it: from site-packages or the repository's root."""
    if "site-packages" + os.sep in filename:
        return filename.split("site-packages" + os.sep, 1)[1]
    return filename.removeprefix(_REPO)


def caller(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(where, via): the innermost frame outside torch, and the innermost frame of bert_ds
    (empty where it is the same frame or there is none), each as ``path:line function``."""
    frames = [f for f in stack if not any(part in f.filename for part in _SKIP)]
    if not frames:
        return "(inside torch)", ""
    where = frames[-1]
    ours = [f for f in frames if (os.sep + "bert_ds" + os.sep) in f.filename]
    via = ours[-1] if ours and ours[-1] is not where else None
    return _spelt(where), _spelt(via) if via else ""


def _spelt(frame: traceback.FrameSummary) -> str:
    return f"{_short(frame.filename)}:{frame.lineno} {frame.name}"


class SyncRecorder:
    """Counts the synchronisation warnings between :meth:`start` and :meth:`stop` by caller.

    ``set_mode`` is ``torch.cuda.set_sync_debug_mode``; a test passes its own to run the
    recorder where there is no CUDA."""

    def __init__(self, set_mode: Callable[[Any], None] | None = None):
        self._set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._catch: warnings.catch_warnings | None = None
        self._previous: Callable[..., Any] | None = None

    def start(self) -> None:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()  # restores the filters and showwarning on stop()
        warnings.filterwarnings("always", message=MESSAGE)  # every call, not once per line
        self._previous = warnings.showwarning
        warnings.showwarning = self._show
        self._set_mode("warn")

    def stop(self) -> None:
        if self._catch is None:
            return
        self._set_mode("default")
        catch, self._catch = self._catch, None
        catch.__exit__(None, None, None)

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if MESSAGE in str(message):
            self.counts[caller(traceback.extract_stack()[:-1])] += 1
        elif self._previous is not None:
            self._previous(message, category, filename, lineno, file, line)

    def report(self, steps: int) -> list[dict[str, Any]]:
        """Each caller with its syncs per step, most first."""
        return [{"where": where, "via": via, "per_step": n / steps}
                for (where, via), n in self.counts.most_common()]
