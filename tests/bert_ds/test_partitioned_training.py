"""Training on a parent of partitions: one corpus, and an exact resume after ``kill -9`` on
another world size (fp32, no dropout: a world-size change is held to rtol 1e-5, as R8)."""

from __future__ import annotations

import pytest

from bert_ds.config import DataConfig
from bert_ds.loader.pretraining import PretrainingDataset
from bert_ds.train.sample_log import consumed_positions
from tests.bert_ds.test_reliability import _losses, _start, _stream_figures, _wait_for_step
from tests.conftest import SAMPLE, end, run_cli, started_by

STEPS, SAVE_EVERY, GLOBAL_BATCH = 8, 2, 16


@pytest.fixture(scope="module")
def parent(sample_data, tmp_path_factory):
    """The bundled validation text built in 3 parts, one ``--part`` at a time."""
    out = tmp_path_factory.mktemp("parts") / "train"
    for i in range(3):
        run_cli("bert_ds.data_tools", "build", "--input", str(SAMPLE / "valid.txt"), "--output", str(out),
                "--vocab", str(sample_data["train"] / "vocab.txt"), "--split-sentences", "--workers", "1",
                "--part", f"{i}/3")
    return out


def _args(data, out) -> list[str]:
    return ["bert_ds.train", "--data", str(data), "--output", str(out), "--preset", "tiny", "--seq-len", "64",
            "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", "8", "--lr", "3e-2",
            "--warmup-steps", "2", "--no-progress", "--no-tensorboard", "--num-workers", "0",
            "--ds-config", "zero1_fp32.json", "--dropout", "0", "--steps", str(STEPS),
            "--save-every", str(SAVE_EVERY), "--keep-last", "10", "--log-samples", str(out / "samples.jsonl")]


def test_a_parent_is_the_corpus_of_its_parts(parent, sample_data):
    parts = sorted(p for p in parent.iterdir() if p.name.startswith("part-"))
    cfg = DataConfig(train=[str(parent)])
    whole, listed = PretrainingDataset(parent, cfg, seed=3), PretrainingDataset(parts, cfg, seed=3)
    assert whole.folders == parts and len(parts) == 3
    assert len(whole) == len(listed) and whole.chunk(len(whole) - 1)[0] == len(whole._shards) - 1
    for p in (0, 5, len(whole) - 1):
        assert whole[p]["input_ids"].tolist() == listed[p]["input_ids"].tolist()
    # the same text built whole: the same documents, so (one shard each way) the same sentences
    single = PretrainingDataset(sample_data["train"], cfg, seed=3)
    covered = sum(e - f for f, e in (whole.chunk(i)[1:] for i in range(len(whole))))
    assert covered == sum(e - f for f, e in (single.chunk(i)[1:] for i in range(len(single))))


def test_training_on_a_parent_resumes_exactly_after_kill_9_on_another_world_size(parent, tmp_path):
    reference = tmp_path / "reference"
    run_cli(*_args(parent, reference))  # one rank, uninterrupted
    out = tmp_path / "run"
    # rank 0 stops at the start of step 5, after the checkpoint of step 4: the kill lands mid-run
    proc = _start(_args(parent, out) + ["--debug-hang-at", f"0:{2 * SAVE_EVERY + 1}"], nproc=2,
                  log=tmp_path / "two-ranks.log")
    killed_at = _wait_for_step(out, 2 * SAVE_EVERY, proc)
    end(proc)  # SIGKILL to torchrun and both ranks at once, as when the node dies
    assert not started_by(proc)
    resumed = run_cli(*_args(parent, out))  # on one rank
    assert "saved on 2 rank(s)" in resumed.stderr
    ref, got = _losses(reference), _losses(out)
    rel = {s: abs(got[s] - ref[s]) / abs(ref[s]) for s in got}
    stream = consumed_positions(out / "samples.jsonl")
    dup, gaps = _stream_figures(stream, range(STEPS * GLOBAL_BATCH))
    print(f"2 ranks killed at step {killed_at}, resumed on 1: loss rel. diff max {max(rel.values()):.1e} over steps "
          f"1-{STEPS}; sample stream {dup} duplicates, {gaps} gaps")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(rel.values()) <= 1e-4 and all(rel[s] <= 1e-5 for s in range(1, 2 * SAVE_EVERY + 2))
    assert dup == gaps == 0 and sorted(stream) == sorted(consumed_positions(reference / "samples.jsonl"))
