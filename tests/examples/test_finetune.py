"""examples/finetune_classification.py on a tiny export: runs, writes its results, reports accuracies."""

import json
import shutil
import sys

import pytest
import torch

from tests.conftest import REPO, run_command

SCRIPT = REPO / "examples" / "finetune_classification.py"


def _tiny_export(sample_data, tmp_path):
    from bert_ds.checkpoint.export import export_hf
    from bert_ds.model.bert.model import BertForPreTraining
    from bert_ds.model.families import model_preset
    from bert_ds.data_tools.manifest import Manifest
    from bert_ds.data_tools.tokenizer import HF_FILES

    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in HF_FILES:  # only the tokenizer files: the dataset folder also holds shards
        shutil.copy2(sample_data["train"] / name, tokenizer / name)
    torch.manual_seed(0)
    config = model_preset("tiny", Manifest.load(sample_data["train"]).vocab_size, kernels="torch")
    return export_hf(BertForPreTraining(config).state_dict(), config, tokenizer, tmp_path / "hf")


def _run(*args):
    return run_command([sys.executable, str(SCRIPT), *map(str, args)], timeout=300)


@pytest.mark.lowest
def test_finetunes_a_tiny_export_and_reports_accuracy(sample_data, tmp_path):
    export = _tiny_export(sample_data, tmp_path)
    out = tmp_path / "finetune"
    # 16 pairs seen 20 times each: enough for the loop to show that it learns (memorises) them.
    proc = _run(export, "--output", out, "--steps", "40", "--train-pairs", "16", "--eval-pairs", "40",
                "--batch-size", "8", "--lr", "2e-3", "--warmup-steps", "3", "--max-length", "64")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "accuracy before fine-tuning" in proc.stdout and "accuracy after fine-tuning" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 40 and results["train_pairs"] == 16 and results["eval_pairs"] == 40
    assert results["loss_last"] < 0.75 * results["loss_first"], results
    for key in ("accuracy_before", "accuracy_after"):
        assert 0.0 <= results[key] <= 1.0
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(out / "model")
    assert model.config.num_labels == 2


def test_a_folder_that_is_not_an_export_is_a_one_line_error(tmp_path):
    proc = _run(tmp_path, "--output", tmp_path / "out")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "config.json" in err[0]
