"""One writer per output folder: a build, or a training run, holds a lock on its folder (R17).

The lock is ``fcntl.flock`` on a file inside the folder. The kernel drops it when the
holder exits in any way, ``kill -9`` included, so a dead holder never blocks the next
run, and nothing has to guess whether a recorded process is still alive. The file
names its holder (command, process id, host, start time) for the refusal message; it is
removed when the holder lets go, so a folder looks as it did before.

Removing a lock file races with a second process that opened it just before: that one
may lock the removed file while a third creates and locks a new one. So a locker
checks, after locking, that the path still names the file it locked, and tries again if
not.

A ``flock`` belongs to the open file, which a forked child shares: loader workers forked
by a trainer would hold its folder for the seconds they outlive a ``kill -9`` of it. So a
forked child closes its copy of every held lock at once (``os.register_at_fork``); the
parent's lock is unaffected.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from bert_ds.base.errors import UserError

LOCK_NAME = ".bert-ds.lock"


_held_fds: set[int] = set()  # the locks this process holds (a FolderLock's fd)


def _release_in_child() -> None:
    for fd in _held_fds:
        os.close(fd)  # the child's copy only: the parent still holds the lock
    _held_fds.clear()


os.register_at_fork(after_in_child=_release_in_child)


class FolderBusy(UserError):
    """Another live process holds the folder's lock."""


class FolderLock:
    """``with FolderLock(folder, "data_tools build"):`` creates the folder if needed and holds it."""

    def __init__(self, folder: str | os.PathLike, command: str):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.command = command
        self._fd: int | None = None
        self._pid = 0

    def __enter__(self) -> FolderLock:
        if self.folder.exists() and not self.folder.is_dir():
            raise UserError(f"{self.folder} exists and is not a folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise FolderBusy(f"{self.folder} is in use by {holder or 'another process'}; wait for it to end "
                                 "or stop it, or choose another folder") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # we locked a file its holder had just removed: try the new one
        os.ftruncate(fd, 0)
        os.write(fd, (f"{self.command} (pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')})\n").encode())
        self._fd, self._pid = fd, os.getpid()
        _held_fds.add(fd)
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None or self._pid != os.getpid():  # a forked child neither unlinks nor closes
            return
        _held_fds.discard(self._fd)
        try:
            self.path.unlink(missing_ok=True)  # while still locked: no one can take a file about to vanish
        finally:
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False

