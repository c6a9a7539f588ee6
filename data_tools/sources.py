"""Input kinds, told apart by name, and the raw records of the record kinds.

An ``--input`` is read as

* ``text``: any file not named below (``.gz`` allowed), in BERT's text convention
  (see :mod:`bert_ds.data_tools.text`);
* ``jsonl``: a file ending in ``.jsonl`` or ``.jsonl.gz``, one JSON object per line,
  one document per object;
* ``parquet``: a file ending in ``.parquet``, one document per row;
* ``hf_disk``: a folder written by ``datasets``' ``save_to_disk`` (it holds
  ``state.json`` / ``dataset_info.json``), one document per row;
* ``hf_hub``: ``hf:NAME[:CONFIG][@SPLIT]`` (split default ``train``), loaded with
  ``datasets.load_dataset`` (from the network, or the local cache when offline),
  one document per row.

Of a record only its text field (``--text-field``, default ``text``) is read. This
module yields the field's raw value with the record's position and size;
:mod:`bert_ds.data_tools.text` owns what the text means (lines, paragraphs, cleaning).

Design choices:

* Bounded memory. Parquet is read in record batches of ``BATCH_ROWS`` rows of the text
  column only; a ``datasets`` table is memory-mapped Arrow, read in slices of
  ``BATCH_ROWS`` rows. A JSONL record is one line and is held whole: a JSON value
  cannot be parsed in pieces.
* Resume. A record input's position is the uncompressed byte offset of the next line
  (JSONL: resuming seeks instead of parsing every record before it) or the index of
  the next row (Parquet, ``datasets``: whole row groups are skipped unread).
* Identity. A source is named in the manifest, and keys the resume journal, by the
  sha256 of the bytes that hold its records: the file, or a ``datasets`` table's Arrow
  files in order (for ``hf:`` inputs, the files of the local cache).
* A ``--text-field`` that a Parquet file or ``datasets`` table lacks as a column is an
  error before the build writes anything; in JSONL, where each record has its own
  keys, a record without it is skipped and counted (``missing_field``).
* The hub is reached only for ``hf:`` names, never for a file that is not there, so a
  typo in a path is "input not found", not a network error.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from functools import cache

from bert_ds.base.errors import UserError
from bert_ds.data_tools.manifest import file_sha256

KINDS = ("text", "jsonl", "parquet", "hf_disk", "hf_hub")
RECORD_KINDS = frozenset(KINDS[1:])
BATCH_ROWS = 1024  # rows per Parquet record batch / Arrow slice
HUB_PREFIX = "hf:"
_HUB_RE = re.compile(r"^hf:(?P<name>[^:@\s]+)(?::(?P<config>[^@\s]+))?(?:@(?P<split>[^\s]+))?$")
_HF_DISK_MARKERS = ("state.json", "dataset_info.json")
_BOM = b"\xef\xbb\xbf"
_REPLACEMENT = "\ufffd"

# Values yielded in place of a field value.
MISSING = object()  # the record has no such field (or is not a JSON object)
BLANK = object()  # a blank JSONL line: not a record, only its bytes count


def input_kind(path: str) -> str:
    """One of ``KINDS``, from the name alone (see the table above)."""
    if path.startswith(HUB_PREFIX):
        return "hf_hub"
    if os.path.isdir(path):
        return "hf_disk"
    if path.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    return "text"


def _first_line(e: BaseException) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


# -- datasets tables -------------------------------------------------------------------------

def _hf_dataset(path: str):
    """The ``datasets.Dataset`` of an hf_disk folder or an hf: name."""
    import datasets

    if path.startswith(HUB_PREFIX):
        ds = _hub_dataset(path)
    else:
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            splits = sorted(e.name for e in os.scandir(path) if e.is_dir())
            raise UserError(f"{path}: a DatasetDict (splits: {', '.join(splits) or 'none'}); "
                            f"give one split's folder, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
        if not any(os.path.isfile(os.path.join(path, n)) for n in _HF_DISK_MARKERS):
            raise UserError(f"input is a folder but not a datasets save_to_disk folder "
                            f"(no {' or '.join(_HF_DISK_MARKERS)}): {path}; to read the files in it, give "
                            f"them: {os.path.join(path, '*')}")
        try:
            ds = datasets.load_from_disk(path)  # cheap: memory-maps the Arrow files
        except Exception as e:  # datasets raises many types for a damaged folder
            raise UserError(f"{path}: cannot load the datasets folder ({_first_line(e)})") from None
    if not isinstance(ds, datasets.Dataset):
        raise UserError(f"{path}: is a {type(ds).__name__}, not one table of rows")
    return ds


@cache
def _hub_dataset(path: str):
    """``load_dataset`` of an hf: name, once per process (it asks the hub each call)."""
    import datasets

    m = _HUB_RE.match(path)
    if m is None:
        raise UserError(f"{path}: not a hub dataset name; write hf:NAME[:CONFIG][@SPLIT]")
    # Offline, huggingface_hub retries for ~20 s and warns at each try; the one line
    # below says it all, so its warnings are held back meanwhile.
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        return datasets.load_dataset(m["name"], m["config"], split=m["split"] or "train")
    except Exception as e:  # network, auth, unknown name or split: all the user's to fix
        raise UserError(f"{path}: cannot load from the Hugging Face hub ({_first_line(e)})") from None
    finally:
        hub_log.setLevel(level)


def _hf_files(path: str) -> list[str]:
    return [f["filename"] for f in _hf_dataset(path).cache_files]


def _check_column(path: str, columns: list[str], field: str) -> None:
    if field not in columns:
        raise UserError(f"{path}: no column {field!r} (columns: {', '.join(columns)}); "
                        "choose the text column with --text-field")


def _parquet_file(path: str, field: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{path}: not a readable Parquet file ({_first_line(e)})") from None
    _check_column(path, pf.schema_arrow.names, field)
    return pf


# -- what the build needs of every input --------------------------------------------------------

def check_inputs(paths: list[str], text_field: str = "text") -> None:
    """UserError for an input that cannot be read as its kind; nothing is written."""
    if not paths:
        raise UserError("no input files given")
    if not text_field:
        raise UserError("--text-field must not be empty")
    for p in paths:
        kind = input_kind(p)
        if kind == "hf_hub" or kind == "hf_disk":
            _check_column(p, _hf_dataset(p).column_names, text_field)
            continue
        if not os.path.exists(p):
            raise UserError(f"input not found: {p}")
        if not os.path.isfile(p):
            raise UserError(f"input is not a regular file: {p}")
        if kind == "parquet":
            _parquet_file(p, text_field)


def input_size(path: str) -> int:
    """Bytes on disk that reading the input consumes (for progress)."""
    if input_kind(path) in ("hf_disk", "hf_hub"):
        return sum(os.path.getsize(f) for f in _hf_files(path))
    return os.path.getsize(path)


def parquet_rows(path: str) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def table_rows(path: str) -> int:
    return len(_hf_dataset(path))


def source_info(path: str) -> dict:
    """The manifest's entry for an input: path as given, bytes, sha256 (see module doc)."""
    if input_kind(path) not in ("hf_disk", "hf_hub"):
        return {"path": path, "bytes": os.path.getsize(path), "sha256": file_sha256(path)}
    h = hashlib.sha256()
    size = 0
    for f in _hf_files(path):
        with open(f, "rb") as src:
            while block := src.read(1 << 20):
                h.update(block)
                size += len(block)
    return {"path": path, "bytes": size, "sha256": h.hexdigest()}


# -- records --------------------------------------------------------------------------------------

def open_records(path: str, text_field: str, start: int) -> _Records:
    """The records of a record input from position ``start`` (0: the beginning).

    Iterating yields ``(next, n_bytes, n_invalid_utf8, value)`` per record: ``next`` is
    the position to resume at after it, ``n_bytes`` the uncompressed bytes it took
    (JSONL: its line; Arrow: the UTF-8 bytes of its text), ``value`` the field's value,
    :data:`MISSING` or :data:`BLANK`.
    """
    kind = input_kind(path)
    if kind == "jsonl":
        return _JsonlRecords(path, text_field, start)
    if kind == "parquet":
        return _ParquetRecords(path, text_field, start)
    if kind in ("hf_disk", "hf_hub"):
        return _TableRecords(path, text_field, start)
    raise ValueError(f"{path}: not a record input ({kind})")


class _Records:
    """Base: ``raw_pos`` is on-disk bytes consumed; ``close()`` releases the input."""

    raw_pos: int

    def __iter__(self) -> Iterator[tuple[int, int, int, object]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _JsonlRecords(_Records):
    def __init__(self, path: str, field: str, offset: int):
        self.path, self.field, self.offset = path, field, offset
        self._raw = open(path, "rb", buffering=1 << 20)
        self._stream = gzip.GzipFile(fileobj=self._raw, mode="rb") if path.endswith(".gz") else self._raw
        if offset:
            self._stream.seek(offset)  # gzip seeks by decompressing forward

    @property
    def raw_pos(self) -> int:
        return self._raw.tell()

    def close(self) -> None:
        if self._stream is not self._raw:
            self._stream.close()
        self._raw.close()

    def __iter__(self) -> Iterator[tuple[int, int, int, object]]:
        pos = self.offset
        for data in self._stream:
            start, pos = pos, pos + len(data)
            line = data[len(_BOM):] if start == 0 and data.startswith(_BOM) else data
            if not line.strip():
                yield pos, len(data), 0, BLANK
                continue
            try:
                text, bad = line.decode("utf-8"), 0
            except UnicodeDecodeError:
                text = line.decode("utf-8", errors="replace")
                bad = text.count(_REPLACEMENT) - line.count(_REPLACEMENT.encode())
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise UserError(f"{self.path}: line {self._line_number(start)}: not valid JSON "
                                f"({e.msg} at column {e.colno})") from None
            value = obj.get(self.field, MISSING) if isinstance(obj, dict) else MISSING
            yield pos, len(data), bad, value

    def _line_number(self, offset: int) -> int:
        """1-based line number of the line starting at uncompressed ``offset`` (error path only)."""
        opener = gzip.open if self.path.endswith(".gz") else open
        with opener(self.path, "rb") as f:
            n, left = 1, offset
            while left > 0 and (block := f.read(min(left, 1 << 20))):
                n += block.count(b"\n")
                left -= len(block)
        return n


def _arrow_values(column) -> Iterator[tuple[int, object]]:
    """(UTF-8 bytes, value) per row of a pyarrow (Chunked)Array; null -> None."""
    for v in column.to_pylist():
        yield (len(v.encode("utf-8")) if isinstance(v, str) else 0), v


class _ParquetRecords(_Records):
    def __init__(self, path: str, field: str, start: int):
        self.path, self.field, self.start = path, field, start
        self._pf = _parquet_file(path, field)
        self._size = os.path.getsize(path)
        self._rows = self._pf.metadata.num_rows
        self._done = start

    @property
    def raw_pos(self) -> int:
        return self._size * self._done // max(self._rows, 1)

    def close(self) -> None:
        self._pf.close()

    def __iter__(self) -> Iterator[tuple[int, int, int, object]]:
        import pyarrow as pa

        meta = self._pf.metadata
        group, skip = 0, self.start
        while group < meta.num_row_groups and skip >= meta.row_group(group).num_rows:
            skip -= meta.row_group(group).num_rows
            group += 1
        row = self.start
        try:
            batches = self._pf.iter_batches(batch_size=BATCH_ROWS, row_groups=range(group, meta.num_row_groups),
                                            columns=[self.field], use_threads=False)
            for batch in batches:
                if skip:
                    n = min(skip, batch.num_rows)
                    batch, skip = batch.slice(n), skip - n
                for n_bytes, value in _arrow_values(batch.column(0)):
                    row += 1
                    self._done = row
                    yield row, n_bytes, 0, value
        except (OSError, pa.ArrowException) as e:
            raise UserError(f"{self.path}: cannot read row {row}: {_first_line(e)}") from None


class _TableRecords(_Records):
    def __init__(self, path: str, field: str, start: int):
        ds = _hf_dataset(path)
        _check_column(path, ds.column_names, field)
        self.path, self.start = path, start
        self._table = ds.select_columns([field]).with_format("arrow")  # slices are pyarrow Tables
        self._size = input_size(path)
        self._done = start

    @property
    def raw_pos(self) -> int:
        return self._size * self._done // max(len(self._table), 1)

    def __iter__(self) -> Iterator[tuple[int, int, int, object]]:
        row = self.start
        for a in range(self.start, len(self._table), BATCH_ROWS):
            for n_bytes, value in _arrow_values(self._table[a : a + BATCH_ROWS].column(0)):
                row += 1
                self._done = row
                yield row, n_bytes, 0, value
