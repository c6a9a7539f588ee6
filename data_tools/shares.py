"""Each part's share of the inputs: the same cut in every process, from the inputs alone.

The inputs, in the order given, are laid end to end by their sizes
(:func:`bert_ds.data_tools.sources.input_size`), and the bytes are cut into N near-equal
ranges: cut k at ``total * k // N``. Nothing else (the worker count, the host, what other
parts did) enters a cut, so part I and part I + 1 compute their common cut alike and no
document is lost, read twice or split between them.

A cut that falls inside a file

* snaps to the nearer edge of the file when the file is smaller than one share, or cannot
  be read from the middle: gzip (no seeking), ``--documents file`` (a file is one
  document), ``datasets`` tables;
* else moves forward to where the reader would start a document afresh, by the reader's own
  rules (:func:`bert_ds.data_tools.text.document_start`): plain text after the next blank
  line (blank mode) or at the next title (heading mode, WikiText), the mode decided from the
  file's first non-blank line as the reader does; JSONL at the next line start; Parquet at
  the row in proportion to the cut.

A share may be empty (many parts, few documents): that part is a valid dataset of no shards.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from bert_ds.data_tools.sources import input_kind, input_size, parquet_rows, source_info
from bert_ds.data_tools.text import Cursor, document_start, file_mode, position_bytes


@dataclass(frozen=True)
class Share:
    """Inputs ``start`` up to (not including) ``stop``; the byte positions of both on the
    inputs laid end to end (rows counted in proportion)."""

    start: Cursor
    stop: Cursor
    first_byte: int
    end_byte: int
    total_bytes: int  # of all inputs

    @property
    def bytes(self) -> int:
        return self.end_byte - self.first_byte

    def sources(self) -> list[int]:
        """Indices of the inputs the share reads a byte or a row of."""
        last = self.stop.source + (1 if self.stop.offset else 0)
        return [i for i in range(self.start.source, last) if not (i == self.start.source and self._empty())]

    def _empty(self) -> bool:
        return (self.start.source, self.start.offset) >= (self.stop.source, self.stop.offset)


def _splittable(path: str, documents: str) -> bool:
    kind = input_kind(path)
    if path.endswith(".gz") or kind in ("hf_disk", "hf_hub"):
        return False
    return kind != "text" or documents != "file"


def _cut(paths: list[str], sizes: list[int], k: int, count: int, documents: str, piece_bytes: int) -> Cursor:
    """Cut k of count (0 and count are the ends of the inputs) as a reader position."""
    total = sum(sizes)
    at = total * k // count
    begin, f = 0, 0
    while f < len(paths) and at >= begin + sizes[f]:
        begin += sizes[f]
        f += 1
    if f == len(paths):
        return Cursor(len(paths), 0, None)
    path, size, offset = paths[f], sizes[f], at - begin
    if offset == 0:
        return Cursor(f, 0, None)
    if size * count < total or not _splittable(path, documents):
        return Cursor(f, 0, None) if offset * 2 < size else Cursor(f + 1, 0, None)
    kind = input_kind(path)
    if kind == "parquet":
        row = offset * parquet_rows(path) // size
        return Cursor(f, row, "record") if row else Cursor(f, 0, None)
    if kind == "jsonl":
        pos = document_start(path, offset, None, piece_bytes)  # the next line start
        return Cursor(f, pos, "record") if pos < size else Cursor(f + 1, 0, None)
    mode = file_mode(path, piece_bytes)
    pos = document_start(path, offset, mode, piece_bytes)
    return Cursor(f, pos, mode) if pos < size else Cursor(f + 1, 0, None)


def share_of(paths: list[str], index: int, count: int, documents: str = "blank",
             piece_bytes: int = 1 << 20, sizes: list[int] | None = None) -> Share:
    """Part ``index`` of ``count``'s share of ``paths``."""
    sizes = [input_size(p) for p in paths] if sizes is None else sizes
    start = _cut(paths, sizes, index, count, documents, piece_bytes)
    stop = _cut(paths, sizes, index + 1, count, documents, piece_bytes)
    return Share(start, stop, _byte_at(paths, sizes, start), _byte_at(paths, sizes, stop), sum(sizes))


def _byte_at(paths: list[str], sizes: list[int], cursor: Cursor) -> int:
    before = sum(sizes[: cursor.source])
    if cursor.offset:
        before += position_bytes(paths[cursor.source], cursor.offset, sizes[cursor.source])
    return before


def _range_sha256(path: str, a: int, b: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(a)
        left = b - a
        while left > 0 and (block := f.read(min(left, 1 << 20))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def share_sources(paths: list[str], share: Share) -> list[dict]:
    """The manifest's sources of a part: what it read of each input (a byte or row range
    where it read less than the whole), with the sha256 of the bytes that hold it."""
    out = []
    for i in share.sources():
        a = share.start.offset if i == share.start.source else 0
        b = share.stop.offset if i == share.stop.source else None
        if a == 0 and b is None:
            out.append(source_info(paths[i]))
        elif input_kind(paths[i]) == "parquet":  # rows: the file holds them, hashed whole
            rows = parquet_rows(paths[i])
            out.append({**source_info(paths[i]), "rows": [a, rows if b is None else b]})
        else:
            end = os.path.getsize(paths[i]) if b is None else b
            out.append({"path": paths[i], "bytes": end - a, "sha256": _range_sha256(paths[i], a, end),
                        "range": [a, end]})
    return out
