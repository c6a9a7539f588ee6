"""Pretraining samples built at load time from token shards.

Design choices:
- Shards store sentences and document boundaries, not samples. A *sample map* (each
  sample's first sentence and sentence count; :mod:`.sample_map`) is built once per corpus
  and seed with BERT's chunking rule, cached beside the data and read with ``pread`` by
  every process, like the sentence index and the tokens: a drawing process maps nothing of
  the corpus, so its resident memory does not grow with it. Everything random after that
  (the A/B split, the random next segment, truncation, masking) is drawn at load time.
- A corpus is one dataset folder, the folders of a partitioned build, or any list of
  folders built with one tokenizer: their shards are numbered in order as one corpus, so
  every sample comes once per epoch and each folder weighs what its data weighs.
- Every sample is a pure function of ``(seed, epoch, sample index)``: its generator
  is seeded with exactly that triple. So the same sample comes out whatever the
  world size, loader worker count or resume point, and masks change every epoch.
- The global order is one permutation per epoch, a keyed bijection computed per position
  (:mod:`.permutation`), so no process holds an array as long as the epoch. Training
  consumes one global stream of positions; a rank takes its slice of each micro-step.
  The only state to checkpoint is the number of consumed samples, and resuming on
  another world size continues the same stream.
- Batches are padded to the longest sample of the micro-batch; the model unpads
  once, so padding costs only the copy. Labels follow Hugging Face: -100 where a
  token is not a prediction target, ``next_sentence_label`` 0 = true next.
- The collate also computes where the real and the masked tokens go once padding is
  removed (:func:`bert_ds.model.padding.unpad`), here on the host and in the loader's worker
  processes, so the model never has to ask the GPU for a length or a count.
- Two layouts (``DataConfig.layout``): BERT's ``sentences`` (chunks of whole sentences, sentence
  pairs, short targets) and ``documents`` (``[CLS] document [SEP]``, a long document in
  consecutive pieces; :func:`~.sample_map.build_document_map`), the latter with no pairs and no
  segment ids. Both are pure functions of (seed, epoch, index) and share the order, the reading
  and the masking.
- Token budget (``DataConfig.token_budget``, documents layout): a micro-batch holds as many samples
  as fit ``micro_batch_size x max_seq_length`` tokens, packed greedily in the global stream's
  order; :class:`TokenBudget` says how ranks share a step and what it costs. The state stays the
  count of consumed samples.
- Random replacement tokens (the 10% of masking's 80/10/10): BERT's ``[first_regular, V)`` for a
  WordPiece vocabulary, whose special and unused tokens come first; any id but the five special
  ones for a ``--tokenizer``'s, whose special tokens may sit anywhere (ModernBERT's [CLS] to
  [MASK] at 50,281-50,284 of 50,368, where BERT's rule would draw only from the 83 ids above them).
"""

from __future__ import annotations

import resource
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bert_ds.config import BatchPlan, DataConfig
from bert_ds.loader.workers import end_loader_workers_at_exit, loader_worker_init
from bert_ds.model.padding import IGNORE_INDEX, unpad
from bert_ds.base.errors import ShardError
from bert_ds.data_tools.manifest import Manifest, given_tokenizer, open_dataset
from bert_ds.data_tools.partition import dataset_folders
from bert_ds.data_tools.shard_format import FileArray, ShardReader
from bert_ds.loader.permutation import EpochPermutation
from bert_ds.loader.sample_map import (
    COUNT_BITS, COUNT_MASK, ChunkTargets, bases, open_document_map, open_sample_map, open_sentence_index,
)

Batch = dict[str, torch.Tensor | int]  # what collate returns: tensors, and max_seqlen as a host int
OPEN_FILES_SHARE = 4  # a drawing process keeps at most 1/4 of its open-file limit in token files
_PERMUTATION_STREAM = 0x5EED  # keeps the shuffle generator apart from the per-sample ones


@dataclass(frozen=True)
class SpecialTokens:
    pad: int
    unk: int
    cls: int
    sep: int
    mask: int

    @property
    def first_regular(self) -> int:
        """Random replacement tokens are drawn from [first_regular, vocab_size)."""
        return max(self.pad, self.unk, self.cls, self.sep, self.mask) + 1


def _sample_key(seed: int, epoch: int, index: int) -> np.ndarray:
    """The Philox key of one sample: counter-based, so any sample is drawn independently."""
    return np.array([index, (seed << 32) | epoch], dtype=np.uint64)


class _SampleRng(threading.local):
    """One reusable generator per thread, reset to the state of a fresh ``Philox(key=key)``.

    Building ``Generator(Philox(key=...))`` per sample cost ~11 us of a ~50 us sample
    (the constructor also seeds a throwaway SeedSequence from os.urandom); setting the
    state of a kept one costs ~2 us and draws the same numbers. Thread-local, so
    samples drawn in several threads never share a stream.
    """

    _ZEROS = np.zeros(4, dtype=np.uint64)

    def __init__(self):
        self.bit_generator = np.random.Philox(key=np.zeros(2, dtype=np.uint64))
        self.generator = np.random.Generator(self.bit_generator)

    def keyed(self, key: np.ndarray) -> np.random.Generator:
        # Counter 0 and an empty buffer (buffer_pos 4), as Philox.__init__ leaves them.
        self.bit_generator.state = {"bit_generator": "Philox", "state": {"counter": self._ZEROS, "key": key},
                                    "buffer": self._ZEROS, "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
        return self.generator


class PretrainingDataset(Dataset):
    """Map-style dataset indexed by *global stream position* (epochs unrolled).

    ``dataset[p]`` is sample ``perm_e[p % N]`` of epoch ``e = p // N``.
    ``path`` is one dataset folder, a parent of a partitioned build's folders, or a list of
    either: all of them are one corpus (every sample once per epoch, in proportion to the
    data), which must share one tokenizer. ``split`` selects documents: all of them, or the
    train / held-out side of ``DataConfig.held_out`` (a fixed share of documents, chosen by a
    hash).
    """

    def __init__(self, path: str | Path | Sequence[str | Path], cfg: DataConfig, seed: int,
                 split: Literal["all", "train", "held_out"] = "all"):
        if not 0 <= seed < 2**32:
            raise ShardError(f"seed must be in [0, 2^32), got {seed}")
        paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
        self.path = paths[0]  # named in messages; the corpus's sample maps are cached here
        self.cfg = cfg
        self.seed = seed
        self.folders = [f for p in paths for f in dataset_folders(p)]
        self.manifest, readers, self._shards = _open_corpus(self.folders)
        self._token_dtype = np.dtype(self.manifest.token_dtype)
        self.vocab_size = self.manifest.vocab_size
        self.special = SpecialTokens(**self.manifest.special_tokens)
        # Random replacements skip the special ids (a --tokenizer's; module docstring): a draw x from
        # [0, V - k) becomes x + #{i: s_i - i <= x} for the k sorted ids s_i. None: BERT's [first_regular, V).
        special = sorted(set(self.manifest.special_tokens.values()))
        self._skipped = np.array(special) - np.arange(len(special)) if given_tokenizer(self.manifest) else None
        if cfg.whole_word_mask and not (self.folders[0] / "vocab.txt").is_file():
            raise ShardError(f"{self.path}: whole_word_mask (--whole-word-mask) needs a WordPiece vocabulary "
                             "(vocab.txt, ## continuations); this dataset was built with --tokenizer")
        reserve = 3 if cfg.pair_task != "none" else 2  # [CLS] A [SEP] (B [SEP])
        self.max_num_tokens = cfg.max_seq_length - reserve
        # Built in the corpus's cache by the first process to open it, then read with pread by
        # every process; the readers' own index arrays are dropped with them at the end of __init__.
        if cfg.layout == "documents":
            self._map = open_document_map(self.path, readers, self.max_num_tokens, split, cfg.held_out)
            self._token_base = bases([r.num_tokens for r in readers])
        else:
            self._map = open_sample_map(self.path, readers, self.max_num_tokens, cfg.short_seq_prob, seed, split,
                                        cfg.held_out)
            self._offsets, self._bounds = open_sentence_index(self.path, readers)
            self._sentence_base = bases([r.num_sentences for r in readers])
            self._doc_base = bases([r.num_docs for r in readers])
            self._targets = ChunkTargets(seed, self.max_num_tokens, cfg.short_seq_prob)
        if len(self._map) == 0:
            raise ShardError(f"{self.path}: no samples in the {split!r} split (no non-empty documents)")
        self.total_docs = sum(r.num_docs for r in readers)
        self.continuation = _continuation_table(self.folders[0], self.vocab_size) if cfg.whole_word_mask else None
        self._token_files: dict[int, FileArray] = {}  # shard -> its open token file
        self.open_files = token_files_allowed()
        self._rng = _SampleRng()
        self._no_labels = np.full(cfg.max_seq_length, IGNORE_INDEX, dtype=np.int64)  # copied per sample
        self._perm = EpochPermutation(self.num_samples, seed, 0)

    # The map and the index are read with pread from their cache files: a loader worker gets their
    # paths, not copies (:class:`FileArray` pickles as its path), and opens the token files itself.
    # The thread-local generator cannot be pickled: each copy makes its own.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_token_files"] = {}
        del state["_rng"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._rng = _SampleRng()

    @property
    def num_samples(self) -> int:
        """Samples in one epoch."""
        return len(self._map)

    def __len__(self) -> int:
        return self.num_samples

    def permutation(self, epoch: int) -> EpochPermutation:
        """The order of ``epoch``: position ``p`` reads sample ``permutation(epoch)(p)``."""
        if epoch != self._perm.epoch:
            self._perm = EpochPermutation(self.num_samples, self.seed, epoch)
        return self._perm

    def chunk(self, index: int) -> tuple[int, int, int]:
        """Sample ``index``'s sentences: (shard, first, end), sentence numbers within the shard
        (shards of every folder of the corpus in order)."""
        row = self._map[index]
        first = row >> COUNT_BITS
        shard = bisect_right(self._sentence_base, first) - 1
        first -= self._sentence_base[shard]
        return shard, first, first + (row & COUNT_MASK)

    def document(self, g: int) -> tuple[int, int, int]:
        """Document ``g`` of the corpus (shards in order): (shard, first sentence, end sentence)."""
        shard = bisect_right(self._doc_base, g) - 1
        lo, hi = self._bounds.ints(g + shard, g + shard + 2)  # each earlier shard adds a closing bound
        return shard, lo, hi

    def _sentence_offsets(self, shard: int, lo: int, hi: int) -> list[int]:
        """Token offsets (within the shard) where its sentences ``lo .. hi`` start, ``hi`` included."""
        at = self._sentence_base[shard] + shard  # each earlier shard adds a closing offset
        return self._offsets.ints(at + lo, at + hi + 1)

    def __getitem__(self, position: int) -> dict[str, np.ndarray | int]:
        epoch, offset = divmod(int(position), self.num_samples)
        return self.sample(epoch, self.permutation(epoch)(offset))

    def sample(self, epoch: int, index: int) -> dict[str, np.ndarray | int]:
        """Sample ``index`` of ``epoch``: a pure function of (seed, epoch, index)."""
        rng = self._rng.keyed(_sample_key(self.seed, epoch, index))
        if self.cfg.layout == "documents":
            return self._document_sample(rng, index)
        shard, first, end = self.chunk(index)
        # The chunk's sentence offsets and tokens, each read once (relative offsets into `chunk`).
        offsets = self._sentence_offsets(shard, first, end)
        base = offsets[0]
        chunk = self._tokens(shard, base, offsets[-1])
        cuts = [o - base for o in offsets]
        task = self.cfg.pair_task
        if task == "none":
            a = chunk[: self.max_num_tokens]
            b, label = None, -1
        elif task == "nsp":
            target = self._targets.one(shard, first)
            a, b, label = self._nsp_pair(rng, shard, first, chunk, cuts, target)
        else:
            a, b, label = self._sop_pair(rng, chunk, cuts)
        if b is not None:
            a, b = _truncate_pair(rng, a, b, self.max_num_tokens)
        ids, types = self._assemble(a, b)
        labels = self._mask(rng, ids)
        return {"input_ids": ids, "token_type_ids": types, "labels": labels, "next_sentence_label": label}

    def _document_sample(self, rng, index: int) -> dict[str, np.ndarray | int]:
        """``[CLS] piece [SEP]`` of the documents layout: one map row says where the piece is."""
        row = self._map[index]
        start, n = row >> COUNT_BITS, row & COUNT_MASK
        shard = bisect_right(self._token_base, start) - 1
        lo = start - self._token_base[shard]
        ids = np.empty(n + 2, dtype=np.int64)
        ids[0], ids[1: n + 1], ids[n + 1] = self.special.cls, self._tokens(shard, lo, lo + n), self.special.sep
        labels = self._mask(rng, ids)
        return {"input_ids": ids, "token_type_ids": np.zeros(n + 2, dtype=np.int64), "labels": labels,
                "next_sentence_label": -1}

    def lengths(self, lo: int, hi: int) -> list[int]:
        """The tokens of the samples at stream positions ``[lo, hi)``, [CLS] and [SEP] included,
        without making them (documents layout: one map row each); what :class:`TokenBudget` packs by."""
        if self.cfg.layout != "documents":
            raise ValueError("sample lengths are known ahead only in the documents layout")
        out: list[int] = []
        while lo < hi:
            epoch, offset = divmod(lo, self.num_samples)
            stop = min(hi, (epoch + 1) * self.num_samples)
            indices = self.permutation(epoch).many(np.arange(offset, offset + stop - lo)).tolist()
            out += [(self._map[i] & COUNT_MASK) + 2 for i in indices]
            lo = stop
        return out

    def _nsp_pair(self, rng, shard: int, first: int, chunk: np.ndarray, cuts: list[int], target: int):
        """``chunk``: the tokens of the sample's sentences (from ``first`` of ``shard``); ``cuts``:
        where each starts in it, then its length."""
        n = len(cuts) - 1
        split = int(rng.integers(1, n)) if n >= 2 else 1
        a = chunk[: cuts[split]]
        if n == 1 or rng.random() < 0.5:
            return a, self._random_segment(rng, shard, first, max(1, target - len(a))), 1
        return a, chunk[cuts[split]:], 0

    def _random_segment(self, rng, shard: int, first: int, want: int) -> np.ndarray:
        """Sentences from a random start in another document than the one holding sentence
        ``first`` of ``shard``, up to ``want`` tokens."""
        for _ in range(10):  # a single-document corpus has no "other" document
            s, lo, hi = self.document(int(rng.integers(0, self.total_docs)))
            if s != shard or not lo <= first < hi:
                break
        start = int(rng.integers(lo, hi))
        # Whole sentences until `want` tokens are reached (the last one may overshoot). Every
        # sentence holds a token, so the first `want` sentences always reach it.
        offsets = self._sentence_offsets(s, start, min(hi, start + want))
        stop = bisect_left(offsets, offsets[0] + want)
        return self._tokens(s, offsets[0], offsets[min(stop, len(offsets) - 1)])

    def _tokens(self, shard: int, lo: int, hi: int) -> np.ndarray:
        """Token ids ``[lo, hi)`` of a shard, checked to be in the vocabulary.

        Opening a shard checks its header's max id, not the payload; reading every token at
        start-up is what ``data_tools verify`` does and would cost a full pass over the data.
        Checked here instead, where a sample's tokens are read: one ``max`` over at most a
        sample's tokens, 1-2 us of a 14-22 us sample (a damaged id would otherwise reach the
        embedding as an IndexError, or a device-side assert on a GPU).
        """
        ids = self._token_file(shard)[lo:hi]
        if ids.size and int(ids.max()) >= self.vocab_size:
            at = int((ids >= self.vocab_size).argmax())
            raise ShardError(
                f"{self._token_file(shard).path}: token id {int(ids[at])} at token offset "
                f"{lo + at} is outside the vocabulary [0, {self.vocab_size}): the shard is damaged "
                f"(`python -m bert_ds.data_tools verify {self.path}` checks every shard)")
        return ids

    def _token_file(self, shard: int) -> FileArray:
        """A shard's token ids, read with ``pread`` (a sample reads a few hundred bytes at a random
        place: a memory map would keep every page a draw touched, and up to 15 neighbours the kernel
        maps with it, until the process's resident memory held the whole corpus). Opened when first
        read, and at most ``open_files`` at a time (:func:`token_files_allowed`): a corpus of 30,000
        shards (2T tokens) must not need a descriptor for each in every rank and loader worker.
        Beyond that a draw from a closed shard reopens its file (measured with 1,560 shards and 256
        open: ~24% of a sample's CPU, ``benchmarks/loader_cost.py``)."""
        f = self._token_files.get(shard)
        if f is None:
            if len(self._token_files) >= self.open_files:  # the longest open goes (draws are uniform)
                self._token_files.pop(next(iter(self._token_files))).close()
            path, count = self._shards[shard]
            f = self._token_files[shard] = FileArray(path, self._token_dtype, count)
        return f

    def _sop_pair(self, rng, chunk: np.ndarray, cuts: list[int]):
        """ALBERT's sentence-order prediction: label 1 when the two halves are swapped."""
        n, size = len(cuts) - 1, cuts[-1]
        if n >= 2:
            cut = cuts[int(rng.integers(1, n))]
        else:  # one sentence: cut it at a token (ALBERT needs two segments)
            cut = int(rng.integers(1, size)) if size >= 2 else 1
        a, b = chunk[:cut], chunk[cut:]
        if len(b) == 0:
            b = np.array([self.special.unk])
        if rng.random() < 0.5:
            return b, a, 1
        return a, b, 0

    def _assemble(self, a: np.ndarray, b: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        sp = self.special
        n_a = len(a)
        total = n_a + 2 + (len(b) + 1 if b is not None else 0)
        ids = np.empty(total, dtype=np.int64)
        types = np.zeros(total, dtype=np.int64)
        ids[0], ids[1: n_a + 1], ids[n_a + 1] = sp.cls, a, sp.sep
        if b is not None:
            ids[n_a + 2: total - 1], ids[total - 1] = b, sp.sep
            types[n_a + 2:] = 1
        return ids, types

    def _mask(self, rng, ids: np.ndarray) -> np.ndarray:
        """Dynamic 80/10/10 masking in place; returns the labels.

        With whole-word masking, a word's continuation pieces (``##...``) are chosen
        together with its first piece, until the token budget is reached.
        """
        # Method forms (a.nonzero(), a.argpartition()) and a copied constant instead of
        # np.flatnonzero / np.argpartition / np.full_like: the same results without the
        # Python-level wrappers, which cost a few microseconds per sample.
        sp = self.special
        candidates = ((ids != sp.cls) & (ids != sp.sep)).nonzero()[0]
        labels = self._no_labels[: len(ids)].copy()
        if len(candidates) == 0:
            return labels
        budget = min(len(candidates), max(1, int(round(len(candidates) * self.cfg.mask_rate))))
        if self.continuation is None:
            chosen = candidates[rng.random(len(candidates)).argpartition(budget - 1)[:budget]]
        else:
            chosen = self._whole_words(rng, ids, candidates, budget)
        labels[chosen] = ids[chosen]
        action = rng.random(len(chosen))
        ids[chosen[action < 0.8]] = sp.mask
        swap = chosen[(action >= 0.8) & (action < 0.9)]
        if len(swap):  # the sample's last draw: skipping an empty one changes nothing
            ids[swap] = self._random_tokens(rng, len(swap))
        return labels

    def _random_tokens(self, rng, n: int) -> np.ndarray:
        """``n`` random replacement ids (module docstring)."""
        if self._skipped is None:
            return rng.integers(self.special.first_regular, self.vocab_size, size=n)
        drawn = rng.integers(0, self.vocab_size - len(self._skipped), size=n)
        return drawn + self._skipped.searchsorted(drawn, side="right")

    def _whole_words(self, rng, ids: np.ndarray, candidates: np.ndarray, budget: int) -> np.ndarray:
        # A word starts at a non-continuation piece, or right after [CLS]/[SEP] (a segment
        # cut by truncation may open mid-word).
        follows_special = np.ones(len(candidates), dtype=bool)
        follows_special[1:] = candidates[1:] != candidates[:-1] + 1
        starts = candidates[~self.continuation[ids[candidates]] | follows_special]  # (W,)
        word_of = np.searchsorted(starts, candidates, side="right") - 1  # (C,) word index per candidate
        order = rng.permutation(len(starts))
        sizes = np.bincount(word_of[word_of >= 0], minlength=len(starts))[order]
        take = order[: max(1, int(np.searchsorted(np.cumsum(sizes), budget, side="right")))]
        return candidates[np.isin(word_of, take)]


def token_files_allowed() -> int:
    """Token files a drawing process keeps open: a quarter of its open-file limit (256 under the
    common 1,024), at least 64; the rest is left to torch, the loader's pipes and the caller."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else max(64, soft // OPEN_FILES_SHARE)


def _open_corpus(folders: list[Path]) -> tuple[Manifest, list[ShardReader], list[tuple[str, int]]]:
    """Open every folder of a corpus with :func:`open_dataset`'s checks: (the first folder's
    manifest, every shard's reader, every shard's token file and token count), shards in folder
    order. The paths are strings made once: a process drawing from more shards than it keeps
    open reopens a token file for most samples, and building a ``Path`` there costs more than
    the open itself."""
    manifest, readers, shards = None, [], []
    for folder in folders:
        m, opened = open_dataset(folder)
        if manifest is None:
            manifest = m
        elif m.tokenizer_fingerprint != manifest.tokenizer_fingerprint:
            raise ShardError(_another_tokenizer(folder, folders[0], "corpus"))
        readers += opened
        shards += [(str(folder / f"{info.name}.bin"), info.num_tokens) for info in m.shards]
    return manifest, readers, shards


def _continuation_table(path: Path, vocab_size: int) -> np.ndarray:
    """(V,) bool: True for WordPiece continuation tokens (``##...``), from the dataset's vocab.txt."""
    table = np.zeros(vocab_size, dtype=bool)
    lines = (path / "vocab.txt").read_text(encoding="utf-8").split("\n")
    for i, token in enumerate(lines[:vocab_size]):
        table[i] = token.startswith("##")
    return table


def _truncate_pair(rng, a: np.ndarray, b: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """BERT's truncation: trim the longer segment, from a random end, one token at a time."""
    excess = len(a) + len(b) - max_tokens
    if excess <= 0:
        return a, b
    from_front = rng.random(excess) < 0.5
    a_lo, a_hi, b_lo, b_hi = 0, len(a), 0, len(b)
    for front in from_front.tolist():
        if a_hi - a_lo > b_hi - b_lo:
            if front:
                a_lo += 1
            else:
                a_hi -= 1
        elif front:
            b_lo += 1
        else:
            b_hi -= 1
    return a[a_lo:a_hi], b[b_lo:b_hi]


class BlendedDataset(Dataset):
    """Several datasets mixed by weight into one stream of positions.

    Positions come in blocks of ``BLOCK``; in every block dataset i owns ``n_i``
    positions (the largest-remainder rounding of ``w_i * BLOCK``), placed by a
    permutation seeded with (seed, block). Dataset i's k-th position overall is its
    own stream position k, so each component keeps its own epochs and its samples stay
    pure functions of (seed, epoch, index); the blend adds no state to checkpoint.
    """

    BLOCK = 4096

    def __init__(self, datasets: list[PretrainingDataset], weights: list[float], seed: int):
        if len(datasets) != len(weights) or not datasets:
            raise ShardError(f"{len(datasets)} datasets but {len(weights)} weights")
        first = datasets[0]
        for ds in datasets[1:]:
            if ds.manifest.tokenizer_fingerprint != first.manifest.tokenizer_fingerprint:
                raise ShardError(_another_tokenizer(ds.path, first.path, "blend"))
        w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        raw = w * self.BLOCK
        counts = np.floor(raw).astype(np.int64)
        counts[np.argsort(counts - raw)[: self.BLOCK - counts.sum()]] += 1  # largest remainders
        if (counts == 0).any():
            raise ShardError(f"a blend weight is below 1/{self.BLOCK} of the total: {weights}")
        self.datasets, self.counts, self.seed = datasets, counts, seed
        self.path, self.manifest, self.special, self.cfg = first.path, first.manifest, first.special, first.cfg
        self.vocab_size = first.vocab_size
        self.num_samples = int(sum(ds.num_samples for ds in datasets))
        self._block_id, self._owner, self._rank = -1, np.empty(0, np.int64), np.empty(0, np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        if b != self._block_id:
            owner = np.repeat(np.arange(len(self.counts)), self.counts)
            np.random.default_rng([self.seed, _PERMUTATION_STREAM, 2, b]).shuffle(owner)
            rank = np.empty_like(owner)
            for i in range(len(self.counts)):
                rank[owner == i] = np.arange(self.counts[i])
            self._block_id, self._owner, self._rank = b, owner, rank
        return self._owner, self._rank

    def _locate(self, position: int) -> tuple[int, int]:
        """(the dataset that owns ``position``, its own stream position there)."""
        b, offset = divmod(int(position), self.BLOCK)
        owner, rank = self._block(b)
        i = int(owner[offset])
        return i, b * int(self.counts[i]) + int(rank[offset])

    def __getitem__(self, position: int) -> dict[str, np.ndarray | int]:
        i, own = self._locate(position)
        return self.datasets[i][own]

    def lengths(self, lo: int, hi: int) -> list[int]:
        """:meth:`PretrainingDataset.lengths` of the blend's positions ``[lo, hi)``."""
        return [self.datasets[i].lengths(own, own + 1)[0] for i, own in map(self._locate, range(lo, hi))]


def open_pretraining_data(cfg: DataConfig, seed: int) -> tuple[Dataset, PretrainingDataset | None]:
    """The training stream and the held-out dataset, per ``cfg``.

    Without ``cfg.weights`` every folder of ``cfg.train`` (dataset folders and parents of
    partitions alike) is one corpus; with weights, each is a corpus of its own, blended by weight.
    Held out: ``cfg.val`` when given; else, with ``cfg.held_out > 0``, that share of the
    corpus's documents (with weights, of the first corpus's), which training skips; else none.
    """
    split = "train" if cfg.held_out > 0 and cfg.val is None else "all"
    if cfg.weights is None:
        stream = first = PretrainingDataset(cfg.train, cfg, seed, split=split)
    else:
        train = [PretrainingDataset(path, cfg, seed, split=split) for path in cfg.train]
        stream, first = (train[0] if len(train) == 1 else BlendedDataset(train, cfg.weights, seed)), train[0]
    if cfg.val is not None:
        val = PretrainingDataset(cfg.val, cfg, seed)
    elif cfg.held_out > 0:
        val = PretrainingDataset(first.folders, cfg, seed, split="held_out")
    else:
        return stream, None
    if val.manifest.tokenizer_fingerprint != first.manifest.tokenizer_fingerprint:
        raise ShardError(_another_tokenizer(val.path, first.path, "held-out"))
    return stream, val


_SHARE_ONE = {"corpus": "; the folders of one corpus must share one (corpora of different tokenizers cannot be "
                        "trained together)",
              "blend": "; blended datasets must share one", "held-out": ""}


def _another_tokenizer(path: Path, first: Path, role: str) -> str:
    return f"{path}: built with another tokenizer than {first}{_SHARE_ONE[role]}"


def check_tokenizers(cfg: DataConfig) -> None:
    """:func:`open_pretraining_data`'s tokenizer checks from the manifests alone (no shard
    opened, no sample map built), so that a command refuses such data before it starts."""
    def fingerprint(folder: Path) -> str:
        return Manifest.load(folder).tokenizer_fingerprint

    entries = [Path(p) for p in ([cfg.train] if isinstance(cfg.train, (str, Path)) else cfg.train)]
    folders = [dataset_folders(p) for p in entries]
    first = fingerprint(folders[0][0])
    if cfg.weights is None:
        for folder in (f for group in folders for f in group):
            if fingerprint(folder) != first:
                raise ShardError(_another_tokenizer(folder, folders[0][0], "corpus"))
    else:
        for entry, group in zip(entries[1:], folders[1:], strict=True):
            if fingerprint(group[0]) != first:
                raise ShardError(_another_tokenizer(entry, entries[0], "blend"))
    if cfg.val is not None and fingerprint(dataset_folders(cfg.val)[0]) != first:
        raise ShardError(_another_tokenizer(Path(cfg.val), entries[0], "held-out"))


def collate(samples: list[dict[str, np.ndarray | int]], pad_id: int) -> Batch:
    """Pad to the longest sample.

    Returns (B, S) int64 ``input_ids``, ``token_type_ids``, ``attention_mask``, ``labels``,
    (B,) ``next_sentence_label`` (when every sample has one), and the unpadded layout's
    fields (:meth:`bert_ds.model.padding.Unpadded.batch_fields`; ``max_seqlen`` a host int).
    """
    width = max(len(s["input_ids"]) for s in samples)
    batch = len(samples)
    ids = np.full((batch, width), pad_id, dtype=np.int64)
    types = np.zeros((batch, width), dtype=np.int64)
    mask = np.zeros((batch, width), dtype=np.int64)
    labels = np.full((batch, width), IGNORE_INDEX, dtype=np.int64)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n] = s["input_ids"]
        types[i, :n] = s["token_type_ids"]
        mask[i, :n] = 1
        labels[i, :n] = s["labels"]
    out = {
        "input_ids": torch.from_numpy(ids),
        "token_type_ids": torch.from_numpy(types),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(labels),
    }
    nsp = np.array([s["next_sentence_label"] for s in samples], dtype=np.int64)
    if (nsp >= 0).all():
        out["next_sentence_label"] = torch.from_numpy(nsp)
    out.update(unpad(out["attention_mask"], out["labels"]).batch_fields())
    return out


def to_device(batch: Batch, device: torch.device,
              non_blocking: bool = False) -> Batch:
    """The batch's tensors on ``device``; host values (``max_seqlen``) stay on the host."""
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def step_positions(plan: BatchPlan, rank: int, step_start: int, accum: int | None = None) -> list[list[int]]:
    """The stream positions of ``rank``'s micro-batches in the step that starts at ``step_start``
    and runs ``accum`` accumulation steps (default: the plan's).

    The optimizer step that starts at global position c covers [c, c + G), G its global batch;
    its micro-step m gives rank r the positions c + (m * W + r) * micro + [0, micro).
    """
    micro = plan.micro_batch_size
    accum = plan.grad_accum if accum is None else accum
    return [list(range(lo, lo + micro))
            for lo in (step_start + (m * plan.world_size + rank) * micro for m in range(accum))]


class TokenBudget:
    """Micro-batches filled to a token budget, packed greedily in the global stream's order.

    The step that starts at stream position c is ``K = accum x world_size`` micro-batches (accum:
    the step's accumulation steps, :meth:`BatchPlan.accum_at`),
    made one after another from c: each takes the next samples while their tokens ([CLS] and [SEP]
    included) fit ``budget = micro_batch_size x max_seq_length``, and the first sample that does
    not fit opens the next one (a sample is at most ``max_seq_length``, so each takes at least
    one). Micro-batch k goes to rank ``k mod W`` as its micro-step ``k // W``, where
    :func:`step_positions` puts fixed-size ones; the step ends where micro-batch K - 1 does, and
    the next starts there.

    Ranks split a step's budget by greedy global packing, then assignment: every rank packs the
    whole step (one map row read per sample of the step, W times its own share; it draws and
    masks only its own), so ranks agree without communicating, and the only state is the step's
    start, the loader's ``consumed_samples``. The packing depends on K and the budget alone, so
    with the same global and micro batch sizes a step holds the same micro-batches on any world
    size: a resume on another world size continues the same stream, step for step. The cost: a
    rank reads W times the map rows it needs (~2 us each on the development machine, a few ms per
    step of thousands of samples, in the process that feeds the loader), and rows are padded to
    the micro-batch's longest sample (the model unpads). Per rank each step's packing is kept
    (the last few) so the loader's sampler and ``next_step`` compute it once.
    """

    _KEEP = 16  # steps whose packing is kept: the sampler runs ahead of next_step by a few
    _BLOCK = 256  # lengths read at a time

    def __init__(self, dataset: PretrainingDataset | BlendedDataset, plan: BatchPlan, max_seq_length: int):
        self.dataset, self.plan = dataset, plan
        self.budget = plan.micro_batch_size * max_seq_length
        self._steps: dict[tuple[int, int], list[range]] = {}

    def step(self, start: int, accum: int) -> list[range]:
        """The K = ``accum`` x world_size micro-batches (ranges of stream positions, consecutive
        from ``start``) of the step that starts at ``start``."""
        key = (start, accum)
        if key not in self._steps:
            if len(self._steps) >= self._KEEP:
                del self._steps[next(iter(self._steps))]
            self._steps[key] = self._pack(start, accum * self.plan.world_size)
        return self._steps[key]

    def _pack(self, start: int, micro_batches: int) -> list[range]:
        batches: list[range] = []
        lo = pos = start
        used, lengths, at = 0, [], start  # lengths[i]: the sample at position at + i
        while len(batches) < micro_batches:
            if pos - at >= len(lengths):
                at, lengths = pos, self.dataset.lengths(pos, pos + self._BLOCK)
            n = lengths[pos - at]
            if used + n > self.budget:
                batches.append(range(lo, pos))
                lo, used = pos, 0
                continue
            used += n
            pos += 1
        return batches

    def end(self, start: int, accum: int) -> int:
        """Where the next step starts."""
        return self.step(start, accum)[-1].stop

    def rank_positions(self, start: int, accum: int, rank: int) -> list[list[int]]:
        """``rank``'s micro-batches of the step that starts at ``start``."""
        return [list(r) for r in self.step(start, accum)[rank:: self.plan.world_size]]


class _RankPositions:
    """Batch sampler: this rank's stream positions, one micro-batch at a time, from the step
    after ``steps_done`` that starts at stream position ``consumed``."""

    def __init__(self, plan: BatchPlan, rank: int, consumed: int, steps_done: int = 0,
                 packer: TokenBudget | None = None):
        self.plan, self.rank, self.consumed, self.steps_done, self.packer = plan, rank, consumed, steps_done, packer

    def __iter__(self) -> Iterator[list[int]]:
        step_start, step = self.consumed, self.steps_done + 1
        while True:
            accum = self.plan.accum_at(step)
            if self.packer is None:
                yield from step_positions(self.plan, self.rank, step_start, accum)
                step_start += self.plan.batch_at(step)
            else:
                yield from self.packer.rank_positions(step_start, accum, self.rank)
                step_start = self.packer.end(step_start, accum)
            step += 1


class PretrainingLoader:
    """Micro-batches for one rank, resumable from a consumed-sample count and the steps taken
    (which set a step's accumulation steps under a batch-size warm-up)."""

    def __init__(self, dataset: PretrainingDataset | BlendedDataset, plan: BatchPlan, rank: int, consumed_samples: int = 0,
                 num_workers: int = 0, pin_memory: bool = False):
        self.dataset, self.plan, self.rank = dataset, plan, rank
        self.consumed_samples = consumed_samples
        self.steps = 0  # optimizer steps taken
        self.num_workers = num_workers
        # Page-locked batches let the host-to-GPU copy run asynchronously (non_blocking=True);
        # from pageable memory that copy blocks the host until it is done.
        self.pin_memory = pin_memory
        self._iter: Iterator[Batch] | None = None
        budget = isinstance(dataset, (PretrainingDataset, BlendedDataset)) and dataset.cfg.token_budget
        self.packer = TokenBudget(dataset, plan, dataset.cfg.max_seq_length) if budget else None

    def _make_iter(self) -> Iterator[Batch]:
        pad = self.dataset.special.pad
        if self.num_workers:
            end_loader_workers_at_exit()  # the workers ignore SIGTERM: see there
        loader = DataLoader(
            self.dataset,
            batch_sampler=_RankPositions(self.plan, self.rank, self.consumed_samples, self.steps, self.packer),
            collate_fn=lambda samples: collate(samples, pad),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            # The loader draws a base seed when an iterator starts; its own generator keeps that
            # draw off the global RNG, which drives dropout and must resume exactly.
            generator=torch.Generator().manual_seed(self.dataset.seed),
            persistent_workers=False,
            worker_init_fn=loader_worker_init,  # a stop signal is the trainer's to handle
            prefetch_factor=4 if self.num_workers else None,
        )
        return iter(loader)

    def next_step(self) -> list[Batch]:
        """The micro-batches of the next optimizer step for this rank (``plan.accum_at`` it)."""
        if self._iter is None:
            self._iter = self._make_iter()
        step = self.steps + 1
        accum = self.plan.accum_at(step)
        try:
            batches = [next(self._iter) for _ in range(accum)]
        except ShardError as e:
            raise ShardError(_worker_message(e)) from None
        if self.packer is None:
            self.consumed_samples += self.plan.batch_at(step)
        else:
            self.consumed_samples = self.packer.end(self.consumed_samples, accum)
        self.steps = step
        return batches

    def step_positions(self, step: int, step_start: int) -> list[list[int]]:
        """This rank's stream positions, per micro-batch, in step ``step`` (1-based), which starts
        at ``step_start``."""
        accum = self.plan.accum_at(step)
        if self.packer is None:
            return step_positions(self.plan, self.rank, step_start, accum)
        return self.packer.rank_positions(step_start, accum, self.rank)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "steps": self.steps, "seed": self.dataset.seed,
                "epoch_samples": self.dataset.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.dataset.seed or state["epoch_samples"] != self.dataset.num_samples:
            raise ShardError(
                f"{self.dataset.path}: the checkpoint's data cursor was made for another dataset or seed "
                f"(seed {state['seed']}, {state['epoch_samples']} samples/epoch; now seed {self.dataset.seed}, "
                f"{self.dataset.num_samples}); resume with the same data and seed"
            )
        self.consumed_samples = int(state["consumed_samples"])
        # A checkpoint from before batch-size warm-ups has no step count; its plan had none, and
        # without one every step is alike
        self.steps = int(state.get("steps", 0))
        self._iter = None


def _worker_message(err: ShardError) -> str:
    """The one-line message of an error raised in a loader worker.

    DataLoader re-raises a worker's exception in the main process as the same class, with
    the worker's whole traceback as its message; the original message is that traceback's
    last line, after the class name.
    """
    text = str(err)
    if "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def validation_batches(dataset: PretrainingDataset, samples: int, micro_batch: int, rank: int,
                       world_size: int) -> Iterator[Batch]:
    """A fixed held-out set (epoch 0's first positions), the same number of batches on every rank."""
    per_round = micro_batch * world_size
    rounds = -(-samples // per_round)
    pad = dataset.special.pad
    for b in range(rounds):
        lo = (b * world_size + rank) * micro_batch
        yield collate([dataset[p % dataset.num_samples] for p in range(lo, lo + micro_batch)], pad)


__all__ = ["IGNORE_INDEX", "Batch", "step_positions", "BlendedDataset", "TokenBudget", "open_pretraining_data", "PretrainingDataset",
           "PretrainingLoader", "SpecialTokens", "collate", "to_device", "validation_batches"]
