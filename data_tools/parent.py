"""The parent folder of a partitioned build: what it may hold, and the one tokenizer its parts share.

OUTPUT holds only part folders of this build's count, ``tokenizer/``, the lock files and
``.cache/``. Anything else (parts of another count, a finished plain dataset, other files) is
refused in one line before anything is written; with ``--overwrite``, parts of another count
and a plain dataset's files are removed (other files are left alone).

A vocabulary trained for a partitioned build is trained once, on all inputs (so it equals the
vocabulary a single build of the same inputs trains), by the first part that finds none,
under a waiting ``flock`` on ``OUTPUT/.parts.lock``. It is written to a temporary folder and
renamed to ``OUTPUT/tokenizer/``, with ``trained_from.json`` saying what it was trained from;
the other parts load it as if given with ``--vocab``. Training is deterministic, so a part
that loses a rename race (two trainers, say on hosts whose file system ignores ``flock``)
uses the folder that won: correctness never rests on the lock. The lock file stays (it is
never removed, so no one can lock a file about to vanish).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from bert_ds.base.errors import UserError
from bert_ds.base.locking import LOCK_NAME
from bert_ds.data_tools.manifest import MANIFEST_NAME
from bert_ds.data_tools.partition import PART_RE
from bert_ds.data_tools.tokenizer import HF_FILES, Normalization, write_tokenizer_folder

TOKENIZER_DIR = "tokenizer"
RECORD_NAME = "trained_from.json"
PARTS_LOCK = ".parts.lock"
_TMP_PREFIX = ".tokenizer.tmp-"
_ALLOWED = {TOKENIZER_DIR, PARTS_LOCK, LOCK_NAME, ".cache"}
# A plain build's own files (see build.py): what --overwrite removes from a parent.
_PLAIN_FILE = re.compile(r"^(shard_\d{5,}\.(bin|idx)(\.tmp)?|manifest\.json(\.tmp)?|build\.journal\.json(\.tmp)?)$")


def check_parent(output: Path, count: int, overwrite: bool, record: dict | None) -> list[Path]:
    """What must go before parts of ``count`` are built in OUTPUT (with ``overwrite``);
    UserError naming what is in the way otherwise. ``record``: the vocabulary to train
    (its trained_from.json), checked against a tokenizer already there. Reads only."""
    if not output.is_dir():
        return []
    other_parts, plain, other = [], [], []
    for p in sorted(output.iterdir()):
        m = PART_RE.match(p.name)
        if m and p.is_dir():
            if int(m[2]) != count or int(m[1]) >= count:
                other_parts.append(p)
        elif p.name in HF_FILES or _PLAIN_FILE.match(p.name):
            plain.append(p)
        elif p.name not in _ALLOWED and not p.name.startswith(_TMP_PREFIX):
            other.append(p)
    if not overwrite:
        if other_parts:
            counts = sorted({int(PART_RE.match(p.name)[2]) for p in other_parts})
            raise UserError(f"{output} holds parts of a build in {' and '.join(map(str, counts))} parts "
                            f"({other_parts[0].name}...), not {count}; choose another --output, or pass "
                            "--overwrite to remove them")
        if (output / MANIFEST_NAME).exists():
            raise UserError(f"{output} holds a finished dataset (a build in one part); choose another "
                            "--output, or pass --overwrite to replace it with parts")
        if plain or other:
            names = ", ".join(p.name for p in (plain + other)[:3])
            raise UserError(f"{output} holds files that are no part of a partitioned build ({names}); "
                            "choose a new or empty --output, or pass --overwrite")
        if record is not None:
            _check_record(output / TOKENIZER_DIR, record)
    return other_parts + plain


def _read_record(folder: Path) -> dict | None:
    try:
        found = json.loads((folder / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _check_record(folder: Path, record: dict) -> bool:
    """Whether ``folder`` holds the vocabulary ``record`` describes (False: none there);
    UserError for one trained from anything else."""
    if not folder.exists():
        return False
    found = _read_record(folder)
    if found == record:
        return True
    if found is None:
        what = f"no readable {RECORD_NAME}"
    else:
        what = "other " + ", ".join(k.replace("_", " ") for k in record if found.get(k) != record[k])
    raise UserError(f"{folder}: a vocabulary trained for another build ({what}); pass --overwrite to "
                    "train it anew, or choose another --output")


def has_tokenizer(output: Path, record: dict) -> bool:
    """Whether OUTPUT/tokenizer holds the vocabulary ``record`` describes (UserError for another)."""
    return _check_record(output / TOKENIZER_DIR, record)


def remove(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


class ParentLock:
    """``with ParentLock(OUTPUT, "part 1/3"):`` waits for ``OUTPUT/.parts.lock``, saying once
    who holds it; the kernel drops it when the holder ends, however it ends."""

    def __init__(self, output: Path, holder: str):
        self.path = output / PARTS_LOCK
        self.holder = holder
        self._fd: int | None = None

    def __enter__(self) -> ParentLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_by = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
            print(f"{self.holder}: waiting for {self.path}, held by {held_by}", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.holder} (pid {os.getpid()} on {socket.gethostname()})\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


def shared_tokenizer(output: Path, record: dict, overwrite: bool, label: str,
                     train: Callable[[], tuple[bytes, Normalization]]) -> Path:
    """``OUTPUT/tokenizer``, trained by ``train`` unless a vocabulary ``record`` describes is
    there; call under :class:`ParentLock`."""
    folder = output / TOKENIZER_DIR
    if overwrite and folder.exists() and _read_record(folder) != record:
        shutil.rmtree(folder)
    if _check_record(folder, record):
        return folder
    for stale in output.glob(_TMP_PREFIX + "*"):  # left by a trainer that was killed
        shutil.rmtree(stale, ignore_errors=True)
    print(f"{label}: training a vocabulary of {record['train_vocab']:,} entries on all "
          f"{len(record['inputs'])} input(s), once for every part", flush=True)
    vocab, normalization = train()
    tmp = output / f"{_TMP_PREFIX}{os.getpid()}"
    try:
        write_tokenizer_folder(tmp, vocab, normalization)
        (tmp / RECORD_NAME).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, folder)
        except OSError:  # another trainer's rename won: the same vocabulary (training is deterministic)
            if not _check_record(folder, record):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
