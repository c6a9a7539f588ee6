"""The sample map: BERT's chunking of documents into samples (or whole documents' pieces), built
once per dataset.

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
  renames, so a reader sees a whole map or none. The shards' sentence offsets and document
  bounds are cached the same way (:func:`open_sentence_index`).
- Drawing processes read the map and the index with ``pread`` (:class:`FileArray`), a few
  bytes at a random place per sample, never through a memory map: a map keeps every page a
  draw touched (and up to 15 neighbours the kernel maps with each fault) in the process's
  resident memory, which then grows with the corpus until it holds all of both files.
  Ranks and loader workers share one copy in the page cache either way.
- The build holds one shard's index at a time (:meth:`ShardReader.read_index`, dropped
  before the next shard's is read) and writes each block of rows to the file as it is made,
  so its memory does not grow with the corpus; a cached open reads no shard index beyond the
  checks of opening the shards.

Layout: one little-endian uint64 per sample (8 bytes), ``first << COUNT_BITS | sentences``:
``first`` is the sample's first sentence in the corpus-wide numbering (shard s's sentence j
is ``sentence_base[s] + j``, the shards of every folder of the corpus in order) and
``sentences`` its number of sentences. Every sentence holds at least one token and a chunk
stops at the sentence that reaches its target, so a count is at most ``max_num_tokens``
(< 2^16). Nothing else is stored, since all of it follows: the shard is the last one whose
base is <= ``first``; the target is the hash of (seed, shard, sentence); rows are in corpus
order, so a document's chunks are consecutive. The document itself is needed only by NSP's
draw of *another* document, which tests the drawn document's sentence range instead.

The documents layout (``DataConfig.layout = "documents"``, :func:`build_document_map`): a sample
is one document's tokens, ``[CLS] tokens [SEP]`` at load time; a document longer than
``max_num_tokens`` (the sequence length minus 2) is cut into consecutive pieces of exactly that
many tokens and a last, shorter one; sentences play no part, so neither does the seed. A row is
``start << COUNT_BITS | tokens``: ``start`` the piece's first token in the corpus-wide numbering
(shard s's token j is ``token_base[s] + j``), ``tokens`` its length (< 2^16). A row alone says
where a sample's tokens are and how long it is, so a draw reads no sentence index, and packing
micro-batches to a token budget reads one row per sample. Cached beside the BERT maps under a
key of the shards, the piece length, the split and the held-out share.
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
from bert_ds.data_tools.shard_format import FileArray, ShardIndex, ShardReader
from bert_ds.loader.permutation import mix64

log = logging.getLogger(__name__)

Split = Literal["all", "train", "held_out"]
COUNT_BITS = 16  # a row's low bits: the sample's sentence count (<= max_num_tokens < 2^16)
COUNT_MASK = (1 << COUNT_BITS) - 1
MAP_DTYPE = np.dtype("<u8")
_MAX_SENTENCES = 1 << (64 - COUNT_BITS)  # corpus-wide sentence numbers must fit the high bits
_MAP_VERSION = 5  # 5: one packed uint64 per sample, read with pread
_DOCUMENT_MAP_VERSION = 1  # the documents layout's map
_MAX_TOKENS = 1 << (64 - COUNT_BITS)  # corpus-wide token numbers of the documents layout must fit the high bits
_INDEX_VERSION = 4  # the sentence index's own format (unchanged by map versions 4 -> 5)
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


class ChunkTargets:
    """The target length of a chunk, by the shard and sentence it starts at: ``max_num_tokens``,
    or with probability ``short_seq_prob`` a length uniform in [2, max_num_tokens].

    A keyed hash of (seed, shard, sentence), not a generator's stream: any sentence's draw
    costs the same, alone or in a batch, and does not depend on the draws before it. The map
    build draws for arrays of sentences (:meth:`many`), the loader for one sample at a time
    (:meth:`one`, Python ints: no numpy call per sample); both compute the same formula.
    """

    def __init__(self, seed: int, max_num_tokens: int, short_seq_prob: float):
        self.seed, self.max_num_tokens = seed, max_num_tokens
        self._short_below = int(short_seq_prob * (1 << 53))
        self._keys: dict[int, tuple[int, int]] = {}

    def keys(self, shard: int) -> tuple[int, int]:
        if shard not in self._keys:
            state = np.random.SeedSequence([self.seed, _TARGET_STREAM, 1, shard]).generate_state(2, np.uint64)
            self._keys[shard] = int(state[0]), int(state[1])
        return self._keys[shard]

    def many(self, shard: int, sentences: np.ndarray) -> np.ndarray:
        """(k,) int64 targets of chunks starting at (k,) ``sentences`` of ``shard``."""
        k_short, k_len = self.keys(shard)
        x = np.asarray(sentences, dtype=np.uint64)
        short = mix64(x, k_short) >> np.uint64(11) < np.uint64(self._short_below)
        drawn = 2 + (mix64(x, k_len) % np.uint64(self.max_num_tokens - 1)).astype(np.int64)
        return np.where(short, drawn, self.max_num_tokens)

    def one(self, shard: int, sentence: int) -> int:
        k_short, k_len = self.keys(shard)
        if mix64(sentence, k_short) >> 11 < self._short_below:
            return 2 + mix64(sentence, k_len) % (self.max_num_tokens - 1)
        return self.max_num_tokens


def bases(counts: Sequence[int]) -> list[int]:
    """Where each shard's sentences (or documents) start in the corpus-wide numbering, from the
    shards' counts in order."""
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)[:-1]]).tolist() if len(counts) else []


def build_sample_map(readers: Sequence[ShardReader], max_num_tokens: int, short_seq_prob: float, seed: int,
                     split: Split = "all", held_out: float = 0.0) -> np.ndarray:
    """The (N,) uint64 map for ``readers`` (see the module docstring)."""
    empty = [np.zeros(0, dtype=MAP_DTYPE)]
    return np.concatenate(empty + list(_map_parts(readers, max_num_tokens, short_seq_prob, seed, split, held_out)))


def _map_parts(readers: Sequence[ShardReader], max_num_tokens: int, short_seq_prob: float, seed: int, split: Split,
               held_out: float) -> Iterator[np.ndarray]:
    """The map as consecutive row blocks, made as they are asked for (the cache writes each
    before the next is made); one shard's index is held at a time."""
    if sum(r.num_sentences for r in readers) >= _MAX_SENTENCES:
        raise ShardError(f"{len(readers)} shards hold more than 2^{64 - COUNT_BITS} sentences: too many for the map")
    targets = ChunkTargets(seed, max_num_tokens, short_seq_prob)
    starts = bases([r.num_sentences for r in readers])
    for s, reader in enumerate(readers):
        docs = np.flatnonzero(kept_documents(s, reader.num_docs, split, held_out))
        index = reader.read_index() if len(docs) else None
        for lo in range(0, len(docs), _BUILD_BLOCK):
            first, end = _chunk_documents(index, s, docs[lo: lo + _BUILD_BLOCK], targets)
            yield ((first + starts[s]).astype(MAP_DTYPE) << np.uint64(COUNT_BITS)) | (end - first).astype(MAP_DTYPE)
        del index  # before the next shard's is read


def _chunk_documents(index: ShardIndex, shard: int, docs: np.ndarray,
                     targets: ChunkTargets) -> tuple[np.ndarray, np.ndarray]:
    """The chunks of documents ``docs`` (ascending) of one shard: (first, end) sentence arrays
    (int64, within the shard), in corpus order.

    Every round closes one chunk of each document still open: its end is the first sentence
    whose token end reaches the chunk's start plus its target (one ``searchsorted`` for all
    documents; ``offsets[j + 1]`` is the token end of sentence j), cut at the document end.
    When few documents are left open (long ones), a round costs more than it does, and
    :func:`_walk_document` finishes each of them alone.
    """
    bounds, offsets = index.bounds, index.offsets
    token_ends = offsets[1:]
    firsts, ends = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    first, doc_end = bounds[docs], bounds[docs + 1]
    while first.size > _FEW_OPEN:
        end = np.searchsorted(token_ends, offsets[first] + targets.many(shard, first), side="left") + 1
        np.minimum(end, doc_end, out=end)
        firsts.append(first)
        ends.append(end)
        open_ = end < doc_end
        first, doc_end = end[open_], doc_end[open_]
    for lo, hi in zip(first.tolist(), doc_end.tolist(), strict=True):
        f, e = _walk_document(offsets, shard, lo, hi, targets)
        firsts.append(f)
        ends.append(e)
    first, end = np.concatenate(firsts), np.concatenate(ends)
    order = np.argsort(first, kind="stable")  # chunks never overlap: sorting by start is corpus order
    return first[order], end[order]


def _walk_document(offsets: np.ndarray, shard: int, lo: int, hi: int,
                   targets: ChunkTargets) -> tuple[np.ndarray, np.ndarray]:
    """The chunks of sentences [lo, hi) of one document: (first, end) arrays.

    The end of a chunk that would start at each sentence is computed for a window of
    sentences at once; the chunks are then followed one by one through those ends (a
    Python list lookup per chunk instead of a round of array operations).
    """
    firsts, i = [], lo
    while i < hi:
        w_hi = min(hi, i + _WALK_WINDOW)
        target = targets.many(shard, np.arange(i, w_hi))
        end = np.searchsorted(offsets[1:], offsets[i: w_hi] + target, side="left") + 1
        ends = np.minimum(end, hi).tolist()
        w_lo = i
        while i < w_hi:
            firsts.append(i)
            i = ends[i - w_lo]
    first = np.array(firsts, dtype=np.int64)
    end = np.searchsorted(offsets[1:], offsets[first] + targets.many(shard, first), side="left") + 1
    return first, np.minimum(end, hi)


def build_document_map(readers: Sequence[ShardReader], max_num_tokens: int, split: Split = "all",
                       held_out: float = 0.0) -> np.ndarray:
    """The (N,) uint64 map of the documents layout for ``readers`` (see the module docstring)."""
    empty = [np.zeros(0, dtype=MAP_DTYPE)]
    return np.concatenate(empty + list(_document_parts(readers, max_num_tokens, split, held_out)))


def _document_parts(readers: Sequence[ShardReader], max_num_tokens: int, split: Split,
                    held_out: float) -> Iterator[np.ndarray]:
    """The documents layout's map as consecutive row blocks; one shard's index held at a time."""
    if not 1 <= max_num_tokens <= COUNT_MASK:
        raise ValueError(f"a piece of {max_num_tokens} tokens does not fit the map's {COUNT_BITS}-bit length")
    if sum(r.num_tokens for r in readers) >= _MAX_TOKENS:
        raise ShardError(f"{len(readers)} shards hold more than 2^{64 - COUNT_BITS} tokens: too many for the map")
    starts = bases([r.num_tokens for r in readers])
    for s, reader in enumerate(readers):
        docs = np.flatnonzero(kept_documents(s, reader.num_docs, split, held_out))
        index = reader.read_index() if len(docs) else None
        for lo in range(0, len(docs), _BUILD_BLOCK):
            block = docs[lo: lo + _BUILD_BLOCK]
            first, end = index.offsets[index.bounds[block]], index.offsets[index.bounds[block + 1]]
            pieces = -(-(end - first) // max_num_tokens)  # every kept document holds a token
            doc = np.repeat(np.arange(len(block)), pieces)
            k = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece number in its document
            start = first[doc] + k * max_num_tokens
            length = np.minimum(end[doc] - start, max_num_tokens)
            yield ((start + starts[s]).astype(MAP_DTYPE) << np.uint64(COUNT_BITS)) | length.astype(MAP_DTYPE)
        del index  # before the next shard's is read


def open_document_map(data: Path, readers: Sequence[ShardReader], max_num_tokens: int, split: Split = "all",
                      held_out: float = 0.0) -> Cached:
    """The documents layout's map of the corpus of ``readers``, cached as :func:`open_sample_map`'s."""
    src = json.dumps([_DOCUMENT_MAP_VERSION, "documents", [r.fingerprint for r in readers], max_num_tokens, split,
                      held_out], sort_keys=True)
    key = hashlib.sha256(src.encode()).hexdigest()[:24]

    def build() -> Iterator[np.ndarray]:
        t0, rows = time.perf_counter(), 0
        for part in _document_parts(readers, max_num_tokens, split, held_out):
            rows += len(part)
            yield part
        log.info("document map built: %d samples in %.2f s (pid %d)", rows, time.perf_counter() - t0, os.getpid())

    return cached_array(data, f"pieces-{key}.npy", MAP_DTYPE, build)


# -- the cache: one build per dataset, read by every process --------------------------------------

class InMemory:
    """An array that no cache folder could hold (read-only data and user cache, a full disk), read
    the way a :class:`FileArray` is; pickled whole."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, where: slice | int) -> np.ndarray | int:
        return int(self.array[where]) if isinstance(where, int) else self.array[where]

    def ints(self, lo: int, hi: int) -> list[int]:
        return self.array[lo:hi].tolist()


Cached = FileArray | InMemory  # a cache file read with pread, or an array in memory


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


def open_sample_map(data: Path, readers: Sequence[ShardReader], max_num_tokens: int, short_seq_prob: float,
                    seed: int, split: Split = "all", held_out: float = 0.0) -> Cached:
    """The map of the corpus of ``readers`` (kept in ``data``'s cache; built and written there first if
    missing)."""
    key = cache_key(readers, max_num_tokens, short_seq_prob, seed, split, held_out)

    def build() -> Iterator[np.ndarray]:
        t0, rows = time.perf_counter(), 0
        for part in _map_parts(readers, max_num_tokens, short_seq_prob, seed, split, held_out):
            rows += len(part)
            yield part
        log.info("sample map built: %d samples in %.2f s (pid %d)", rows, time.perf_counter() - t0, os.getpid())

    return cached_array(data, f"samples-{key}.npy", MAP_DTYPE, build)


def index_dtypes(readers: Sequence[ShardReader]) -> tuple[np.dtype, np.dtype]:
    """The sentence index's (offsets, bounds) dtypes: int32 where every shard's values fit it.

    Offsets are int32 while every shard holds fewer than 2^30 tokens (a loader adds a sample's
    length to an offset: the margin keeps that inside int32), bounds while every shard's
    sentence count fits.
    """
    tokens = max((r.num_tokens for r in readers), default=0)
    sentences = max((r.num_sentences for r in readers), default=0)
    narrow, wide = np.dtype("<i4"), np.dtype("<i8")
    return (narrow if tokens < 2**30 else wide), (narrow if sentences < 2**31 - 1 else wide)


def open_sentence_index(data: Path, readers: Sequence[ShardReader]) -> tuple[Cached, Cached]:
    """Every shard's sentence token offsets and document bounds, concatenated (shard s's
    ``num_sentences + 1`` offsets, then shard s+1's; the same for its ``num_docs + 1`` bounds),
    kept in ``data``'s cache and read from there by every process. Written one shard at a
    time, as it is read. Shard s's entry for its sentence j is at ``sentence_base[s] + s + j``
    (each earlier shard adds one closing entry), its document d's bounds at ``doc_base[s] + s + d``.
    """
    src = json.dumps([_INDEX_VERSION, [r.fingerprint for r in readers]])
    key = hashlib.sha256(src.encode()).hexdigest()[:24]
    offsets_dtype, bounds_dtype = index_dtypes(readers)
    offsets = cached_array(data, f"sentences-{key}.npy", offsets_dtype,
                           lambda: (r.read_index().offsets for r in readers))
    bounds = cached_array(data, f"documents-{key}.npy", bounds_dtype, lambda: (r.read_index().bounds for r in readers))
    return offsets, bounds


def cached_array(data: Path, name: str, dtype: np.dtype, build: Callable[[], Iterable[np.ndarray]]) -> Cached:
    """The 1-D ``dtype`` array cached as ``name``, built by ``build`` (its parts are the array's
    consecutive elements, made as they are written) if no cache folder has it yet.

    Processes wanting the same missing file take turns on ``flock`` of a lock file beside it:
    the first builds and writes, the others find the file when their turn comes.
    """
    for folder in cache_folders(data):
        found = open_array(folder / name, dtype)
        if found is not None:
            return found
    for folder in cache_folders(data):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            continue  # read-only: try the next folder
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another process builds this file
            found = open_array(folder / name, dtype)  # built by the process we waited for
            if found is None:
                try:
                    save_array(folder / name, build(), dtype)
                except OSError:
                    return _whole(build(), dtype)  # a full disk: build again, uncached
                found = open_array(folder / name, dtype)
            if found is not None:
                return found
        finally:
            os.close(fd)  # closing releases the lock; the lock file stays (removing it would race)
    return _whole(build(), dtype)


def _whole(parts: Iterable[np.ndarray], dtype: np.dtype) -> InMemory:
    return InMemory(np.concatenate([np.zeros(0, dtype=dtype), *parts]).astype(dtype, copy=False))


_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def open_array(path: Path, dtype: np.dtype) -> FileArray | None:
    """The 1-D ``dtype`` .npy array at ``path``, to be read with pread; None if missing, damaged
    (a header that does not parse, another dtype or shape, a size that does not match it)."""
    try:
        with open(path, "rb") as f:
            read_header = _HEADER_READERS.get(np.lib.format.read_magic(f))
            if read_header is None:
                return None
            shape, fortran, stored = read_header(f)
            offset, size = f.tell(), os.fstat(f.fileno()).st_size
    except (OSError, ValueError):
        return None  # missing, or damaged: the caller rebuilds it under the lock
    if stored != dtype or len(shape) != 1 or fortran or size != offset + shape[0] * dtype.itemsize:
        return None
    try:
        return FileArray(path, dtype, shape[0], offset)
    except ShardError:
        return None  # removed since: the caller rebuilds it under the lock


def save_array(path: Path, parts: Iterable[np.ndarray], dtype: np.dtype) -> None:
    """Write the concatenation of ``parts`` (1-D, ``dtype``) as ``path`` (an .npy file), each part as
    it comes, so that only one part is in memory at a time; readers see a whole file or none
    (:func:`~bert_ds.base.atomic.atomic_file`). Only the lock holder writes, so one temporary name
    is enough; one left by a killed builder is overwritten.

    The length is known at the end: the header is written first with length 0 and rewritten in
    place (numpy pads the header so that the length can grow to 21 digits in place).
    """
    with atomic_file(path) as f:
        _write_npy_header(f, dtype, 0)
        data_start, rows = f.tell(), 0
        for part in parts:
            f.write(np.ascontiguousarray(part, dtype=dtype).data)
            rows += len(part)
        f.seek(0)
        _write_npy_header(f, dtype, rows)
        if f.tell() != data_start:
            raise ValueError(f"{path}: the .npy header changed size when its length was written")


def _write_npy_header(f, dtype: np.dtype, rows: int) -> None:
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                             "fortran_order": False, "shape": (rows,)})
