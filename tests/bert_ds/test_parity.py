"""bert_ds.tools.parity on a tiny budget: both trainers train on the same tokens and are scored by
one evaluator; the verdict compares medians against the seeds' spread; a rerun keeps what is done."""

import json

import pytest

from bert_ds.tools.parity import verdicts
from tests.conftest import SAMPLE, run_cli


def _summary(ours: list[float], theirs: list[float]) -> dict:
    spread = lambda v: {"median": sorted(v)[len(v) // 2], "spread": max(v) - min(v)}  # noqa: E731
    return {"bert-ds": {"held": {"loss": spread(ours)}}, "transformers": {"held": {"loss": spread(theirs)}}}


def test_the_verdict_allows_the_seed_spread_and_no_more():
    assert verdicts(_summary([3.00, 3.10, 3.20], [3.00, 3.02, 3.04]))["held"]["not_worse"]  # +0.08 <= 0.2
    worse = verdicts(_summary([3.50, 3.51, 3.52], [3.00, 3.05, 3.10]))["held"]
    assert not worse["not_worse"] and worse["difference"] == pytest.approx(0.46) and worse["allowed"] == pytest.approx(0.1)


@pytest.mark.long
def test_a_tiny_parity_run_trains_both_on_the_same_budget(tmp_path):
    out = tmp_path / "parity"
    texts = {}
    for name in ("valid", "test"):  # the sample's first 1,500 lines: 8 steps of 8 x 64 need no more
        texts[name] = tmp_path / f"{name}.txt"
        lines = (SAMPLE / f"{name}.txt").read_text(encoding="utf-8").splitlines(keepends=True)
        texts[name].write_text("".join(lines[:1500]), encoding="utf-8")
    args = ["bert_ds.tools.parity", "--output", str(out), "--train-text", str(texts["valid"]), "--heldout-text",
            str(texts["test"]), "--preset", "tiny", "--steps", "8", "--seeds", "2",
            "--seq-len", "64", "--batch-size", "8", "--eval-batches", "3", "--warmup-steps", "2",
            "--vocab-size", "1024"]
    run_cli(*args, timeout=900)
    report = json.loads((out / "parity.json").read_text())
    assert set(report["runs"]) == {"bert-ds", "transformers"}
    for runs in report["runs"].values():
        assert [r["seed"] for r in runs] == [1, 2]
        for r in runs:
            for scores in r["scores"].values():
                assert 0 < scores["loss"] < 10 and 0 <= scores["accuracy"] <= 1 and scores["masked_tokens"] > 50
    ours = [r["tokens"] for r in report["runs"]["bert-ds"]]
    theirs = [r["tokens"] for r in report["runs"]["transformers"]]
    assert all(abs(a - b) <= 8 * 64 / 2 for a, b in zip(ours, theirs))  # within half a step of tokens
    assert set(report["verdicts"]) == {"blocks (transformers' layout)", "samples (bert-ds's layout)"}
    assert "| samples (bert-ds's layout) | bert-ds |" in (out / "parity.md").read_text()

    trained = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("*-seed*/config.json")}
    assert len(trained) == 4
    run_cli(*args, timeout=900)
    assert {p.parent.name: p.stat().st_mtime_ns for p in out.glob("*-seed*/config.json")} == trained
    other = run_cli(*args[:-2], "--vocab-size", "2048", check=False)
    assert other.returncode == 2 and "holds a parity run with other vocab_size (vocab_size 1024)" in other.stderr


def test_a_folder_that_holds_something_else_is_refused(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    proc = run_cli("bert_ds.tools.parity", "--output", str(tmp_path), check=False)
    assert proc.returncode == 2 and "exists and holds no parity run" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]
