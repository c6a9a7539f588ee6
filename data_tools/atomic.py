"""Crash-safe file writing, shared by shards, manifests, tokenizer files and checkpoints.

A file reaches its final name only complete: it is written under a temporary name,
fsynced, renamed with ``os.replace`` (atomic on POSIX), and the directory is fsynced
so the rename itself survives a power cut.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

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


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Replace ``path`` with ``data`` so readers see the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_synced(tmp, data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def file_crc32(path: str | os.PathLike) -> int:
    """zlib CRC32 of a file, read in bounded blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc
