"""bert_ds.tools.parity on a tiny budget, for BERT and for ModernBERT: both trainers train on the
same tokens and are scored by one evaluator; the verdict compares medians against the seeds'
spread; a rerun keeps what is done; transformers' ModernBERT is bert-ds's export's configuration."""

import json
import math

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


def _texts(tmp_path) -> dict:
    """The sample's first 1,500 lines of training and held-out text: 8 steps of 8 x 64 need no more."""
    texts = {}
    for name in ("valid", "test"):
        texts[name] = tmp_path / f"{name}.txt"
        lines = (SAMPLE / f"{name}.txt").read_text(encoding="utf-8").splitlines(keepends=True)
        texts[name].write_text("".join(lines[:1500]), encoding="utf-8")
    return texts


@pytest.mark.long
def test_a_tiny_parity_run_trains_both_on_the_same_budget(tmp_path):
    out = tmp_path / "parity"
    texts = _texts(tmp_path)
    args = ["bert_ds.tools.parity", "--output", str(out), "--train-text", str(texts["valid"]), "--heldout-text",
            str(texts["test"]), "--preset", "tiny", "--steps", "8", "--seeds", "2",
            "--seq-len", "64", "--batch-size", "8", "--eval-batches", "3", "--warmup-steps", "2",
            "--vocab-size", "1024"]
    run_cli(*args, timeout=900)
    report = json.loads((out / "parity.json").read_text())
    assert set(report["runs"]) == {"bert-ds", "transformers"}
    assert report["family"]["mlm_class"] == "BertForMaskedLM"
    assert {r["mask_rate"] for rs in report["runs"].values() for r in rs} == {0.15}
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


@pytest.mark.long
def test_a_tiny_modernbert_parity_run_trains_transformers_modernbert_of_the_exported_config(tmp_path):
    out, texts = tmp_path / "parity", _texts(tmp_path)
    batch, seq_len, vocab = 8, 64, 512  # seq 64: past modernbert-tiny's local window of 32
    args = ["bert_ds.tools.parity", "--output", str(out), "--train-text", str(texts["valid"]), "--heldout-text",
            str(texts["test"]), "--preset", "modernbert-tiny", "--steps", "8", "--seeds", "1", "--seq-len",
            str(seq_len), "--batch-size", str(batch), "--eval-batches", "3", "--warmup-steps", "2",
            "--vocab-size", str(vocab)]
    run_cli(*args, timeout=600)
    report = json.loads((out / "parity.json").read_text())
    assert report["family"] == {"name": "modernbert", "export_class": "ModernBertForMaskedLM",
                                "mlm_class": "ModernBertForMaskedLM", "tokenizer": "byte-level BPE",
                                "mask_rate": 0.3, "layout": "documents", "token_budget": True}
    assert "`Trainer` trains `ModernBertForMaskedLM`" in (out / "parity.md").read_text()
    # each trainer's record of how it trained: bert-ds on the family's own data (whole documents to a
    # token budget), transformers' ModernBertForMaskedLM; both at the family's 30%
    [ours], [theirs] = report["runs"]["bert-ds"], report["runs"]["transformers"]
    assert (ours["layout"], ours["token_budget"], ours["mask_rate"], ours["steps"]) == ("documents", True, 0.3, 8)
    assert (theirs["model_class"], theirs["mask_rate"], theirs["steps"]) == ("ModernBertForMaskedLM", 0.3, 8)
    assert abs(ours["tokens"] - theirs["tokens"]) <= batch * seq_len / 2
    for r in (ours, theirs):
        assert r["seed"] == 1
        for scores in r["scores"].values():  # below a uniform guess's loss: both learned something
            assert 0 < scores["loss"] < math.log(vocab) and 0 < scores["accuracy"] <= 1
        # the family's 30%, of every block token but the [CLS] and [SEP] of each line
        assert 0.22 < r["scores"]["blocks (transformers' layout)"]["masked_tokens"] / (3 * batch * seq_len) < 0.34

    # transformers' model is the export's configuration (the same mapping, the tokenizer's special
    # ids), and both are the model bert-ds trained
    export = json.loads((out / "bert_ds-seed1-hf" / "config.json").read_text())
    trained = json.loads((out / "transformers-seed1" / "config.json").read_text())
    assert {k: trained.get(k) for k in export if k != "transformers_version"} == {
        k: v for k, v in export.items() if k != "transformers_version"}
    model = json.loads((out / "bert_ds-seed1" / "train_config.json").read_text())["model"]
    assert model["pad_token_id"] == 3  # the BPE's, not 0
    for config in (export, trained):
        assert config["architectures"] == ["ModernBertForMaskedLM"]
        assert [config[k] for k in ("hidden_size", "num_hidden_layers", "local_attention", "vocab_size",
                                    "pad_token_id")] == [model[k] for k in ("hidden_size", "num_layers",
                                                         "local_attention", "vocab_size", "pad_token_id")]
        assert {kind: p["rope_theta"] for kind, p in config["rope_parameters"].items()} == {
            "full_attention": model["global_rope_theta"], "sliding_attention": model["local_rope_theta"]}

    other = run_cli(*["tiny" if a == "modernbert-tiny" else a for a in args], check=False)
    assert other.returncode == 2
    assert other.stderr.strip().splitlines() == [f"error: --output {out} holds a parity run with other preset "
                                                 "(preset 'modernbert-tiny'); give another --output"]
