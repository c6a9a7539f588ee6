"""A batch-size warm-up (``--batch-warmup-steps``, ``--batch-warmup-start``): the global batch
rises in whole micro-batches from its start to ``--global-batch-size``, the loader draws each
step's batch from the stream with no gap or repeat, and DeepSpeed runs each step with its own
accumulation count: a step of k micro-batches is the step of a run whose plan has k, whatever
the engine was built with, and a run stopped during the warm-up resumes with the losses of the
run that was never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from bert_ds.base.errors import ConfigError
from bert_ds.config import BatchPlan, DataConfig, TrainConfig
from bert_ds.model.families import model_preset
from tests.bert_ds.test_reliability import _steps_logged
from tests.conftest import run_cli


def test_the_batch_rises_in_whole_micro_batches_to_the_global_batch():
    plan = BatchPlan.resolve(4608, 96, 8, warmup_steps=100, warmup_start=768)  # ModernBERT-base's, on 8 ranks
    batches = [plan.batch_at(step) for step in range(1, 103)]
    assert batches[0] == 768 and batches[99] < 4608 and batches[100:] == [4608, 4608]
    assert batches == sorted(batches) and set(batches) == {768 * k for k in range(1, 7)}
    assert all(plan.accum_at(s) * 96 * 8 == plan.batch_at(s) for s in range(1, 103))
    assert "warming up from 768 over 100 steps" in plan.describe()
    # a start below one micro-batch on every rank is one; none at all leaves every step alike
    assert BatchPlan.resolve(32, 4, 2, warmup_steps=10, warmup_start=3).batch_at(1) == 8
    assert {BatchPlan.resolve(32, 4, 2).accum_at(s) for s in (1, 2, 1000)} == {4}


@pytest.mark.parametrize("steps,start,match", [(-1, 0, "batch_warmup_steps"), (5, 0, "batch_warmup_start"),
                                               (5, 64, "batch_warmup_start")])
def test_a_warm_up_that_cannot_be_is_refused_naming_the_field(steps, start, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(model=model_preset("tiny", 100), data=DataConfig(train="x"), global_batch_size=32,
                    batch_warmup_steps=steps, batch_warmup_start=start)


def _run(data: dict[str, Path], out: Path, ds_config: str, global_batch: int, *extra: str) -> list[dict]:
    run_cli("bert_ds.train", "--data", str(data["train"]), "--output", str(out), "--preset", "tiny",
            "--seq-len", "64", "--global-batch-size", str(global_batch), "--micro-batch-size", "2", "--lr", "1e-2",
            "--warmup-steps", "2", "--ds-config", ds_config, "--no-progress", "--no-tensorboard",
            "--num-workers", "0", *extra)
    return _steps_logged(out)


def _figures(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["samples"], r["loss"], r["grad_norm"]) for r in records]


@pytest.mark.long
@pytest.mark.parametrize("ds_config", ["zero1_fp32.json", "zero1_bf16.json"])  # the engine; a bf16 copy on it
def test_each_step_runs_its_own_accumulation_and_a_stop_in_the_warm_up_resumes_exactly(sample_data, tmp_path,
                                                                                      ds_config):
    # batches of 2, 2, 4, 6, 8, 8 sequences: 1, 1, 2, 3, 4, 4 micro-batches
    warm = _run(sample_data, tmp_path / "warm", ds_config, 8, "--steps", "6", "--batch-warmup-steps", "4",
                "--batch-warmup-start", "2")
    assert [r["samples"] for r in warm] == [2, 4, 8, 14, 22, 30]
    # the same first steps from engines built for 2 and 1 micro-batches a step: the loss of a step
    # is divided by its own count, and its last micro-batch is the boundary
    shorter = _run(sample_data, tmp_path / "shorter", ds_config, 4, "--steps", "3", "--batch-warmup-steps", "2",
                   "--batch-warmup-start", "2")
    plain = _run(sample_data, tmp_path / "plain", ds_config, 2, "--steps", "2")
    assert _figures(shorter) == _figures(warm[:3])
    assert _figures(plain) == _figures(warm[:2])

    stopped = tmp_path / "stopped"
    args = ("--steps", "6", "--batch-warmup-steps", "4", "--batch-warmup-start", "2")
    _run(sample_data, stopped, ds_config, 8, *args, "--exit-after", "3")  # saves step 3, in the warm-up
    resumed = _run(sample_data, stopped, ds_config, 8, *args)
    assert _figures(resumed) == _figures(warm)
