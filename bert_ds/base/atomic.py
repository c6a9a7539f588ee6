"""Crash-safe file writing, shared by shards, manifests, tokenizer files, sample maps and checkpoints.

A file reaches its final name only complete: it is written under a temporary name,
fsynced, renamed with ``os.replace`` (atomic on POSIX), and the directory is fsynced
so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_BLOCK = 1 << 22


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (no rename: the caller owns the name)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """``with atomic_file(path) as f:`` write ``path`` through ``f``, as the data comes; readers
    see the old file or the new one, never a part. On any exception nothing replaces ``path``
    and the temporary file is removed. One temporary name per path: callers that may race
    on the same path hold a lock."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Replace ``path`` with ``data`` so readers see the old file or the new one, never a part."""
    with atomic_file(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def process_umask() -> int:
    """The umask in force, read without changing it where Linux tells it (/proc), else the
    classic set-and-restore."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_umask_allows(path: str | os.PathLike) -> None:
    """Give a file 0666, a folder 0777, less the umask: what open() and mkdir() give.

    tempfile.mkdtemp (0700) and safetensors (0600) make owner-only files, so an export or
    a checkpoint shared with a team would answer "Permission denied" to everyone else.
    """
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~process_umask())


def file_crc32(path: str | os.PathLike) -> int:
    """zlib CRC32 of a file, read in bounded blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc
