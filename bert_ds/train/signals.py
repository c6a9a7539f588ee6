"""A graceful stop on SIGINT (Ctrl-C), SIGTERM or SIGUSR1 that every rank agrees on within one step.

Design choices:
- The handler only records the signal. The training loop adds "a stop was requested" to
  the statistics it already all-reduces once per step, so a signal that reaches any one
  rank is known to every rank at the end of that step (or of the next one, when it lands
  after this rank's share of the all-reduce), without an extra collective. All ranks then
  commit a checkpoint together and exit 0. The slow parts between steps (a validation
  pass, a periodic save) ask every rank with :meth:`StopRequest.agreed`, so that a signal
  there stops the run at the last finished step instead of after one more.
- SIGTERM is what schedulers and ``torchrun`` send before killing a job; SIGUSR1 is the
  usual early warning (Slurm ``--signal=USR1@90``); SIGINT is Ctrl-C. All three mean the
  same here. The data-loader workers ignore all three (:func:`loader_worker_init`): a
  signal to the whole process group (Ctrl-C, a scheduler, the deepspeed launcher, which
  sends SIGTERM to every process under it) leaves the decision to the trainer, which ends
  its workers itself; workers whose trainer died end by PyTorch's own check on their parent.
- A second Ctrl-C ends the process at once (exit 130, no checkpoint: the newest committed
  one stays). Python runs signal handlers only between bytecodes of the main thread, which
  can sit for long inside one call (a collective waiting on a peer, a save), so a watcher
  thread reads the signals from ``signal.set_wakeup_fd``'s pipe, which the interpreter
  writes the moment a signal arrives, and ends the process from there.
- What a second Ctrl-C looks like to a rank depends on the launcher. Alone, or under the
  deepspeed launcher (ranks in the terminal's process group), the rank gets SIGINT from
  the terminal, under the deepspeed launcher with the launcher's SIGTERM a moment later.
  ``torchrun`` starts each rank in a session of its own: the terminal reaches only
  torchrun, which forwards the first Ctrl-C as SIGINT and answers the second by sending
  SIGTERM. So after a first SIGINT, a SIGINT or a SIGTERM that comes more than
  :data:`REPEAT_AFTER_S` later is a second Ctrl-C (earlier, it is the same key press
  arriving twice); after a first SIGTERM or SIGUSR1 (a scheduler's warning, then its
  SIGTERM), only a SIGINT is.
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
import time

import torch
import torch.distributed as dist

from bert_ds.base.errors import EXIT_INTERRUPTED, EXIT_RANK_FAILURE
from bert_ds.loader.workers import STOP_SIGNALS

STARTUP_EXIT_GRACE_S = 5.0  # a stop signal before the first step: the longest the exit may unwind
REPEAT_AFTER_S = 1.0  # an earlier SIGINT is the same key press reaching this rank twice (terminal + launcher)


class StopRequest:
    """Records SIGINT / SIGTERM / SIGUSR1; install once, in the main thread, before training."""

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
        self._wakeup: tuple[int, int] | None = None  # (the pipe's write end, the wakeup fd it replaced)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> None:
        self._pid = os.getpid()
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        self._wakeup = (write_end, signal.set_wakeup_fd(write_end, warn_on_full_buffer=False))
        threading.Thread(target=self._watch, args=(read_end,), name="bert_ds-stop-signals", daemon=True).start()

    def uninstall(self) -> None:
        self.end_steps()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._wakeup is not None:
            write_end, replaced = self._wakeup
            signal.set_wakeup_fd(replaced)
            os.close(write_end)  # the watcher reads the end of the pipe and finishes
            self._wakeup = None

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

    def agreed(self, device: torch.device) -> int:
        """How many ranks hold a stop request: one all-reduce of one number, so every rank must
        call this at the same point of the run. Non-zero means every rank stops here."""
        votes = torch.tensor([float(self.requested)], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(votes)
        count = int(votes.item())
        if count:
            self.acknowledge()
        return count

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
        with self._lock:
            if self.signal_name is None:
                self.signal_name = name
                # os.write: the main thread may be inside a print to the same stream
                os.write(2, (f"[bert_ds] rank {self.rank}: received {name}; checkpointing the last finished step "
                             "and exiting (Ctrl-C again to stop at once)\n").encode())
            self._arm()

    def _exit_before_first_step(self, signum: int, name: str) -> None:
        os.write(2, f"[bert_ds] rank {self.rank}: received {name} before the first step; nothing to save, exiting\n".encode())
        status = 128 + signum
        timer = threading.Timer(STARTUP_EXIT_GRACE_S, os._exit, args=(status,))
        timer.daemon = True
        timer.start()
        raise SystemExit(status)

    def _watch(self, read_end: int) -> None:
        """The watcher thread: every signal's number, as it arrives; a second Ctrl-C ends the process."""
        first: tuple[int, float] | None = None  # the first stop signal and when it came
        with open(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(64):
                for signum in chunk:
                    if signum not in STOP_SIGNALS:
                        continue  # another handler's signal (the data loader's SIGCHLD)
                    now = time.monotonic()
                    if first is None:
                        first = (signum, now)
                    elif _second_ctrl_c(first[0], signum, now - first[1]):
                        name = signal.Signals(signum).name
                        os.write(2, f"[bert_ds] rank {self.rank}: a second stop signal ({name}); exiting now "
                                    "without a checkpoint (the newest committed one stays)\n".encode())
                        os._exit(EXIT_INTERRUPTED)

    def _give_up(self, name: str) -> None:
        os.write(2, (f"[bert_ds] rank {self.rank}: {name} received {self.deadline_s:g} s ago and the current step "
                     f"has not finished (this rank or a peer is hung); exiting without a checkpoint\n").encode())
        os._exit(EXIT_RANK_FAILURE)


def _second_ctrl_c(first: int, signum: int, after_s: float) -> bool:
    """Whether stop signal ``signum``, ``after_s`` seconds after the first one, ends the process now."""
    if after_s <= REPEAT_AFTER_S:
        return False  # one key press reaching the rank twice
    return signum == signal.SIGINT or (first == signal.SIGINT and signum == signal.SIGTERM)


__all__ = ["EXIT_INTERRUPTED", "EXIT_RANK_FAILURE", "REPEAT_AFTER_S", "STARTUP_EXIT_GRACE_S", "STOP_SIGNALS",
           "StopRequest"]
