"""bert_ds.bench: the smoke run prints a full table, the batches look like the loader's."""

import json
import re

import numpy as np
import pytest
import torch

from bert_ds.bench import FULL_LENGTH_PROB, synthetic_length, synthetic_sample
from tests.conftest import run_cli

SMOKE = ["bert_ds.bench", "--device", "cpu", "--preset", "tiny", "--steps", "2", "--warmup", "1",
         "--batch-size", "8", "--threads", "1"]


def _table_rows(stdout):
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_smoke_prints_the_table_with_positive_numbers(tmp_path):
    proc = run_cli(*SMOKE, "--json", str(tmp_path / "bench.json"))
    rows = _table_rows(proc.stdout)
    assert [row[0].split()[0] for row in rows] == ["bert_ds", "transformers"]
    for row in rows:
        numbers = [float(cell.replace(",", "").rstrip("%")) for cell in row[1:] if cell != "n/a"]
        assert len(numbers) >= 5 and all(x > 0 for x in numbers), row
    speedup = float(re.search(r"\*\*([0-9.]+)x\*\*", proc.stdout).group(1))
    assert speedup > 0

    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["settings"]["steps"] == 2 and result["settings"]["warmup"] == 1
    assert result["loss_check"]["abs_diff"] < 1e-3  # same weights, same batch: same loss
    for figures in result["results"].values():
        assert figures["ms_per_step"] > 0 and figures["real_tokens_per_s"] > 0 and figures["useful_tflops"] > 0
    assert result["probes"]["matmul_tflops"] > 0 and result["probes"]["copy_gb_per_s"] > 0


def test_batches_from_real_shards(sample_data):
    proc = run_cli(*SMOKE, "--data", str(sample_data["train"]), "--no-probes")
    assert "real shards" in proc.stdout and "vocab 2,048" in proc.stdout
    assert all(float(row[3].replace(",", "")) > 0 for row in _table_rows(proc.stdout))


def test_bf16_autocast_path_runs(tmp_path):
    """The CUDA default (bf16 autocast for both models), exercised on the CPU."""
    run_cli(*SMOKE, "--precision", "bf16", "--steps", "1", "--no-probes", "--json", str(tmp_path / "b.json"))
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["settings"]["precision"] == "bf16"
    assert result["loss_check"]["abs_diff"] < 0.05  # bf16 rounding, same model
    assert all(x["ms_per_step"] > 0 for x in result["results"].values())


def test_synthetic_lengths_mimic_the_loader():
    rng = np.random.default_rng(0)
    lengths = np.array([synthetic_length(rng, 128) for _ in range(20_000)])
    assert lengths.min() >= 5 and lengths.max() == 128
    assert abs((lengths == 128).mean() - 0.92) < 0.01 and (lengths == 128).mean() >= FULL_LENGTH_PROB
    assert 122 < lengths.mean() < 125  # the loader gives 124.1 on the bundled WikiText sample


def test_synthetic_sample_is_a_masked_nsp_pair():
    s = synthetic_sample(np.random.default_rng(1), 128, 1000)
    ids, types, labels = s["input_ids"], s["token_type_ids"], s["labels"]
    n = len(ids)
    assert ids[0] == 2 and ids[-1] == 3 and (ids == 3).sum() == 2  # [CLS] A [SEP] B [SEP]
    assert types[0] == 0 and types[-1] == 1
    masked = labels != -100
    assert masked.sum() == round((n - 3) * 0.15) and (labels[masked] >= 5).all()
    assert (ids[masked] == 4).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_one_line_error():
    proc = run_cli(*SMOKE, "--device", "cuda", check=False)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "CUDA" in err[0]
