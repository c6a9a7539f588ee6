"""ModernBERT's optimizer and schedule through the train CLI (StableAdamW, warmup-stable-decay with
a one_minus_sqrt decay), stopped and resumed: the resumed run's learning rates and losses are the
uninterrupted run's, and a resume that changes ``--lr`` trains at the new rate from its first step.

The trainer runs as processes, the way a user runs it (tiny BERT, sequence length 64, one rank).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bert_ds.config import OptimConfig
from bert_ds.optim.schedule import lr_multiplier
from tests.conftest import run_cli

STEPS, STOP_AT, LR = 8, 3, 3e-3
RECIPE = ["--optimizer", "stable_adamw", "--betas", "0.9", "0.98", "--eps", "1e-6", "--weight-decay", "1e-5",
          "--decouple-lr", "--grad-clip", "0", "--schedule", "wsd", "--warmup-steps", "2", "--decay", "one_minus_sqrt",
          "--decay-share", "0.5"]
CFG = OptimConfig(name="stable_adamw", schedule="wsd", warmup_steps=2, decay="one_minus_sqrt", decay_share=0.5)


def _train(data, out: Path, *extra: str):
    return run_cli("bert_ds.train", "--data", str(data["train"]), "--output", str(out), "--preset", "tiny",
                   "--seq-len", "64", "--global-batch-size", "8", "--micro-batch-size", "8", "--steps", str(STEPS),
                   "--ds-config", "zero1_fp32.json", "--no-progress", "--no-tensorboard", "--num-workers", "0",
                   *RECIPE, *extra)


def _steps(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "lr" in r]


@pytest.fixture(scope="module")
def runs(sample_data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wsd")
    _train(sample_data, root / "whole", "--lr", str(LR))
    _train(sample_data, root / "resumed", "--lr", str(LR), "--exit-after", str(STOP_AT))
    shutil.copytree(root / "resumed", root / "retuned", symlinks=True)
    _train(sample_data, root / "resumed", "--lr", str(LR))
    retuned = _train(sample_data, root / "retuned", "--lr", str(LR / 2))
    (root / "retuned" / "stdout.txt").write_text(retuned.stdout + retuned.stderr)
    return {name: root / name for name in ("whole", "resumed", "retuned")}


def test_a_resumed_run_has_the_uninterrupted_rates_and_losses(runs):
    whole, resumed = _steps(runs["whole"]), _steps(runs["resumed"])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["lr"] for r in resumed] == [r["lr"] for r in whole]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]  # StableAdamW's state came back whole
    # the schedule's shape: warm-up (steps 1, 2), the peak (3, 4), the decay (5-8, the first at the peak)
    assert [r["lr"] for r in whole] == pytest.approx([LR * lr_multiplier(s, CFG, STEPS) for s in range(STEPS)])
    assert whole[0]["lr"] < whole[2]["lr"] == whole[4]["lr"] == LR > whole[5]["lr"] > whole[-1]["lr"] > 0


def test_a_resume_with_another_lr_trains_at_it_from_its_first_step(runs):
    retuned, whole = _steps(runs["retuned"]), _steps(runs["whole"])
    assert [r["lr"] for r in retuned[:STOP_AT]] == [r["lr"] for r in whole[:STOP_AT]]
    assert [r["lr"] for r in retuned[STOP_AT:]] == pytest.approx([r["lr"] / 2 for r in whole[STOP_AT:]], rel=1e-12)
    assert "optim.lr: saved 0.003, requested 0.0015" in (runs["retuned"] / "stdout.txt").read_text()
