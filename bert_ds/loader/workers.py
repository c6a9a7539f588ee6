"""Loader worker processes and stop signals: a worker never ends on a stop signal meant for
its trainer, and no worker outlives the trainer (R13, R14).

A stop signal (Ctrl-C, SIGTERM, SIGUSR1) asks the trainer to checkpoint and exit
(:mod:`bert_ds.train.signals`); the loader's workers must keep serving batches until it does.
"""

from __future__ import annotations

import atexit
import multiprocessing
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def loader_worker_init(worker_id: int) -> None:
    """``worker_init_fn`` of the training data loader (runs after PyTorch set its own worker
    handlers): the worker ignores stop signals. Without this, PyTorch's SIGTERM handler
    ends the worker and the trainer fails on its next batch instead of checkpointing."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def end_loader_workers_at_exit() -> None:
    """In the trainer process, once: at interpreter exit, SIGKILL the daemonic children left.

    multiprocessing ends a process's daemonic children at exit with SIGTERM and then waits
    for them; loader workers ignore SIGTERM (:func:`loader_worker_init`), so a loader still
    open at exit (one whose iterator an exception's traceback keeps alive) would make that
    wait last forever. This runs first (atexit is last-in, first-out, and multiprocessing
    registered its hook when torch imported it) and ends them the way SIGTERM would have.
    PyTorch's normal shutdown of a loader (a sentinel to each worker) needs no signal.
    """
    global _EXIT_HOOK
    if _EXIT_HOOK:
        return
    _EXIT_HOOK = True
    atexit.register(_kill_daemonic_children)


_EXIT_HOOK = False


def _kill_daemonic_children() -> None:
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=5.0)
