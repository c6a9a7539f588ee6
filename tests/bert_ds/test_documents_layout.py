"""The documents layout ([CLS] document [SEP], a long one in consecutive pieces) and micro-batches
filled to a token budget, on a BPE dataset whose special tokens sit at the end of its vocabulary
(as ModernBERT's do): sample shapes, masking, packing, every sample once per epoch, exact resume
on 1 and 2 ranks, and the refusals."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from bert_ds.base.errors import ConfigError, ShardError
from bert_ds.config import BatchPlan, DataConfig
from bert_ds.data_tools.__main__ import main as data_tools
from bert_ds.data_tools.manifest import open_dataset
from bert_ds.loader.pretraining import (
    IGNORE_INDEX, BlendedDataset, PretrainingDataset, PretrainingLoader, TokenBudget, collate,
)
from bert_ds.loader.sample_map import COUNT_BITS, COUNT_MASK, build_document_map

SAMPLE = Path(__file__).resolve().parents[2] / "data_tools" / "sample" / "valid.txt"
SPECIALS = {"unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]"}
SEQ = 128


def _documents() -> list[list[str]]:
    """80 documents of 1 to 6 lines, each a sentence of the sample text: from a few tokens to
    several sequences."""
    text = SAMPLE.read_text(encoding="utf-8")
    sentences = [s.strip() + " ." for line in text.splitlines() if line.strip() and not line.startswith(" =")
                 for s in line.split(" . ") if s.strip()]
    rng = random.Random(5)
    return [[rng.choice(sentences) for _ in range(rng.randint(1, 6))] for _ in range(80)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A BPE dataset: specials added after the merges, at ids 400-404 of 405."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("documents")
    docs = _documents()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([line for d in docs for line in d], trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(list(SPECIALS.values()))
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({f"{k}_token": v for k, v in SPECIALS.items()}))
    (root / "in.txt").write_text("\n\n".join("\n".join(d) for d in docs) + "\n", encoding="utf-8")
    assert data_tools(["build", "--input", str(root / "in.txt"), "--output", str(root / "ds"), "--tokenizer",
                       str(root / "tok"), "--workers", "1", "--no-progress", "--shard-tokens", "4000"]) == 0
    return root / "ds"


def _cfg(corpus: Path, **kw) -> DataConfig:
    return DataConfig(**{"train": str(corpus), "layout": "documents", "pair_task": "none", "max_seq_length": SEQ,
                         "mask_rate": 0.3, **kw})


@pytest.fixture(scope="module")
def dataset(corpus) -> PretrainingDataset:
    return PretrainingDataset(str(corpus), _cfg(corpus, token_budget=True), seed=11)


def _tokens(sample: dict) -> list[int]:
    """A sample's tokens as read from the shards, without [CLS] and [SEP] (a masked one is its label)."""
    return np.where(sample["labels"] != IGNORE_INDEX, sample["labels"], sample["input_ids"])[1:-1].tolist()


def test_document_map_cuts_each_document_into_consecutive_pieces(corpus):
    _, readers = open_dataset(corpus)
    assert len(readers) > 1  # documents in several shards
    piece = SEQ - 2
    want, base = [], 0
    for r in readers:  # a plain reference: each document from its first token, piece after piece
        for d in range(r.num_docs):
            lo, hi = int(r.sentence_offsets[r.doc_bounds[d]]), int(r.sentence_offsets[r.doc_bounds[d + 1]])
            want += [(base + s, min(piece, hi - s)) for s in range(lo, hi, piece)]
        base += r.num_tokens
    rows = build_document_map(readers, piece)
    assert [(int(x) >> COUNT_BITS, int(x) & COUNT_MASK) for x in rows] == want
    assert sum(n for _, n in want) == base  # every token once


def test_samples_are_whole_documents_in_pieces(dataset, corpus):
    sp, n = dataset.special, len(dataset)
    samples = [dataset.sample(0, i) for i in range(n)]  # index order is corpus order
    for s in samples:
        ids = s["input_ids"]
        assert ids[0] == sp.cls and ids[-1] == sp.sep and 3 <= len(ids) <= SEQ
        assert not (s["token_type_ids"]).any() and s["next_sentence_label"] == -1
    documents = [np.concatenate(r.document(d)).tolist() for r in open_dataset(corpus)[1] for d in range(r.num_docs)]
    pieces, i = [], 0
    for doc in documents:  # each document is its pieces, in order, all but the last of SEQ - 2 tokens
        k = -(-len(doc) // (SEQ - 2))
        got = [_tokens(s) for s in samples[i: i + k]]
        assert sum(got, []) == doc and all(len(p) == SEQ - 2 for p in got[:-1])
        pieces += got
        i += k
    assert i == n and any(len(d) > SEQ for d in documents) and any(len(d) < SEQ - 2 for d in documents)
    batch = collate(samples[:4], sp.pad)
    assert "next_sentence_label" not in batch and not batch["token_type_ids"].any()


def test_masking_at_30_percent_with_80_10_10_and_random_tokens_that_are_not_special(dataset):
    sp = dataset.special
    special = {sp.pad, sp.unk, sp.cls, sp.sep, sp.mask}
    assert min(special) == 400 and dataset.vocab_size == 405  # BERT's rule would draw from [405, 405)
    masked = candidates = as_mask = kept = 0
    randoms = []
    for i in range(len(dataset)):
        s = dataset.sample(1, i)
        t = s["labels"] != IGNORE_INDEX
        masked += t.sum()
        candidates += len(s["input_ids"]) - 2
        ids, labels = s["input_ids"][t], s["labels"][t]
        as_mask += (ids == sp.mask).sum()
        kept += (ids == labels).sum()
        randoms += ids[(ids != sp.mask) & (ids != labels)].tolist()
    assert 0.29 < masked / candidates < 0.31
    assert 0.77 < as_mask / masked < 0.83 and 0.08 < kept / masked < 0.12
    assert randoms and not special & set(randoms) and max(randoms) < 400


def _sums(batch) -> list[int]:
    return batch["attention_mask"].sum(dim=1).tolist()


def test_token_budget_fills_micro_batches_in_stream_order_and_covers_each_epoch_once(dataset):
    plan = BatchPlan.resolve(6, 2, 1)  # 3 micro-batches a step, 2 x 128 = 256 tokens each
    budget, n = 2 * SEQ, len(dataset)
    loader = PretrainingLoader(dataset, plan, 0)
    positions, sizes = [], []
    while loader.consumed_samples < 2 * n + 5:
        start = loader.consumed_samples
        ranges = loader.packer.step(start, plan.grad_accum)
        batches = loader.next_step()
        assert ranges[0].start == start and loader.consumed_samples == ranges[-1].stop
        for r, nxt, batch in zip(ranges, ranges[1:] + [None], batches, strict=True):
            lengths = dataset.lengths(r.start, r.stop + 1)
            assert _sums(batch) == lengths[:-1] and sum(lengths[:-1]) <= budget
            assert sum(lengths) > budget  # the next sample did not fit: it opens the next micro-batch
            assert nxt is None or nxt.start == r.stop
            positions += list(r)
            sizes.append(len(r))
    assert positions == list(range(len(positions)))  # no gap, no repeat, in stream order
    assert min(sizes) < max(sizes)  # a variable number of sequences
    for epoch in (0, 1):
        perm = dataset.permutation(epoch)
        assert sorted(perm(p - epoch * n) for p in positions[epoch * n: (epoch + 1) * n]) == list(range(n))


def _global(loader_per_rank: list[PretrainingLoader], steps: int) -> list[list[torch.Tensor]]:
    """Per step, every micro-batch's rows (ids of real tokens) in the step's micro-batch order."""
    world = len(loader_per_rank)
    out = []
    for _ in range(steps):
        per_rank = [ld.next_step() for ld in loader_per_rank]
        rows = []
        for m in range(len(per_rank[0])):
            for r in range(world):
                b = per_rank[r][m]
                rows.append([b["input_ids"][i][b["attention_mask"][i].bool()] for i in range(b["input_ids"].shape[0])])
        out.append(rows)
        assert len({ld.consumed_samples for ld in loader_per_rank}) == 1  # every rank agrees where the step ends
    return out


def _same(a, b) -> bool:
    """The same steps: micro-batch for micro-batch, row for row."""
    def rows(steps):
        return [(s, m, len(batch)) for s, step in enumerate(steps) for m, batch in enumerate(step)]

    return rows(a) == rows(b) and all(torch.equal(u, v) for x, y in zip(a, b) for mx, my in zip(x, y)
                                      for u, v in zip(mx, my, strict=True))


@pytest.mark.parametrize("resume_world,workers", [(1, 0), (2, 0), (1, 2)])
def test_resume_after_k_steps_continues_the_stream_exactly_on_any_world_size(dataset, resume_world, workers):
    gbs, micro, k, total = 8, 2, 3, 7
    uninterrupted = _global([PretrainingLoader(dataset, BatchPlan.resolve(gbs, micro, 2), r) for r in range(2)], total)
    first = [PretrainingLoader(dataset, BatchPlan.resolve(gbs, micro, 2), r) for r in range(2)]
    assert _same(_global(first, k), uninterrupted[:k])
    state = first[1].state_dict()
    assert state["consumed_samples"] not in (0, k * gbs)  # a count of samples, not of steps
    plan = BatchPlan.resolve(gbs, micro, resume_world)
    resumed = [PretrainingLoader(dataset, plan, r, num_workers=workers) for r in range(resume_world)]
    for ld in resumed:
        ld.load_state_dict(state)
    assert _same(_global(resumed, total - k), uninterrupted[k:])


def test_a_batch_warm_up_packs_each_step_to_its_own_count_and_resumes_exactly(dataset):
    plan = BatchPlan.resolve(8, 2, 2, warmup_steps=3, warmup_start=4)  # 1, 1, 1 then 2 micro-batches a rank
    uninterrupted = _global([PretrainingLoader(dataset, plan, r) for r in range(2)], 6)
    assert [len(step) for step in uninterrupted] == [2 * plan.accum_at(s) for s in range(1, 7)] == [2, 2, 2, 4, 4, 4]
    first = [PretrainingLoader(dataset, plan, r) for r in range(2)]
    _global(first, 2)
    resumed = [PretrainingLoader(dataset, plan, r) for r in range(2)]
    for ld in resumed:
        ld.load_state_dict(first[0].state_dict())
    assert _same(_global(resumed, 4), uninterrupted[2:])


def test_each_rank_logs_the_positions_it_trained_on(dataset):
    plan = BatchPlan.resolve(8, 2, 2)
    loaders = [PretrainingLoader(dataset, plan, r) for r in range(2)]
    start = loaders[0].consumed_samples
    seen = sorted(p for ld in loaders for b in ld.step_positions(1, start) for p in b)
    for ld in loaders:
        ld.next_step()
    assert seen == list(range(start, loaders[0].consumed_samples))


def test_a_blend_packs_by_its_components_lengths(corpus, dataset):
    other = PretrainingDataset(str(corpus), _cfg(corpus, token_budget=True, max_seq_length=32), seed=11)
    blend = BlendedDataset([dataset, other], [1, 1], seed=11)
    assert blend.lengths(0, 50) == [len(blend[p]["input_ids"]) for p in range(50)]
    packer = TokenBudget(blend, BatchPlan.resolve(4, 2, 1), SEQ)
    assert all(sum(blend.lengths(r.start, r.stop)) <= 2 * SEQ for r in packer.step(0, 2))


def test_refusals(corpus):
    with pytest.raises(ConfigError, match=r"^pair_task: nsp needs sentence pairs.*--pair-task none"):
        DataConfig(train=str(corpus), layout="documents")
    with pytest.raises(ConfigError, match=r"^pair_task: sop needs sentence pairs"):
        DataConfig(train=str(corpus), layout="documents", pair_task="sop")
    with pytest.raises(ConfigError, match=r"^token_budget: needs layout documents"):
        DataConfig(train=str(corpus), token_budget=True)
    with pytest.raises(ShardError, match="whole_word_mask .* needs a WordPiece vocabulary"):
        PretrainingDataset(str(corpus), _cfg(corpus, whole_word_mask=True), seed=1)


def test_the_train_command_refuses_the_documents_layout_with_a_pair_task_in_one_line(corpus, tmp_path):
    from tests.conftest import run_cli

    proc = run_cli("bert_ds.train", "--data", str(corpus), "--output", str(tmp_path / "run"), "--steps", "1",
                   "--layout", "documents", check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err == [
        "error: pair_task: nsp needs sentence pairs, which the documents layout has none of: set pair_task none "
        "(--pair-task none)"], proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_training_saved_on_2_ranks_resumes_on_1_with_the_same_stream_and_losses(corpus, tmp_path):
    """R8 for token-budget batches, through the trainer: the checkpoint's cursor, --log-samples."""
    from bert_ds.train.sample_log import consumed_positions
    from tests.conftest import run_cli

    common = ["bert_ds.train", "--data", str(corpus), "--layout", "documents", "--pair-task", "none",
              "--token-budget", "--mask-rate", "0.3", "--preset", "tiny", "--steps", "6", "--seq-len", str(SEQ),
              "--global-batch-size", "8", "--micro-batch-size", "2", "--no-progress", "--num-workers", "0",
              "--dropout", "0", "--no-tensorboard"]

    def losses(out: Path) -> list[float]:
        return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "loss" in r and "split" not in r]

    ref, run = tmp_path / "ref", tmp_path / "run"
    run_cli(*common, "--output", str(ref), "--log-samples", str(ref / "samples.jsonl"))
    run_cli(*common, "--output", str(run), "--log-samples", str(run / "samples.jsonl"), "--save-every", "3",
            "--exit-after", "3", nproc=2)
    run_cli(*common, "--output", str(run), "--log-samples", str(run / "samples.jsonl"))
    stream = consumed_positions(run / "samples.jsonl")
    assert stream == consumed_positions(ref / "samples.jsonl") == list(range(len(stream)))
    assert len(stream) != 6 * 8  # steps of a variable number of samples
    np.testing.assert_allclose(losses(run), losses(ref), rtol=1e-5)
