"""The load-time sample builder and the resumable loader, on real shards."""

import numpy as np
import pytest
import torch

from bert_ds.base.errors import ShardError
from bert_ds.config import BatchPlan, DataConfig
from bert_ds.data_tools.manifest import open_dataset
from bert_ds.loader.pretraining import IGNORE_INDEX, PretrainingDataset, PretrainingLoader, check_tokenizers, collate

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)


@pytest.fixture(scope="module")
def dataset(sample_data):
    return PretrainingDataset(sample_data["train"], DataConfig(train=str(sample_data["train"])), seed=7)


def _equal_samples(a, b):
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def test_sample_is_a_pure_function_of_seed_epoch_index(dataset, sample_data):
    again = PretrainingDataset(sample_data["train"], dataset.cfg, seed=7)
    for idx in (0, 5, len(dataset) - 1):
        assert _equal_samples(dataset.sample(0, idx), again.sample(0, idx))
    # masks change between epochs, the sample's text span does not
    a, b = dataset.sample(0, 3), dataset.sample(1, 3)
    assert not np.array_equal(a["labels"], b["labels"])


def test_samples_are_well_formed(dataset):
    sp = dataset.special
    nsp = []
    masked, candidates = 0, 0
    for idx in range(0, len(dataset), max(1, len(dataset) // 300)):
        s = dataset.sample(0, idx)
        ids, types, labels = s["input_ids"], s["token_type_ids"], s["labels"]
        assert len(ids) <= dataset.cfg.max_seq_length
        assert ids[0] == sp.cls and ids[-1] == sp.sep and (ids == sp.sep).sum() == 2
        first_sep = int(np.flatnonzero(ids == sp.sep)[0])
        assert (types[: first_sep + 1] == 0).all() and (types[first_sep + 1:] == 1).all()
        targets = labels != IGNORE_INDEX
        assert targets.any() and not targets[0] and not targets[first_sep] and not targets[-1]
        assert ((labels[targets] >= 0) & (labels[targets] < dataset.vocab_size)).all()
        masked += targets.sum()
        candidates += len(ids) - 3
        nsp.append(s["next_sentence_label"])
    assert 0.13 < masked / candidates < 0.17
    assert 0.35 < np.mean(nsp) < 0.65  # half the pairs are random next segments


def test_80_10_10_masking(dataset):
    mask_id = dataset.special.mask
    replaced = kept = total = 0
    for idx in range(400):
        s = dataset.sample(0, idx)
        t = s["labels"] != IGNORE_INDEX
        total += t.sum()
        replaced += (s["input_ids"][t] == mask_id).sum()
        kept += (s["input_ids"][t] == s["labels"][t]).sum()
    assert 0.75 < replaced / total < 0.85
    assert 0.07 < kept / total < 0.14  # 10% kept, plus random draws that hit the same token


def _stream(ds, plan, rank, consumed, steps, workers=0):
    loader = PretrainingLoader(ds, plan, rank, consumed_samples=consumed, num_workers=workers)
    return [loader.next_step() for _ in range(steps)], loader


def _global_steps(ds, gbs, micro, world, consumed, steps, workers=0):
    """Per step, the global batch as one (gbs, S) id tensor gathered in position order."""
    plan = BatchPlan.resolve(gbs, micro, world)
    per_rank = [_stream(ds, plan, r, consumed, steps, workers)[0] for r in range(world)]
    out = []
    for step in range(steps):
        rows = []
        for m in range(plan.grad_accum):
            for r in range(world):
                b = per_rank[r][step][m]
                rows += [b["input_ids"][i][b["attention_mask"][i].bool()] for i in range(micro)]
        out.append(rows)
    return out


def test_resume_on_another_world_size_and_worker_count_continues_the_same_stream(dataset):
    gbs, k, total = 8, 3, 7
    uninterrupted = _global_steps(dataset, gbs, micro=4, world=2, consumed=0, steps=total)
    # consume k steps on 2 ranks, save the cursor, resume on 1 rank with 2 workers
    plan = BatchPlan.resolve(gbs, 4, 2)
    _, loader = _stream(dataset, plan, 0, 0, k)
    state = loader.state_dict()
    resumed = PretrainingLoader(dataset, BatchPlan.resolve(gbs, 2, 1), 0, num_workers=2)
    resumed.load_state_dict(state)
    rest = []
    for _ in range(total - k):
        rows = []
        for b in resumed.next_step():
            rows += [b["input_ids"][i][b["attention_mask"][i].bool()] for i in range(b["input_ids"].shape[0])]
        rest.append(rows)
    for want, got in zip(uninterrupted[k:], rest):
        assert len(want) == len(got) == gbs
        assert all(torch.equal(x, y) for x, y in zip(want, got))


def test_ranks_partition_each_global_batch(dataset):
    plan = BatchPlan.resolve(12, 2, 3)
    from bert_ds.loader.pretraining import _RankPositions
    seen = []
    for r in range(3):
        it = iter(_RankPositions(plan, r, consumed=24))
        for _ in range(plan.grad_accum * 2):
            seen += next(it)
    assert sorted(seen) == list(range(24, 48))  # no duplicates, no gaps


def _rows(batches) -> list[torch.Tensor]:
    return [b["input_ids"][i][b["attention_mask"][i].bool()] for b in batches for i in range(b["input_ids"].shape[0])]


def test_a_batch_warm_up_draws_each_steps_batch_from_the_stream_and_resumes_exactly(dataset):
    # 2 ranks of micro-batches of 2: batches of 4, 4, 8, 8, 12, 12 sequences
    plan = BatchPlan.resolve(12, 2, 2, warmup_steps=4, warmup_start=4)
    loaders = [PretrainingLoader(dataset, plan, r) for r in range(2)]
    uninterrupted, state = [], None
    for step in range(1, 7):
        start = loaders[0].consumed_samples
        positions = sorted(p for ld in loaders for b in ld.step_positions(step, start) for p in b)
        per_rank = [ld.next_step() for ld in loaders]
        assert [len(b) for b in per_rank] == [plan.accum_at(step)] * 2
        assert positions == list(range(start, start + plan.batch_at(step))) == list(range(start, loaders[1].consumed_samples))
        uninterrupted.append([_rows(b) for b in per_rank])
        if step == 3:
            state = loaders[1].state_dict()
    assert [len(sum(step, [])) for step in uninterrupted] == [4, 4, 8, 8, 12, 12]
    resumed = [PretrainingLoader(dataset, plan, r) for r in range(2)]
    for ld in resumed:
        ld.load_state_dict(state)
    for want in uninterrupted[3:]:
        got = [_rows(ld.next_step()) for ld in resumed]
        assert all(torch.equal(x, y) for w, g in zip(want, got, strict=True) for x, y in zip(w, g, strict=True))


def test_cursor_from_another_dataset_is_refused(dataset):
    loader = PretrainingLoader(dataset, BatchPlan.resolve(4, 4, 1), 0)
    with pytest.raises(Exception, match="another dataset or seed"):
        loader.load_state_dict({"consumed_samples": 8, "seed": 99, "epoch_samples": len(dataset)})


def test_collate_pads_right_and_keeps_labels():
    samples = [
        {"input_ids": np.array([2, 5, 6, 3]), "token_type_ids": np.zeros(4, int), "labels": np.array([-100, 5, -100, -100]), "next_sentence_label": 0},
        {"input_ids": np.array([2, 7, 3]), "token_type_ids": np.zeros(3, int), "labels": np.array([-100, -100, -100]), "next_sentence_label": 1},
    ]
    b = collate(samples, pad_id=0)
    assert b["input_ids"].tolist() == [[2, 5, 6, 3], [2, 7, 3, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b["labels"][1, 3] == IGNORE_INDEX and b["next_sentence_label"].tolist() == [0, 1]


def _documents_of(ds):
    """{(shard, document)} of every sample of ``ds``, with the shards' own indexes."""
    _, readers = open_dataset(ds.path)
    found = set()
    for i in range(len(ds)):
        shard, first, _ = ds.chunk(i)
        found.add((shard, int(np.searchsorted(readers[shard].doc_bounds, first, side="right")) - 1))
    return found, readers


def _whole_map(ds):
    return ds._map[0:len(ds)]


def test_sample_map_covers_every_sentence_once(dataset):
    _, readers = open_dataset(dataset.path)
    covered = [np.zeros(r.num_sentences, dtype=int) for r in readers]
    for i in range(len(dataset)):
        shard, first, end = dataset.chunk(i)
        offsets, bounds = readers[shard].sentence_offsets, readers[shard].doc_bounds
        doc = int(np.searchsorted(bounds, first, side="right")) - 1
        assert bounds[doc] <= first < end <= bounds[doc + 1]
        covered[shard][first:end] += 1
        # a chunk closes as soon as it reaches its target, so without its last sentence it is short
        assert offsets[end - 1] - offsets[first] < dataset._targets.one(shard, first)
    assert all((c == 1).all() for c in covered)


def test_whole_word_masking_masks_all_pieces_of_a_word(sample_data):
    cfg = DataConfig(train=str(sample_data["train"]), whole_word_mask=True)
    ds = PretrainingDataset(sample_data["train"], cfg, seed=3)
    cont = ds.continuation
    assert cont.any()  # the sample vocabulary has ##pieces
    partial = 0
    for idx in range(300):
        s = ds.sample(0, idx)
        target = s["labels"] != IGNORE_INDEX
        original = np.where(target, s["labels"], s["input_ids"])
        special = np.isin(original, [ds.special.cls, ds.special.sep])
        for i in range(1, len(original)):
            if cont[original[i]] and not special[i - 1] and target[i] != target[i - 1]:
                partial += 1
    assert partial == 0


def test_held_out_split_is_disjoint_and_deterministic(sample_data):
    cfg = DataConfig(train=str(sample_data["train"]), held_out=0.2)
    train = PretrainingDataset(sample_data["train"], cfg, seed=1, split="train")
    held = PretrainingDataset(sample_data["train"], cfg, seed=1, split="held_out")
    (train_docs, readers), (held_docs, _) = _documents_of(train), _documents_of(held)
    assert train_docs and held_docs and not train_docs & held_docs
    assert len(train_docs | held_docs) == sum(r.num_docs for r in readers)
    again = PretrainingDataset(sample_data["train"], cfg, seed=1, split="held_out")
    assert np.array_equal(_whole_map(again), _whole_map(held))


def test_blend_follows_weights_and_each_part_keeps_its_own_stream(sample_data):
    from bert_ds.loader.pretraining import BlendedDataset

    a = PretrainingDataset(sample_data["train"], DataConfig(train=str(sample_data["train"])), seed=5)
    b = PretrainingDataset(sample_data["heldout"], DataConfig(train=str(sample_data["heldout"])), seed=5)
    blend = BlendedDataset([a, b], [3.0, 1.0], seed=5)
    owners = np.concatenate([blend._block(k)[0] for k in range(3)])
    assert abs(np.mean(owners == 0) - 0.75) < 1e-3
    # the k-th position owned by b is b's own stream position k
    positions_of_b = np.flatnonzero(owners == 1)[:5]
    for k, p in enumerate(positions_of_b):
        assert _equal_samples(blend[int(p)], b[k])


def test_several_folders_are_one_corpus_in_proportion_to_their_data(sample_data, tmp_path):
    """Folders given together without weights are one corpus: every sentence of each in exactly
    one sample of an epoch, the epoch's order drawing each folder as often as it holds samples."""
    from bert_ds.loader.pretraining import open_pretraining_data

    a_path, b_path = sample_data["train"], sample_data["heldout"]
    stream, _ = open_pretraining_data(DataConfig(train=[str(a_path), str(b_path)]), seed=5)
    assert isinstance(stream, PretrainingDataset) and stream.folders == [a_path, b_path]
    _, readers_a = open_dataset(a_path)
    _, readers_b = open_dataset(b_path)
    readers = readers_a + readers_b  # b's shards are numbered after a's
    covered = [np.zeros(r.num_sentences, dtype=int) for r in readers]
    for i in range(len(stream)):
        shard, first, end = stream.chunk(i)
        covered[shard][first:end] += 1
    assert all((c == 1).all() for c in covered)
    from_a = np.array([stream.chunk(i)[0] < len(readers_a) for i in range(len(stream))])
    share = from_a.mean()
    assert 0.2 < share < 0.8  # both folders hold a real part of the corpus (the sample's two files)
    order = stream.permutation(0)
    first_half = [from_a[order(p)] for p in range(len(stream) // 2)]
    assert abs(np.mean(first_half) - share) < 0.05
    # its samples are drawn from both folders' tokens, checked against the vocabulary as usual
    assert {stream[p]["input_ids"].max() < stream.vocab_size for p in range(0, len(stream), 97)} == {True}


def test_folders_of_other_tokenizers_are_refused_as_one_corpus(sample_data, tmp_path):
    from tests.conftest import SAMPLE, run_cli

    other = tmp_path / "other"
    run_cli("bert_ds.data_tools", "build", "--input", str(SAMPLE / "test.txt"), "--output", str(other),
            "--train-vocab", "1024", "--split-sentences", "--workers", "1")
    with pytest.raises(ShardError, match=f"^{other}: built with another tokenizer than {sample_data['train']}"):
        PretrainingDataset([sample_data["train"], other], DataConfig(train=[str(sample_data["train"])]), seed=1)
    # the same refusals from the manifests alone, as the train command makes them before it starts
    train = str(sample_data["train"])
    cases = [(DataConfig(train=[train, str(other)]), "; the folders of one corpus must share one"),
             (DataConfig(train=[train, str(other)], weights=[1.0, 1.0]), "; blended datasets must share one"),
             (DataConfig(train=[train], val=str(other)), "")]
    for cfg, tail in cases:
        with pytest.raises(ShardError) as refused:
            check_tokenizers(cfg)
        assert str(refused.value).startswith(f"{other}: built with another tokenizer than {train}{tail}")
    check_tokenizers(DataConfig(train=[train, str(sample_data["heldout"])]))  # one tokenizer: no error
    out = tmp_path / "run"
    proc = run_cli("bert_ds.train", "--data", train, str(other), "--output", str(out), "--steps", "1", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {other}: built with another tokenizer than {train}; the folders of one corpus must share one "
        "(corpora of different tokenizers cannot be trained together)"]
    assert not out.exists()  # refused before the run's folder is made


def test_sample_map_cache_is_rebuilt_when_a_shard_changes(sample_data, tmp_path):
    import shutil

    from bert_ds.loader.sample_map import _MAP_VERSION  # noqa: F401  (the cache format is versioned)

    copy = tmp_path / "data"
    shutil.copytree(sample_data["train"], copy, ignore=shutil.ignore_patterns(".cache"))
    cfg = DataConfig(train=str(copy))
    first = PretrainingDataset(copy, cfg, seed=0)
    cached = list((copy / ".cache").glob("samples-*.npy"))
    assert len(cached) == 1
    # rebuild the shards from different text under the same path: a new key, a new map
    from tests.conftest import SAMPLE, run_cli
    shutil.rmtree(copy)
    run_cli("bert_ds.data_tools", "build", "--input", str(SAMPLE / "test.txt"), "--output", str(copy),
            "--vocab", str(sample_data["train"] / "vocab.txt"), "--split-sentences", "--workers", "1")
    second = PretrainingDataset(copy, cfg, seed=0)
    assert not np.array_equal(_whole_map(first), _whole_map(second))
    assert len(list((copy / ".cache").glob("samples-*.npy"))) == 1  # the stale map went with the old folder


def test_reused_generator_draws_as_a_fresh_philox(dataset):
    """sample() resets one kept generator per thread instead of building Philox(key) per
    sample: it must be in the very state a fresh one starts in, whatever came before."""
    import pickle

    from bert_ds.loader.pretraining import _sample_key

    rng = dataset._rng.keyed(_sample_key(7, 0, 1))
    rng.random(17), rng.integers(0, 9, size=5)  # leave it mid-buffer, as a sample does
    for key in (_sample_key(7, 0, 3), _sample_key(7, 2, 3), _sample_key(0, 1, 2**40)):
        fresh = np.random.Generator(np.random.Philox(key=key))
        kept = dataset._rng.keyed(key)
        a, b = kept.bit_generator.state, fresh.bit_generator.state
        assert {k: a[k] for k in ("buffer_pos", "has_uint32", "uinteger")} == \
            {k: b[k] for k in ("buffer_pos", "has_uint32", "uinteger")}
        assert np.array_equal(a["buffer"], b["buffer"])
        assert all(np.array_equal(a["state"][k], b["state"][k]) for k in ("counter", "key"))
        assert np.array_equal(kept.random(7), fresh.random(7))
        assert kept.integers(1, 1000) == fresh.integers(1, 1000)
    copy = pickle.loads(pickle.dumps(dataset))  # loader workers get a copy with a generator of its own
    for idx in (0, 4, len(dataset) - 1):
        assert _equal_samples(copy.sample(1, idx), dataset.sample(1, idx))


def test_a_worker_receives_paths_not_the_sample_map_or_the_index(dataset):
    """Loader workers read the cached files: the pickled dataset holds no array that grows
    with the data, and its copy draws the same samples."""
    import pickle

    blob = pickle.dumps(dataset)
    cached = sum(f.stat().st_size for f in (dataset.path / ".cache").glob("*.npy"))
    assert len(blob) < 16_000 < cached
    copy = pickle.loads(blob)
    assert np.array_equal(_whole_map(copy), _whole_map(dataset))
    for idx in (0, 17, len(dataset) - 1):
        assert _equal_samples(copy[idx], dataset[idx])


def test_a_process_with_an_open_loader_still_exits(sample_data):
    """Loader workers ignore stop signals (the trainer decides), so multiprocessing's SIGTERM at
    interpreter exit cannot end them: a loader still open then must not make the exit wait forever."""
    import subprocess
    import sys

    from tests.conftest import REPO, cli_env

    script = (
        "from bert_ds.config import BatchPlan, DataConfig\n"
        "from bert_ds.loader.pretraining import PretrainingDataset, PretrainingLoader\n"
        f"ds = PretrainingDataset({str(sample_data['train'])!r}, DataConfig(train={str(sample_data['train'])!r}), seed=1)\n"
        "loader = PretrainingLoader(ds, BatchPlan.resolve(4, 4, 1), 0, num_workers=1)\n"
        "loader.next_step()\n"
        "KEPT = loader._iter  # as an exception's traceback would keep it: never shut down\n"
        "print('fetched', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=cli_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "fetched", proc.stderr[-2000:]


def test_drawing_maps_nothing_of_the_dataset_into_the_process(sample_data, tmp_path):
    """Token ids, the sample map and the sentence index are read with pread: however many
    samples a process draws, no page of the dataset is mapped into it (a memory map would keep
    every page a draw touched in its resident memory, which would grow with the corpus)."""
    import gc
    import shutil
    from pathlib import Path

    copy = tmp_path / "data"
    shutil.copytree(sample_data["train"], copy, ignore=shutil.ignore_patterns(".cache"))
    ds = PretrainingDataset(copy, DataConfig(train=str(copy)), seed=2)
    gc.collect()  # the shard readers of the open are gone
    for p in range(0, 3 * len(ds), 7):
        ds[p]
    mapped = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if str(copy) in line]
    assert not mapped, mapped
    assert list((copy / ".cache").glob("samples-*.npy")) and list((copy / ".cache").glob("sentences-*.npy"))
