"""A graceful stop on SIGTERM or SIGUSR1 that every rank agrees on within one step.

Design choices:
- The handler only records the signal. The training loop adds "a stop was requested" to
  the statistics it already all-reduces once per step, so a signal that reaches any one
  rank is known to every rank at the end of that step (or of the next one, when it lands
  after this rank's share of the all-reduce), without an extra collective. All ranks then
  commit a checkpoint together and exit 0.
- SIGTERM is what schedulers and ``torchrun`` send before killing a job; SIGUSR1 is the
  usual early warning (Slurm ``--signal=USR1@90``). Both mean the same here. To signal a
  whole process group with ``--num-workers`` > 0, prefer SIGUSR1: PyTorch's data-loader
  workers die on SIGTERM, and the trainer would then fail on its next batch.
- A rank that cannot reach the end of its step in time (it is hung, or waits for a hung
  peer) exits by itself after ``deadline_s`` with :data:`EXIT_RANK_FAILURE`, instead of
  waiting for the launcher's SIGKILL (``torchrun`` waits 30 s). The deadline is the
  collective timeout: no healthy step waits longer than that on its peers.
- Before the first step (start-up: the process group, DeepSpeed's extension build, the
  engine, a resume's load) there is nothing to save, so a stop signal ends the process at
  once with one line and status 128 + the signal number (143 for SIGTERM), what a shell
  reports for a process the signal ended: the run was not done and saved nothing, which a
  requeue script must not read as success. The exit unwinds (``finally`` blocks release
  build locks); if unwinding stalls, the process ends after ``STARTUP_EXIT_GRACE_S``.
  Python runs the handler between bytecodes, so a main thread inside one long C++ call
  (the rendezvous waiting for its peers) sees the signal when that call returns, within
  the collective timeout.
"""

from __future__ import annotations

import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_RANK_FAILURE = 4  # the process exit status of a rank that gave up on its peers (see bert_ds.train)
STARTUP_EXIT_GRACE_S = 5.0  # a stop signal before the first step: the longest the exit may unwind


class StopRequest:
    """Records SIGTERM / SIGUSR1; install once, in the main thread, before training."""

    def __init__(self, deadline_s: float, rank: int = 0):
        self.deadline_s = deadline_s
        self.rank = rank
        self.signal_name: str | None = None  # the first stop signal received
        self._stepping = False  # the deadline applies only while steps run, not to start-up or the final save
        self._started = False  # steps have begun: from then on a stop signal means "checkpoint, then stop"
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()
        self._timer: threading.Timer | None = None
        self._lock = threading.RLock()  # the handler runs on the main thread, maybe inside acknowledge()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> None:
        self._pid = os.getpid()
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        self.end_steps()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def begin_steps(self) -> None:
        with self._lock:
            self._stepping = True
            self._started = True
            if self.requested:  # a signal during start-up: the first step must see it in time
                self._arm()

    def end_steps(self) -> None:
        with self._lock:
            self._stepping = False
        self.acknowledge()

    def acknowledge(self) -> None:
        """Every rank has seen the request: the deadline no longer applies."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _arm(self) -> None:
        if self._timer is None and self._stepping and self.deadline_s > 0:
            self._timer = threading.Timer(self.deadline_s, self._give_up, args=(self.signal_name,))
            self._timer.daemon = True
            self._timer.start()

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:
            return  # a forked data-loader worker inherited the handler: the trainer process decides
        name = signal.Signals(signum).name
        if not self._started:
            self._exit_before_first_step(signum, name)
        # os.write: the main thread may be inside a print to the same stream
        os.write(2, f"[bert_ds] rank {self.rank}: received {name}; checkpointing after this step\n".encode())
        with self._lock:
            if self.signal_name is None:
                self.signal_name = name
            self._arm()

    def _exit_before_first_step(self, signum: int, name: str) -> None:
        os.write(2, f"[bert_ds] rank {self.rank}: received {name} before the first step; nothing to save, exiting\n".encode())
        status = 128 + signum
        timer = threading.Timer(STARTUP_EXIT_GRACE_S, os._exit, args=(status,))
        timer.daemon = True
        timer.start()
        raise SystemExit(status)

    def _give_up(self, name: str) -> None:
        os.write(2, (f"[bert_ds] rank {self.rank}: {name} received {self.deadline_s:g} s ago and the current step "
                     f"has not finished (this rank or a peer is hung); exiting without a checkpoint\n").encode())
        os._exit(EXIT_RANK_FAILURE)


__all__ = ["EXIT_RANK_FAILURE", "STARTUP_EXIT_GRACE_S", "STOP_SIGNALS", "StopRequest"]
