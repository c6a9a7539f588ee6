"""A ModernBERT setting this model cannot run, given at the command line (a flag of the trainer, or
a phase plan's model fields), ends in one ``error:`` line naming the setting, exit status 2, and
nothing written: no run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli


@pytest.mark.parametrize("pair_task", ["nsp", "sop"])
def test_a_pair_task_with_a_modernbert_preset(sample_bpe_data, tmp_path, pair_task):
    out = tmp_path / "run"
    proc = run_cli("bert_ds.train", "--data", str(sample_bpe_data["train"]), "--output", str(out),
                   "--preset", "modernbert-tiny", "--steps", "1", "--seq-len", "64", "--pair-task", pair_task,
                   check=False)
    assert proc.returncode == 2 and proc.stderr == (
        f"error: pair_task: {pair_task} needs sentence pairs, which the documents layout has none of: set "
        "pair_task none (--pair-task none)\n"), proc.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize("model, said", [
    ({"type_vocab_size": 2}, "model config (modernbert): unknown keys type_vocab_size"),  # no token types
    ({"local_attention": 7}, "local_attention: must be even (the window is +-local_attention/2 tokens), got 7"),
    ({"local_attention": 200}, "model.local_attention: the local window (200 tokens) is longer than the sequences "
                               "(128): every layer would attend globally"),
    ({"global_rope_theta": 0}, "global_rope_theta: must be a positive finite number, got 0"),
    ({"local_rope_theta": -1.0}, "local_rope_theta: must be a positive finite number, got -1.0"),
    ({"num_heads": 3}, "num_heads: must divide hidden_size (64), got 3"),
], ids=["token-types", "odd-window", "window-past-seq-len", "theta-zero", "theta-negative", "heads"])
def test_a_model_field_a_modernbert_cannot_run(sample_bpe_data, tmp_path, model, said):
    out = tmp_path / "run"
    plan = {"output": str(out), "model": {"preset": "modernbert-tiny", **model},
            "base": {"data": {"train": [str(sample_bpe_data["train"])], "held_out": 0.02, "num_workers": 0},
                     "ds_config": "zero1_fp32.json", "tensorboard": False, "progress": False},
            "phases": [{"name": "p", "steps": 1, "global_batch_size": 4, "micro_batch_size": 4,
                        "data": {"max_seq_length": 128}}]}
    config = tmp_path / "plan.json"
    config.write_text(json.dumps(plan))
    proc = run_cli("bert_ds.train.phases", "--config", str(config), check=False)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[")]  # [bert_ds] notes, if any
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: phase 'p': ") and lines[0].endswith(said), lines[0]
    assert not Path(out).exists()
