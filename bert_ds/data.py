"""Pretraining samples built at load time from memory-mapped token shards.

Design choices:
- Shards store sentences and document boundaries, not samples. A *sample map*
  (document, first and last sentence, target length) is built once per dataset and
  seed with BERT's chunking rule (fill up to the target length, a shorter random
  target with ``short_seq_prob``); everything random after that (the A/B split,
  the random next segment, truncation, masking) is drawn at load time.
- Every sample is a pure function of ``(seed, epoch, sample index)``: its generator
  is seeded with exactly that triple. So the same sample comes out whatever the
  world size, loader worker count or resume point, and masks change every epoch.
- The global order is one permutation per epoch. Training consumes one global
  stream of positions; a rank takes its slice of each micro-step. The only state
  to checkpoint is the number of consumed samples, and resuming on another world
  size continues the same stream.
- Batches are padded to the longest sample of the micro-batch; the model unpads
  once, so padding costs only the copy. Labels follow Hugging Face: -100 where a
  token is not a prediction target, ``next_sentence_label`` 0 = true next.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bert_ds.config import BatchPlan, DataConfig
from data_tools.errors import ShardError
from data_tools.manifest import open_dataset
from data_tools.shard_format import ShardReader

IGNORE_INDEX = -100  # label of tokens that are not MLM targets (PyTorch / HF convention)
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


def build_sample_map(readers: list[ShardReader], max_num_tokens: int, short_seq_prob: float, seed: int) -> np.ndarray:
    """BERT's chunking of documents into samples.

    Returns an int64 array (N, 5): shard, document, first sentence, end sentence
    (exclusive), target length. Documents of a single empty sentence produce nothing.
    """
    rng = np.random.default_rng([seed, _PERMUTATION_STREAM, 1])
    rows: list[tuple[int, int, int, int, int]] = []
    for s, reader in enumerate(readers):
        lengths = reader.sentence_lengths
        bounds = reader.doc_bounds
        for d in range(reader.num_docs):
            target = _draw_target(rng, max_num_tokens, short_seq_prob)
            start, filled = int(bounds[d]), 0
            end_doc = int(bounds[d + 1])
            for i in range(start, end_doc):
                filled += int(lengths[i])
                if i == end_doc - 1 or filled >= target:
                    if filled > 0:
                        rows.append((s, d, start, i + 1, target))
                    start, filled = i + 1, 0
                    target = _draw_target(rng, max_num_tokens, short_seq_prob)
    return np.asarray(rows, dtype=np.int64).reshape(-1, 5)


def _draw_target(rng: np.random.Generator, max_num_tokens: int, short_seq_prob: float) -> int:
    if rng.random() < short_seq_prob:
        return int(rng.integers(2, max_num_tokens + 1))
    return max_num_tokens


class PretrainingDataset(Dataset):
    """Map-style dataset indexed by *global stream position* (epochs unrolled).

    ``dataset[p]`` is sample ``perm_e[p % N]`` of epoch ``e = p // N``.
    """

    def __init__(self, path: str | Path, cfg: DataConfig, seed: int):
        self.path = Path(path)
        self.cfg = cfg
        self.seed = seed
        self.manifest, readers = open_dataset(self.path)
        self.vocab_size = self.manifest.vocab_size
        self.special = SpecialTokens(**self.manifest.special_tokens)
        reserve = 3 if cfg.pair_task != "none" else 2  # [CLS] A [SEP] (B [SEP])
        self.max_num_tokens = cfg.max_seq_length - reserve
        self.samples = build_sample_map(readers, self.max_num_tokens, cfg.short_seq_prob, seed)
        if len(self.samples) == 0:
            raise ShardError(f"{self.path}: the dataset has no non-empty documents")
        self.num_docs_per_shard = np.array([r.num_docs for r in readers], dtype=np.int64)
        self._readers: list[ShardReader] | None = readers
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    # Readers hold memory maps; loader workers reopen them instead of pickling data.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_readers"] = None
        return state

    @property
    def readers(self) -> list[ShardReader]:
        if self._readers is None:
            self._readers = open_dataset(self.path)[1]
        return self._readers

    @property
    def num_samples(self) -> int:
        """Samples in one epoch."""
        return len(self.samples)

    def __len__(self) -> int:
        return self.num_samples

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, _PERMUTATION_STREAM, 0, epoch])
            self._perm = rng.permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def __getitem__(self, position: int) -> dict[str, np.ndarray | int]:
        epoch, offset = divmod(int(position), self.num_samples)
        return self.sample(epoch, int(self.permutation(epoch)[offset]))

    def sample(self, epoch: int, index: int) -> dict[str, np.ndarray | int]:
        """Sample ``index`` of ``epoch``: a pure function of (seed, epoch, index)."""
        rng = np.random.default_rng([self.seed, epoch, index])
        shard, doc, first, end, target = (int(v) for v in self.samples[index])
        reader = self.readers[shard]
        sentences = [reader.sentence(i) for i in range(first, end)]
        task = self.cfg.pair_task
        if task == "none":
            a, b, label = np.concatenate(sentences)[: self.max_num_tokens], None, -1
        elif task == "nsp":
            a, b, label = self._nsp_pair(rng, sentences, shard, doc, target)
        else:
            a, b, label = self._sop_pair(rng, sentences)
        if b is not None:
            a, b = _truncate_pair(rng, a, b, self.max_num_tokens)
        ids, types = self._assemble(a, b)
        labels = self._mask(rng, ids)
        return {"input_ids": ids, "token_type_ids": types, "labels": labels, "next_sentence_label": label}

    def _nsp_pair(self, rng, sentences, shard: int, doc: int, target: int):
        n = len(sentences)
        split = int(rng.integers(1, n)) if n >= 2 else 1
        a = np.concatenate(sentences[:split])
        if n == 1 or rng.random() < 0.5:
            b = self._random_segment(rng, shard, doc, max(1, target - len(a)))
            return a, b, 1
        return a, np.concatenate(sentences[split:]), 0

    def _random_segment(self, rng, shard: int, doc: int, want: int) -> np.ndarray:
        """Sentences from a random start in another document, up to ``want`` tokens."""
        total_docs = int(self.num_docs_per_shard.sum())
        first_doc = np.concatenate([[0], np.cumsum(self.num_docs_per_shard)])
        this = int(first_doc[shard]) + doc
        for _ in range(10):  # a single-document corpus has no "other" document
            g = int(rng.integers(0, total_docs))
            if g != this or total_docs == 1:
                break
        s = int(np.searchsorted(first_doc, g, side="right") - 1)
        reader = self.readers[s]
        d = g - int(first_doc[s])
        lo, hi = int(reader.doc_bounds[d]), int(reader.doc_bounds[d + 1])
        pieces, have = [], 0
        for i in range(int(rng.integers(lo, hi)) if hi > lo else lo, hi):
            pieces.append(reader.sentence(i))
            have += len(pieces[-1])
            if have >= want:
                break
        out = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
        # An empty segment would make a degenerate pair; fall back to [UNK].
        return out if len(out) else np.array([self.special.unk])

    def _sop_pair(self, rng, sentences):
        """ALBERT's sentence-order prediction: label 1 when the two halves are swapped."""
        if len(sentences) >= 2:
            split = int(rng.integers(1, len(sentences)))
            a, b = np.concatenate(sentences[:split]), np.concatenate(sentences[split:])
        else:
            tokens = sentences[0]
            split = int(rng.integers(1, len(tokens))) if len(tokens) >= 2 else 1
            a, b = tokens[:split], tokens[split:]
            if len(b) == 0:
                b = np.array([self.special.unk])
        if rng.random() < 0.5:
            return b, a, 1
        return a, b, 0

    def _assemble(self, a: np.ndarray, b: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        sp = self.special
        parts = [[sp.cls], a, [sp.sep]]
        types = [np.zeros(len(a) + 2, dtype=np.int64)]
        if b is not None:
            parts += [b, [sp.sep]]
            types.append(np.ones(len(b) + 1, dtype=np.int64))
        return np.concatenate(parts).astype(np.int64), np.concatenate(types)

    def _mask(self, rng, ids: np.ndarray) -> np.ndarray:
        """Dynamic 80/10/10 masking in place; returns the labels."""
        sp = self.special
        candidates = np.flatnonzero((ids != sp.cls) & (ids != sp.sep))
        labels = np.full_like(ids, IGNORE_INDEX)
        if len(candidates) == 0:
            return labels
        n = min(len(candidates), max(1, int(round(len(candidates) * self.cfg.mask_rate))))
        chosen = np.sort(rng.choice(candidates, size=n, replace=False))
        labels[chosen] = ids[chosen]
        action = rng.random(n)
        ids[chosen[action < 0.8]] = sp.mask
        swap = chosen[(action >= 0.8) & (action < 0.9)]
        ids[swap] = rng.integers(sp.first_regular, self.vocab_size, size=len(swap))
        return labels


def _truncate_pair(rng, a: np.ndarray, b: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """BERT's truncation: trim the longer segment, from a random end, one token at a time."""
    a_lo, a_hi, b_lo, b_hi = 0, len(a), 0, len(b)
    while (a_hi - a_lo) + (b_hi - b_lo) > max_tokens:
        if a_hi - a_lo > b_hi - b_lo:
            if rng.random() < 0.5:
                a_lo += 1
            else:
                a_hi -= 1
        elif rng.random() < 0.5:
            b_lo += 1
        else:
            b_hi -= 1
    return a[a_lo:a_hi], b[b_lo:b_hi]


def collate(samples: list[dict[str, np.ndarray | int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest sample. Returns (B, S) int64 tensors and (B,) NSP labels."""
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
    return out


class _RankPositions:
    """Batch sampler: this rank's stream positions, one micro-batch at a time.

    The optimizer step that starts at global position c covers [c, c + G); its
    micro-step m gives rank r the positions c + (m * W + r) * micro + [0, micro).
    """

    def __init__(self, plan: BatchPlan, rank: int, consumed: int):
        self.plan, self.rank, self.consumed = plan, rank, consumed

    def __iter__(self) -> Iterator[list[int]]:
        p, micro = self.plan, self.plan.micro_batch_size
        step_start = self.consumed
        while True:
            for m in range(p.grad_accum):
                lo = step_start + (m * p.world_size + self.rank) * micro
                yield list(range(lo, lo + micro))
            step_start += p.global_batch_size


class PretrainingLoader:
    """Micro-batches for one rank, resumable from a consumed-sample count."""

    def __init__(self, dataset: PretrainingDataset, plan: BatchPlan, rank: int, consumed_samples: int = 0,
                 num_workers: int = 0):
        self.dataset, self.plan, self.rank = dataset, plan, rank
        self.consumed_samples = consumed_samples
        self.num_workers = num_workers
        self._iter: Iterator[dict[str, torch.Tensor]] | None = None

    def _make_iter(self) -> Iterator[dict[str, torch.Tensor]]:
        pad = self.dataset.special.pad
        loader = DataLoader(
            self.dataset,
            batch_sampler=_RankPositions(self.plan, self.rank, self.consumed_samples),
            collate_fn=lambda samples: collate(samples, pad),
            num_workers=self.num_workers,
            # The loader draws a base seed when an iterator starts; its own generator keeps that
            # draw off the global RNG, which drives dropout and must resume exactly.
            generator=torch.Generator().manual_seed(self.dataset.seed),
            persistent_workers=False,
            prefetch_factor=4 if self.num_workers else None,
        )
        return iter(loader)

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """The grad_accum micro-batches of the next optimizer step for this rank."""
        if self._iter is None:
            self._iter = self._make_iter()
        batches = [next(self._iter) for _ in range(self.plan.grad_accum)]
        self.consumed_samples += self.plan.global_batch_size
        return batches

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "seed": self.dataset.seed,
                "epoch_samples": self.dataset.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.dataset.seed or state["epoch_samples"] != self.dataset.num_samples:
            raise ShardError(
                f"{self.dataset.path}: the checkpoint's data cursor was made for another dataset or seed "
                f"(seed {state['seed']}, {state['epoch_samples']} samples/epoch; now seed {self.dataset.seed}, "
                f"{self.dataset.num_samples}); resume with the same data and seed"
            )
        self.consumed_samples = int(state["consumed_samples"])
        self._iter = None


def validation_batches(dataset: PretrainingDataset, samples: int, micro_batch: int, rank: int,
                       world_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """A fixed held-out set (epoch 0's first positions), the same number of batches on every rank."""
    per_round = micro_batch * world_size
    rounds = -(-samples // per_round)
    pad = dataset.special.pad
    for b in range(rounds):
        lo = (b * world_size + rank) * micro_batch
        yield collate([dataset[p % dataset.num_samples] for p in range(lo, lo + micro_batch)], pad)


__all__ = ["IGNORE_INDEX", "PretrainingDataset", "PretrainingLoader", "SpecialTokens",
           "build_sample_map", "collate", "validation_batches"]
