"""The sample map: BERT's chunking of documents into samples, built once per dataset.

Chunking rules (BERT's ``create_instances_from_document``):
- Every document is cut into consecutive chunks of whole sentences; no chunk crosses a
  document end, and every sentence of a kept document is in exactly one chunk.
- A chunk has a *target* length: ``max_num_tokens``, or, with probability
  ``short_seq_prob``, a length drawn uniformly from [2, max_num_tokens].
- A chunk takes sentences until its tokens reach the target (the sentence that reaches
  it is included, so a chunk may exceed its target; truncation happens at load time) or
  its document ends.

Design choices:
- The target of a chunk is drawn for the sentence it *starts* at: every sentence gets a
  draw (from a generator keyed by (seed, shard, block of 2^20 sentences)), and a chunk
  uses the draw of its first sentence. So the draws do not depend on which chunks came
  before, and the whole map is built with array operations: the end of a chunk that would
  start at each sentence is one ``searchsorted`` over all sentences, and the chunk starts
  are found by following those ends from every document's first sentence, all documents
  at once (one numpy step per chunk of the longest document).
- The map is a pure function of (shard fingerprints, options, seed), cached beside the
  data under a key of exactly those (R10), and built by one process per dataset: openers
  agree through ``flock`` on a lock file beside the cache (the kernel releases it when its
  holder dies, ``kill -9`` included); the builder writes to a temporary name, fsyncs and
  renames, so a reader sees a whole map or none. Every process memory-maps the file, so
  ranks and loader workers share one copy in the page cache.

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
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from bert_ds.base.atomic import fsync_path
from bert_ds.data_tools.shard_format import ShardReader

log = logging.getLogger(__name__)

Split = Literal["all", "train", "held_out"]
COLUMNS = ("shard", "doc", "first", "end", "target")
_MAP_VERSION = 3  # 3: vectorised build (targets drawn per starting sentence), int32 layout
_TARGET_STREAM = 0x5EED  # keeps the target draws apart from every other generator of a seed
_DRAW_BLOCK = 1 << 20  # sentences per keyed generator: draws do not depend on how the build is blocked
_BUILD_BLOCK = 1 << 22  # sentences per vectorised step: bounds the build's temporary memory
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


def chunk_targets(seed: int, shard: int, lo: int, hi: int, max_num_tokens: int, short_seq_prob: float) -> np.ndarray:
    """(hi - lo,) int32: the target length of a chunk starting at each sentence of [lo, hi)."""
    out = np.empty(hi - lo, dtype=np.int32)
    for block in range(lo // _DRAW_BLOCK, -(-hi // _DRAW_BLOCK)):
        rng = np.random.default_rng([seed, _TARGET_STREAM, 1, shard, block])
        short = rng.random(_DRAW_BLOCK) < short_seq_prob
        drawn = rng.integers(2, max_num_tokens + 1, size=_DRAW_BLOCK, dtype=np.int32)
        start = block * _DRAW_BLOCK
        a, b = max(lo, start), min(hi, start + _DRAW_BLOCK)
        out[a - lo: b - lo] = np.where(short[a - start: b - start], drawn[a - start: b - start], max_num_tokens)
    return out


def map_dtype(readers: Sequence[ShardReader]) -> np.dtype:
    """int32 when every shard's sentence and document counts fit it, else int64."""
    limit = max([r.num_sentences for r in readers] + [r.num_docs for r in readers] + [len(readers)], default=0)
    return np.dtype(np.int32 if limit < 2**31 - 1 else np.int64)


def build_sample_map(readers: Sequence[ShardReader], max_num_tokens: int, short_seq_prob: float, seed: int,
                     split: Split = "all", held_out: float = 0.0) -> np.ndarray:
    """The (N, 5) map of :data:`COLUMNS` for ``readers`` (see the module docstring)."""
    dtype = map_dtype(readers)
    parts = [np.zeros((0, 5), dtype=dtype)]
    for s, reader in enumerate(readers):
        keep = kept_documents(s, reader.num_docs, split, held_out)
        for d0, d1 in _document_blocks(reader.doc_bounds):
            rows = _chunk_block(reader, s, d0, d1, keep[d0:d1], max_num_tokens, short_seq_prob, seed)
            parts.append(rows.astype(dtype, copy=False))
    return np.concatenate(parts)


def _document_blocks(bounds: np.ndarray) -> list[tuple[int, int]]:
    """[d0, d1) ranges of whole documents of about ``_BUILD_BLOCK`` sentences (a longer
    document is a block of its own)."""
    cuts = [0]
    num_docs = len(bounds) - 1
    while cuts[-1] < num_docs:
        d = int(np.searchsorted(bounds, bounds[cuts[-1]] + _BUILD_BLOCK, side="right")) - 1
        cuts.append(min(max(d, cuts[-1] + 1), num_docs))
    return list(zip(cuts[:-1], cuts[1:]))


def _chunk_block(reader: ShardReader, shard: int, d0: int, d1: int, keep: np.ndarray, max_num_tokens: int,
                 short_seq_prob: float, seed: int) -> np.ndarray:
    """The map rows of documents [d0, d1) of one shard, as int64 (n, 5)."""
    bounds, offsets = reader.doc_bounds, reader.sentence_offsets
    lo, hi = int(bounds[d0]), int(bounds[d1])
    targets = chunk_targets(seed, shard, lo, hi, max_num_tokens, short_seq_prob)
    doc_end = np.repeat(bounds[d0 + 1: d1 + 1] - lo, np.diff(bounds[d0: d1 + 1]))  # (n,) block-relative
    # the chunk starting at sentence i ends after the first sentence whose token end reaches
    # offsets[i] + target (offsets[j + 1] is the token end of sentence j)
    reach = offsets[lo: hi] + targets
    end = np.searchsorted(offsets[lo + 1: hi + 1], reach, side="left") + 1
    np.minimum(end, doc_end, out=end)
    is_start = np.zeros(hi - lo, dtype=bool)
    frontier = bounds[d0: d1][keep] - lo
    while frontier.size:  # one step per chunk of the longest document in the block
        is_start[frontier] = True
        nxt = end[frontier]
        frontier = nxt[nxt < doc_end[frontier]]
    first = np.flatnonzero(is_start)
    rows = np.empty((len(first), 5), dtype=np.int64)
    rows[:, 0] = shard
    rows[:, 1] = d0 + np.searchsorted(bounds[d0 + 1: d1 + 1] - lo, first, side="right")
    rows[:, 2] = first + lo
    rows[:, 3] = end[first] + lo
    rows[:, 4] = targets[first]
    return rows


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


def open_sample_map(data: Path, readers: Sequence[ShardReader], max_num_tokens: int, short_seq_prob: float,
                    seed: int, split: Split = "all", held_out: float = 0.0) -> tuple[np.ndarray, Path | None]:
    """The map, memory-mapped from its cache file (built there first if missing), and that file.

    Returns an in-memory map and None only when no cache folder can be written.
    """
    key = cache_key(readers, max_num_tokens, short_seq_prob, seed, split, held_out)
    name = f"samples-{key}.npy"
    for folder in cache_folders(data):
        found = load_map(folder / name)
        if found is not None:
            return found, folder / name
    for folder in cache_folders(data):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / f"samples-{key}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            continue  # read-only: try the next folder
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another process builds this map
            found = load_map(folder / name)  # built by the process we waited for
            if found is None:
                samples = _timed_build(readers, max_num_tokens, short_seq_prob, seed, split, held_out)
                try:
                    save_map(folder / name, samples)
                except OSError:
                    return samples, None  # a full disk: use the map without caching it
                found = load_map(folder / name)
            if found is not None:
                return found, folder / name
        finally:
            os.close(fd)  # closing releases the lock; the lock file stays (removing it would race)
    return _timed_build(readers, max_num_tokens, short_seq_prob, seed, split, held_out), None


def _timed_build(readers: Sequence[ShardReader], max_num_tokens: int, short_seq_prob: float, seed: int, split: Split,
                 held_out: float) -> np.ndarray:
    t0 = time.perf_counter()
    samples = build_sample_map(readers, max_num_tokens, short_seq_prob, seed, split, held_out)
    log.info("sample map built: %d samples in %.2f s (pid %d)", len(samples), time.perf_counter() - t0, os.getpid())
    return samples


def load_map(path: Path) -> np.ndarray | None:
    """The cached map at ``path``, memory-mapped read-only; None if missing or not a map."""
    try:
        samples = np.load(path, mmap_mode="r")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # damaged: the caller rebuilds it under the lock
    if samples.ndim != 2 or samples.shape[1] != len(COLUMNS) or samples.dtype not in (np.int32, np.int64):
        return None
    return samples


def save_map(path: Path, samples: np.ndarray) -> None:
    """Write ``samples`` as ``path`` so readers see a whole file or none: temporary name, fsync,
    rename. Only the lock holder writes, so one temporary name per map is enough; one left
    by a killed builder is overwritten by the next."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            np.lib.format.write_array(f, samples, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
