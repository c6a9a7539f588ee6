"""Ctrl-C held back while modules initialise, and acted on right after.

Python's own SIGINT handler raises ``KeyboardInterrupt`` at the next bytecode of the main
thread, wherever that is. During the start-up imports (torch, DeepSpeed, the run's modules)
that is inside some module's initialisation, where the exception does harm that no
``except`` in the entry point undoes:
- a library's bare ``except:`` around an optional import swallows it, and the process goes on
  as if no key was pressed; a metaclass turns it into a ``RuntimeError`` (pydantic's
  ``__set_name__``, in DeepSpeed's config classes). Of 50 Ctrl-Cs during
  ``import torch, deepspeed`` (2-core machine, 2026-11-28), 2 were swallowed and 1 became that
  ``RuntimeError``.
- a ``KeyboardInterrupt`` that leaves an ``exec`` of source text (every ``@dataclass`` makes
  its ``__init__`` so) marks itself unhandled in CPython 3.11 even once it is caught, and the
  interpreter then kills itself with SIGINT at exit, after the entry point printed its line:
  status -2 where it returned 130. 3 of 31 trainer starts Ctrl-C'd during their imports on
  a busy 2-core machine ended so.

:func:`deferred_interrupt` records a SIGINT inside its block instead, and hands it to the
handler that was in place (Python's: ``KeyboardInterrupt``) when the block ends, at a line
of the entry point's own code. The wait is the block's length: the imports, 2-4 s.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """SIGINT recorded inside the block and delivered to the previous handler as it ends
    (when the block raises, its exception goes on and the signal is dropped with the run).
    Outside the main thread, where no handler can be set, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


def import_whole(*names: str) -> None:
    """Import the modules ``names`` (torch, transformers, matplotlib: seconds of initialisation)
    with a Ctrl-C held until they are whole; the entry point's own handling then sees it."""
    with deferred_interrupt():
        for name in names:
            importlib.import_module(name)
