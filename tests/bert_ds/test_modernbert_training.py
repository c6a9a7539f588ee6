"""A tiny ModernBERT-class model trained through DeepSpeed on the bundled sample (byte-level BPE
shards, whole documents packed to a token budget, 30% masking, no pair task): it learns (the
held-out MLM accuracy three times the unigram baseline, the share of the most frequent token),
and a run killed with SIGKILL resumes from its last checkpoint with the losses of the run that
was never killed, bit for bit (same machine, same world size)."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from bert_ds.data_tools.manifest import open_dataset
from tests.bert_ds.test_reliability import _losses, _start, _wait_for_step
from tests.conftest import run_cli

pytestmark = pytest.mark.long

STEPS = 120


def _args(data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["bert_ds.train", "--data", str(data["train"]), "--val-data", str(data["heldout"]), "--output", str(out),
            "--preset", "modernbert-tiny", "--seq-len", "128", "--micro-batch-size", "16",
            "--global-batch-size", "16", "--steps", str(STEPS), "--lr", "5e-2", "--warmup-steps", "10",
            "--ds-config", "zero1_fp32.json", "--val-samples", "256", "--no-progress", "--no-tensorboard",
            "--num-workers", "0", *extra]


def _unigram_baseline(folder: Path) -> float:
    """The accuracy of always predicting the held-out set's most frequent non-special token."""
    manifest, readers = open_dataset(folder)
    special = set(manifest.special_tokens.values())
    counts = Counter(token for reader in readers for token in reader.tokens.tolist())
    regular = {token: n for token, n in counts.items() if token not in special}
    return max(regular.values()) / sum(regular.values())


def test_a_tiny_modernbert_learns_and_resumes_exactly_after_a_kill(sample_bpe_data, tmp_path):
    whole = tmp_path / "whole"
    proc = run_cli(*_args(sample_bpe_data, whole))
    assert "modernbert" in json.loads((whole / "train_config.json").read_text())["model"]["arch"]
    assert "nsp_acc=" not in proc.stderr + proc.stdout  # no pair task, no NaN printed for it
    val = json.loads((whole / "summary.json").read_text())["val"]
    baseline = _unigram_baseline(sample_bpe_data["heldout"])
    print(f"\nheld-out MLM accuracy after {STEPS} steps {val['mlm_acc']:.3f}, unigram baseline {baseline:.3f}")
    assert val["mlm_acc"] > 3 * baseline, (val, baseline)

    killed = tmp_path / "killed"
    args = _args(sample_bpe_data, killed, "--save-every", "40")
    proc = _start(args, log=tmp_path / "killed.log")
    _wait_for_step(killed, 55, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_cli(*args, "--exit-after", "20")  # from the checkpoint of step 40 to step 60
    got, reference = _losses(killed), _losses(whole)
    assert max(got) == 60 and all(got[step] == reference[step] for step in range(1, 61)), (got, reference)
