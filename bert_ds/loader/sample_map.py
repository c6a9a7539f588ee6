"""The sample map: BERT's chunking of documents into samples, built once per dataset.

Chunking rules (BERT's ``create_instances_from_document``):
- Every document is cut into consecutive chunks of whole sentences; no chunk crosses a
  document end, and every sentence of a kept document is in exactly one chunk.
- A chunk has a *target* length: ``max_num_tokens``, or, with probability
  ``short_seq_prob``, a length drawn uniformly from [2, max_num_tokens]. Drawn per chunk
  (Google's ``create_pretraining_data.py`` draws one per document and keeps it for all of
  the document's chunks; drawing per chunk gives short chunks to long documents too).
- A chunk takes sentences until its tokens reach the target (the sentence that reaches
  it is included, so a chunk may exceed its target; truncation happens at load time) or
  its document ends.

Design choices:
- The target of a chunk is drawn for the sentence it *starts* at, by a keyed hash of
  (seed, shard, sentence): a draw does not depend on the chunks before it, so all
  documents are chunked at once. Each round of array operations closes one chunk of every
  document still open (its end is one ``searchsorted`` over the shard's token ends), so
  the build costs O(chunks) work. The last few open documents (the longest) are walked
  one chunk at a time through precomputed chunk ends, so a corpus of a few huge documents
  does not take one round per chunk.
- The map is a pure function of (shard fingerprints, options, seed), cached beside the
  data under a key of exactly those (R10), and built by one process per dataset: openers
  agree through ``flock`` on a lock file beside the cache (the kernel releases it when its
  holder dies, ``kill -9`` included); the builder writes to a temporary name, fsyncs and
  renames, so a reader sees a whole map or none. Every process memory-maps the file, so
  ranks and loader workers share one copy in the page cache. The shards' sentence offsets
  and document bounds are cached and mapped the same way (:func:`open_sentence_index`).
- The build holds one shard's index at a time (:meth:`ShardReader.read_index`, dropped
  before the next shard's is read) and writes each block of rows to the file as it is made,
  so its memory does not grow with the corpus; a cached open reads no shard index beyond the
  checks of opening the shards.

Layout: a (N, 5) array, one row per sample: shard, document (within the shard), first
sentence, end sentence (exclusive; both within the shard), target length. int32 (20 bytes
per sample) while every shard's sentence and document counts are below 2^31, else int64
(40 bytes per sample).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from bert_ds.base.atomic import atomic_file
from bert_ds.base.errors import ShardError
from bert_ds.data_tools.shard_format import ShardIndex, ShardReader
from bert_ds.loader.permutation import mix64

log = logging.getLogger(__name__)

Split = Literal["all", "train", "held_out"]
COLUMNS = ("shard", "doc", "first", "end", "target")
_MAP_VERSION = 4  # 4: targets hashed per starting sentence, int32 rows, a cached sentence index
_TARGET_STREAM = 0x5EED  # keeps the target draws apart from every other generator of a seed
_BUILD_BLOCK = 1 << 16  # documents per vectorised build step: bounds the build's temporary memory
_FEW_OPEN = 32  # open documents below which each is walked alone instead of in rounds
_WALK_WINDOW = 1 << 20  # sentences whose chunk ends a walk computes at once: bounds its memory
_HELD_OUT_SALT = 0x9E3779B97F4A7C15  # Fibonacci hashing constant: spreads (shard, doc) evenly


def held_out_documents(shard: int, num_docs: int, fraction: float) -> np.ndarray:
    """Which documents of a shard belong to the held-out split: a fixed hash of (shard, doc)."""
    if fraction <= 0:
        return np.zeros(num_docs, dtype=bool)
    docs = np.arange(num_docs, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = (docs + np.uint64(shard) * np.uint64(1 << 40)) * np.uint64(_HELD_OUT_SALT)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def kept_documents(shard: int, num_docs: int, split: Split, held_out: float) -> np.ndarray:
    """(num_docs,) bool: the documents of ``shard`` that belong to ``split``."""
    held = held_out_documents(shard, num_docs, held_out)
    if split == "all":
        return np.ones(num_docs, dtype=bool)
    return held if split == "held_out" else ~held


def chunk_targets(seed: int, shard: int, sentences: np.ndarray, max_num_tokens: int,
                  short_seq_prob: float) -> np.ndarray:
    """(k,) int64: the target length of a chunk starting at each of ``sentences`` (of ``shard``).

    A keyed hash of (seed, shard, sentence), not a generator's stream: any sentence's draw
    costs the same, alone or in a batch, and does not depend on the draws before it.
    """
    k_short, k_len = _target_keys(seed, shard)
    x = np.asarray(sentences, dtype=np.uint64)
    short = mix64(x, k_short) >> np.uint64(11) < np.uint64(int(short_seq_prob * (1 << 53)))
    drawn = 2 + (mix64(x, k_len) % np.uint64(max_num_tokens - 1)).astype(np.int64)  # uniform in [2, max]
    return np.where(short, drawn, max_num_tokens)


def _target_keys(seed: int, shard: int) -> tuple[int, int]:
    state = np.random.SeedSequence([seed, _TARGET_STREAM, 1, shard]).generate_state(2, np.uint64)
    return int(state[0]), int(state[1])


def map_dtype(readers: Sequence[ShardReader]) -> np.dtype:
    """int32 when every shard's sentence and document counts fit it, else int64."""
    limit = max([r.num_sentences for r in readers] + [r.num_docs for r in readers] + [len(readers)], default=0)
    return np.dtype(np.int32 if limit < 2**31 - 1 else np.int64)


def build_sample_map(readers: Sequence[ShardReader], max_num_tokens: int, short_seq_prob: float, seed: int,
                     split: Split = "all", held_out: float = 0.0) -> np.ndarray:
    """The (N, 5) map of :data:`COLUMNS` for ``readers`` (see the module docstring)."""
    empty = [np.zeros((0, 5), dtype=map_dtype(readers))]
    return np.concatenate(empty + list(_map_parts(readers, max_num_tokens, short_seq_prob, seed, split, held_out)))


def _map_parts(readers: Sequence[ShardReader], max_num_tokens: int, short_seq_prob: float, seed: int, split: Split,
               held_out: float) -> Iterator[np.ndarray]:
    """The map as consecutive row blocks, made as they are asked for (the cache writes each
    before the next is made); one shard's index is held at a time."""
    dtype = map_dtype(readers)
    for s, reader in enumerate(readers):
        docs = np.flatnonzero(kept_documents(s, reader.num_docs, split, held_out))
        index = reader.read_index() if len(docs) else None
        for lo in range(0, len(docs), _BUILD_BLOCK):
            part = _chunk_documents(index, s, docs[lo: lo + _BUILD_BLOCK], max_num_tokens, short_seq_prob, seed)
            yield part.astype(dtype, copy=False)
        del index  # before the next shard's is read


def _chunk_documents(index: ShardIndex, shard: int, docs: np.ndarray, max_num_tokens: int,
                     short_seq_prob: float, seed: int) -> np.ndarray:
    """The map rows of documents ``docs`` (ascending) of one shard, as int64 (n, 5).

    Every round closes one chunk of each document still open: its end is the first sentence
    whose token end reaches the chunk's start plus its target (one ``searchsorted`` for all
    documents; ``offsets[j + 1]`` is the token end of sentence j), cut at the document end.
    When few documents are left open (long ones), a round costs more than it does, and
    :func:`_walk_document` finishes each of them alone.
    """
    bounds, offsets = index.bounds, index.offsets
    token_ends = offsets[1:]
    found = []  # (document index into docs, chunk number in its document, first, end, target)
    active = np.arange(len(docs))
    first, doc_end = bounds[docs], bounds[docs + 1]
    k = 0
    while active.size > _FEW_OPEN:
        target = chunk_targets(seed, shard, first, max_num_tokens, short_seq_prob)
        end = np.searchsorted(token_ends, offsets[first] + target, side="left") + 1
        np.minimum(end, doc_end, out=end)
        found.append((active, np.full(active.size, k), first, end, target))
        open_ = end < doc_end
        active, first, doc_end = active[open_], end[open_], doc_end[open_]
        k += 1
    for i, lo, hi in zip(active.tolist(), first.tolist(), doc_end.tolist(), strict=True):
        f, e, t = _walk_document(offsets, shard, lo, hi, max_num_tokens, short_seq_prob, seed)
        found.append((np.full(len(f), i), k + np.arange(len(f)), f, e, t))
    # Rows in (document, chunk) order: document i's k-th chunk goes to row start[i] + k.
    chunks = np.zeros(len(docs), dtype=np.int64)
    for active, *_ in found:
        np.add.at(chunks, active, 1)
    start = np.concatenate([[0], np.cumsum(chunks)[:-1]]).astype(np.int64)
    rows = np.empty((int(chunks.sum()), 5), dtype=np.int64)
    rows[:, 0] = shard
    for active, k, first, end, target in found:
        at = start[active] + k
        rows[at, 1], rows[at, 2], rows[at, 3], rows[at, 4] = docs[active], first, end, target
    return rows


def _walk_document(offsets: np.ndarray, shard: int, lo: int, hi: int, max_num_tokens: int, short_seq_prob: float,
                   seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chunks of sentences [lo, hi) of one document: (first, end, target) arrays.

    The end of a chunk that would start at each sentence is computed for a window of
    sentences at once; the chunks are then followed one by one through those ends (a
    Python list lookup per chunk instead of a round of array operations).
    """
    firsts, i = [], lo
    while i < hi:
        w_hi = min(hi, i + _WALK_WINDOW)
        target = chunk_targets(seed, shard, np.arange(i, w_hi), max_num_tokens, short_seq_prob)
        end = np.searchsorted(offsets[1:], offsets[i: w_hi] + target, side="left") + 1
        ends = np.minimum(end, hi).tolist()
        w_lo = i
        while i < w_hi:
            firsts.append(i)
            i = ends[i - w_lo]
    first = np.array(firsts, dtype=np.int64)
    target = chunk_targets(seed, shard, first, max_num_tokens, short_seq_prob)
    end = np.minimum(np.searchsorted(offsets[1:], offsets[first] + target, side="left") + 1, hi)
    return first, end, target


# -- the cache: one build per dataset, memory-mapped by every process ---------------------------

def cache_key(readers: Sequence[ShardReader], max_num_tokens: int, short_seq_prob: float, seed: int, split: Split,
              held_out: float) -> str:
    """Every input of the map: a shard rewritten under the same path gets a new key (R10)."""
    src = json.dumps([_MAP_VERSION, [r.fingerprint for r in readers], max_num_tokens, short_seq_prob, seed, split,
                      held_out], sort_keys=True)
    return hashlib.sha256(src.encode()).hexdigest()[:24]


def cache_folders(data: Path) -> list[Path]:
    """Where maps are kept: beside the data, else (read-only data) in the user's cache."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bert-ds" / "sample-maps"
    return [data / ".cache", user]


class Mapped:
    """An array memory-mapped from a cache file; pickled as its path, so a loader worker maps
    the same file instead of receiving a copy. ``path`` is None for an array no cache folder
    could hold (then it is pickled whole)."""

    def __init__(self, array: np.ndarray, path: Path | None):
        self.array, self.path = array, path

    def __getstate__(self) -> dict:
        return {"path": self.path, "array": self.array if self.path is None else None}

    def __setstate__(self, state: dict) -> None:
        self.path, self.array = state["path"], state["array"]
        if self.path is not None:
            self.array = load_array(self.path, None)
            if self.array is None:
                raise ShardError(f"{self.path}: vanished or damaged while the dataset was open")


def open_sample_map(data: Path, readers: Sequence[ShardReader], max_num_tokens: int, short_seq_prob: float,
                    seed: int, split: Split = "all", held_out: float = 0.0) -> Mapped:
    """The map, memory-mapped from its cache file (built and written there first if missing)."""
    key = cache_key(readers, max_num_tokens, short_seq_prob, seed, split, held_out)

    def build() -> Iterator[np.ndarray]:
        t0, rows = time.perf_counter(), 0
        for part in _map_parts(readers, max_num_tokens, short_seq_prob, seed, split, held_out):
            rows += len(part)
            yield part
        log.info("sample map built: %d samples in %.2f s (pid %d)", rows, time.perf_counter() - t0, os.getpid())

    return cached_array(data, f"samples-{key}.npy", len(COLUMNS), map_dtype(readers), build)


def open_sentence_index(data: Path, readers: Sequence[ShardReader]) -> tuple[Mapped, Mapped]:
    """Every shard's sentence token offsets and document bounds, concatenated (shard s's
    ``num_sentences + 1`` offsets, then shard s+1's; the same for its ``num_docs + 1`` bounds),
    memory-mapped from the cache: shared by every process instead of each holding its own.
    Written one shard at a time, as it is read.

    Offsets are int32 while every shard holds fewer than 2^30 tokens (a loader adds a sample's
    length to an offset: the margin keeps that inside int32), bounds while every shard's
    sentence count fits; else int64. At 4 bytes per sentence the index is half the size: the
    pages a process has drawn from are part of its resident memory.
    """
    src = json.dumps([_MAP_VERSION, [r.fingerprint for r in readers]])
    key = hashlib.sha256(src.encode()).hexdigest()[:24]
    wide = np.dtype(np.int64)
    tokens = max((r.num_tokens for r in readers), default=0)
    offsets = cached_array(data, f"sentences-{key}.npy", 0, np.dtype(np.int32) if tokens < 2**30 else wide,
                           lambda: (r.read_index().offsets for r in readers))
    bounds = cached_array(data, f"documents-{key}.npy", 0, map_dtype(readers),
                          lambda: (r.read_index().bounds for r in readers))
    return offsets, bounds


def cached_array(data: Path, name: str, columns: int, dtype: np.dtype,
                 build: Callable[[], Iterable[np.ndarray]]) -> Mapped:
    """The ``dtype`` array cached as ``name`` (``columns`` 0: 1-D), built by ``build`` (its parts
    are the array's consecutive rows, made as they are written) if no cache folder has it yet.

    Processes wanting the same missing file take turns on ``flock`` of a lock file beside it:
    the first builds and writes, the others find the file when their turn comes.
    """
    for folder in cache_folders(data):
        found = load_array(folder / name, columns)
        if found is not None:
            return Mapped(found, folder / name)
    for folder in cache_folders(data):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            continue  # read-only: try the next folder
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another process builds this file
            found = load_array(folder / name, columns)  # built by the process we waited for
            if found is None:
                try:
                    save_array(folder / name, build(), dtype, columns)
                except OSError:
                    return Mapped(_whole(build(), dtype, columns), None)  # a full disk: build again, uncached
                found = load_array(folder / name, columns)
            if found is not None:
                return Mapped(found, folder / name)
        finally:
            os.close(fd)  # closing releases the lock; the lock file stays (removing it would race)
    return Mapped(_whole(build(), dtype, columns), None)


def _whole(parts: Iterable[np.ndarray], dtype: np.dtype, columns: int) -> np.ndarray:
    empty = np.zeros((0, columns) if columns else 0, dtype=dtype)
    return np.concatenate([empty, *parts]).astype(dtype, copy=False)


def load_array(path: Path, columns: int | None) -> np.ndarray | None:
    """The array at ``path``, memory-mapped read-only; None if missing, damaged or not of
    ``columns`` columns (0: 1-D; None: any)."""
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return None  # missing, or damaged: the caller rebuilds it under the lock
    if array.dtype not in (np.int32, np.int64):
        return None
    if columns is not None and array.shape[1:] != ((columns,) if columns else ()):
        return None
    return array.view(np.ndarray)  # the same mapped pages, without np.memmap's per-slice overhead


def save_array(path: Path, parts: Iterable[np.ndarray], dtype: np.dtype, columns: int) -> None:
    """Write the concatenation of ``parts`` (``dtype``, ``columns`` columns, 0: 1-D) as ``path``
    (an .npy file), each part as it comes, so that only one part is in memory at a time; readers
    see a whole file or none (:func:`~bert_ds.base.atomic.atomic_file`). Only the lock holder
    writes, so one temporary name is enough; one left by a killed builder is overwritten.

    The row count is known at the end: the header is written first with 0 rows and rewritten in
    place (numpy pads the header so that the row count can grow to 21 digits in place).
    """
    with atomic_file(path) as f:
        _write_npy_header(f, dtype, columns, 0)
        data_start, rows = f.tell(), 0
        for part in parts:
            f.write(np.ascontiguousarray(part, dtype=dtype).data)
            rows += len(part)
        f.seek(0)
        _write_npy_header(f, dtype, columns, rows)
        if f.tell() != data_start:
            raise ValueError(f"{path}: the .npy header changed size when its row count was written")


def _write_npy_header(f, dtype: np.dtype, columns: int, rows: int) -> None:
    shape = (rows, columns) if columns else (rows,)
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                             "fortran_order": False, "shape": shape})
