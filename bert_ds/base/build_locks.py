"""JIT builds' lock files, never waited on forever: one watcher for every build bert-ds starts.

``torch.utils.cpp_extension`` guards a build folder with a ``lock`` file (``FileBaton``): the
first process creates it with ``O_CREAT | O_EXCL`` and keeps that descriptor open until it
removes the file; every other process polls for the file to go, with no timeout and no message.
A build killed hard (a second Ctrl-C, an OOM kill, ``kill -9``) leaves the file, and every later
start waits on it forever. Two builds go through such locks: DeepSpeed's ops
(``bert_ds.train.extensions``) and the fused kernels (``bert_ds.kernels._build``).

- A lock is stale when no process has it open: a live holder on this machine shows the file
  among its ``/proc/PID/fd`` links, and the scan also names the holder. A lock is removed only
  after two polls in a row find it (the same file) with no holder, because ``FileBaton`` closes
  the descriptor just before it removes the file. The lock's age is no evidence either way: a
  cold CUDA build keeps a live lock for minutes. Limits: processes of other users (their
  ``/proc/PID/fd`` is unreadable) and of other machines sharing the folder are invisible to the
  scan, so a folder on a shared filesystem needs one cache per node; without ``/proc`` every
  lock counts as live (bounded wait only).
- A live lock held by another process is waited on for at most ``BERT_DS_BUILD_LOCK_TIMEOUT``
  seconds (default 900: a cold CUDA build takes minutes), with a message naming the lock and its
  holder after a few seconds; then the start fails with one ``error:`` line and
  :data:`EXIT_USER_ERROR`. torch's own wait, ``FileBaton.wait``, is a polling loop that nothing
  interrupts, so while the build runs a thread keeps watching, and ends the process if a lock
  taken meanwhile by another start outlasts the bound.
- The bound and the lock check are polls, not signals: a stop signal during the wait ends the
  process at once.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bert_ds.base.errors import EXIT_USER_ERROR, UserError, report

LOCK_TIMEOUT_ENV = "BERT_DS_BUILD_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 900.0
NOTICE_AFTER_S = 2.0  # every start takes the lock briefly (ninja checks the build): say nothing for that
LOCK_NAME = "lock"  # torch.utils.cpp_extension: <build folder>/lock


def log(message: str) -> None:
    # os.write: the note may come from the watcher thread while the main thread prints
    os.write(2, f"[bert_ds] {message}\n".encode())


def lock_timeout_s() -> float:
    text = os.environ.get(LOCK_TIMEOUT_ENV, "")
    if not text:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise UserError(f"{LOCK_TIMEOUT_ENV}={text!r}: expected a positive number of seconds")
    return value


def lock_holders(lock: Path) -> list[int] | None:
    """The ids of the processes of this machine that have ``lock`` open; None where /proc
    cannot tell (no /proc)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(lock)
    return [int(pid) for pid in os.listdir(proc) if pid.isdigit() and target in _open_files(proc / pid / "fd")]


def _open_files(fd_dir: Path) -> set[str]:
    try:
        fds = os.listdir(fd_dir)
    except OSError:  # the process ended, or belongs to another user
        return set()
    links = set()
    for fd in fds:
        try:
            links.add(os.readlink(fd_dir / fd))
        except OSError:  # closed since the listing (the listing's own descriptor, for one)
            continue
    return links


def describe(pid: int) -> str:
    try:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    command = " ".join(a.decode(errors="replace") for a in argv if a)
    return f"pid {pid} ({command[:120]})"


class LockWatch:
    """One poll at a time over the build locks under ``root`` (``root/*/lock``; see the module
    docstring); ``what`` names the build in messages ("DeepSpeed's extension build")."""

    def __init__(self, root: Path, timeout_s: float, what: str = "DeepSpeed's extension build"):
        self.root = root
        self.timeout_s = timeout_s
        self.what = what
        self._unheld: dict[Path, tuple[int, int]] = {}  # lock -> identity, seen with no holder last poll
        self._held_since: dict[Path, float] = {}  # lock -> when first seen held by another process
        self._announced: set[Path] = set()

    def poll(self, now: float) -> bool:
        """Remove confirmed stale locks; raise UserError for one held too long by another process.
        True while a lock stands in this process's way (held by another, or not yet confirmed stale)."""
        locks = set(self.root.glob(f"*/{LOCK_NAME}"))
        for gone in set(self._held_since) - locks:
            del self._held_since[gone]
            self._announced.discard(gone)
        self._unheld = {lock: ident for lock, ident in self._unheld.items() if lock in locks}
        return any([self._in_the_way(lock, now) for lock in sorted(locks)])  # a list: every lock is looked at

    def _in_the_way(self, lock: Path, now: float) -> bool:
        try:
            st = lock.stat()
        except FileNotFoundError:
            return False
        identity = (st.st_ino, st.st_ctime_ns)
        holders = lock_holders(lock)
        if holders is not None and not holders:
            self._held_since.pop(lock, None)
            if self._unheld.get(lock) == identity:
                lock.unlink(missing_ok=True)
                del self._unheld[lock]
                log(f"removed a stale build lock {lock} (no process has it open: left by a start that was killed)")
                return False
            self._unheld[lock] = identity
            return True
        self._unheld.pop(lock, None)
        others = [pid for pid in holders or [] if pid != os.getpid()]
        if holders is not None and not others:
            self._held_since.pop(lock, None)  # this process builds
            return False
        since = self._held_since.setdefault(lock, now)
        holder = ", ".join(describe(pid) for pid in others) if others else "a process this machine cannot see"
        if now - since >= self.timeout_s:
            raise UserError(f"{self.what} lock {lock} is still held by {holder} after "
                            f"{self.timeout_s:g} s; let that build finish or end it ({LOCK_TIMEOUT_ENV} sets the wait)")
        if now - since >= NOTICE_AFTER_S and lock not in self._announced:
            self._announced.add(lock)
            log(f"waiting for {self.what} lock {lock}, held by {holder}, "
                f"for at most {self.timeout_s:g} s ({LOCK_TIMEOUT_ENV})")
        return True


@contextlib.contextmanager
def bounded_build_locks(root: Path, what: str = "DeepSpeed's extension build",
                        poll_s: float = 0.5) -> Iterator[None]:
    """Wait until no build lock is in the way (raises UserError after the bounded wait), then
    keep watching while the body runs (DeepSpeed's start-up).

    The wait comes first so that DeepSpeed takes the lock and builds: a process that DeepSpeed
    sends to ``FileBaton.wait`` loads the op once the lock is gone, built or not. The watcher
    covers a lock taken by another start in between: a stale one is removed (that start's
    build may be missing, and the load then fails with an import error where it hung before;
    the next start builds), and a live one held past the bound ends this process."""
    watch = LockWatch(root, lock_timeout_s(), what)
    while watch.poll(time.monotonic()):
        time.sleep(poll_s)
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            try:
                watch.poll(time.monotonic())
            except UserError as e:
                # The main thread is inside FileBaton.wait, which nothing interrupts: end here.
                report(e)
                os._exit(EXIT_USER_ERROR)
            done.wait(poll_s)

    thread = threading.Thread(target=run, name="build-lock-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


