"""``python -m bert_ds.loader.bench`` at a tiny scale: it writes its synthetic dataset, prints every
figure, and its measurements are consistent (the figures themselves are machine-dependent); a
ModernBERT preset draws its own family's samples, and one GPU's demand is the FLOPs accounting's."""

import json
import math
import re

import pytest

from bert_ds.data_tools.bench import BERT_VOCAB_SIZE
from bert_ds.model.families import model_preset
from bert_ds.model.flops import DATASHEET_BF16_TFLOPS, GOAL_MFU, training_flops
from tests.conftest import run_cli

FIGURES = [
    "cold open time",
    "cold open peak RSS",
    "two cold opens at once / one",
    "cached open time",
    "RSS after cached open + draws",
    "its private (anonymous) part",
    "loader samples/s per core",
    "sample map bytes per sample",
]


def test_scale_bench_prints_every_figure_and_builds_once_per_cold_start(tmp_path):
    out = tmp_path / "bench.json"
    keep = tmp_path / "data"
    proc = run_cli("bert_ds.loader.bench", "--scale", "200k", "400k", "--keep", str(keep), "--loader-seconds", "0.3",
                   "--draw-seconds", "0.5", "--json", str(out), timeout=300)
    result = json.loads(out.read_text())
    r, larger = result["runs"]
    assert [f["name"] for f in r["figures"]] == FIGURES
    assert 200_000 <= r["totals"]["tokens"] < 200_000 + 60 * 48  # stops at the document that reaches the scale
    assert 400_000 <= larger["totals"]["tokens"] < 400_000 + 60 * 48
    assert (keep / "tokens-200000" / "manifest.json").is_file()  # --keep: the datasets stay for the next run
    g = result["growth"]
    assert (g["from_tokens"], g["to_tokens"]) == (r["totals"]["tokens"], larger["totals"]["tokens"])
    step = (g["to_tokens"] - g["from_tokens"]) / 1e9
    after = [x["cached"]["rss_after_draws"]["VmRSS"] for x in (r, larger)]
    assert abs(g["per_billion"]["VmRSS"] * step - (after[1] - after[0])) < 1
    assert "per further billion tokens: RSS after the cached open and the draws" in proc.stdout
    cold, two, cached = r["cold"], r["two_cold"], r["cached"]
    assert cold["builds"] == 1 and sum(x["builds"] for x in two) == 1 and cached["builds"] == 0
    assert cold["samples"] == cached["samples"] == two[0]["samples"] > 1000
    assert 0 < cold["seconds"] and all(x["seconds"] > 0 for x in two) and cached["seconds"] > 0
    assert cold["peak_rss"] >= cold["rss_before_open"] > 100e6  # torch is imported
    after = cached["rss_after_draws"]
    assert after["VmRSS"] >= after["RssAnon"] > 0 and after["RssFile"] > 0
    assert cached["drawn"] > 0 and cached["samples_per_s"] > 0
    assert r["map_bytes"] == cached["map_header"] + 8 * cached["samples"]  # one uint64 per sample behind the header
    for i, name in enumerate(FIGURES, 1):
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"{i}. {name} "))
        assert float(re.sub(r"[^0-9.]", "", row[len(f"{i}. {name}"):].split()[0])) > 0, row
    map_row = next(line for line in proc.stdout.splitlines() if line.startswith("8. "))
    assert "8.0" in map_row and map_row.endswith("yes")

    # The default, BERT-Base: sentence pairs with NSP, 15% masked, micro-batches of 32 samples, at seq 128 (and 512)
    assert r["preset"] == "base" and r["seq_lens"] == [128, 512]  # BERT's recipe's two lengths
    assert r["data_settings"] == {"pair_task": "nsp", "layout": "sentences", "token_budget": False, "mask_rate": 0.15}
    assert [row["seq_len"] for row in r["per_length"]] == [128, 512]
    for row in r["per_length"]:
        assert row["samples"] == 32 * row["micro_batches"] > 0 and 0 < row["real_tokens"] <= row["padded_slots"]
        assert 0.12 < row["masked_tokens"] / row["real_tokens"] < 0.16  # 15% of the tokens but [CLS] and two [SEP]
        assert row["gpu_tokens_per_s"] == pytest.approx(gpu_tokens_per_s("base", row["seq_len"], 0.15, local_window=0),
                                                        rel=1e-12)
        assert re.search(rf"^seq {row['seq_len']} +[0-9,]+ ", proc.stdout, re.M)

    again = run_cli("bert_ds.loader.bench", "--scale", "200k", "--keep", str(keep), "--loader-seconds", "0.1",
                    "--draw-seconds", "0.1", timeout=300)
    assert "reusing the synthetic dataset" in again.stderr


def test_bad_scale_is_one_line():
    proc = run_cli("bert_ds.loader.bench", "--scale", "lots", check=False, timeout=60)
    assert proc.returncode == 2 and "not a token count" in proc.stderr and "Traceback" not in proc.stderr


def gpu_tokens_per_s(preset: str, seq_len: int, mask_rate: float, local_window: int) -> float:
    """What one H100 trains on at 50% MFU, full-length sequences: computed here from the FLOPs
    accounting, with a local layer's (query, key) pairs counted from their definition."""
    cfg = model_preset(preset, BERT_VOCAB_SIZE)
    w = local_window
    local = seq_len * (2 * w + 1) - w * (w + 1) if seq_len > w + 1 else seq_len * seq_len
    flops = training_flops(cfg, seq_len, seq_len * seq_len, mask_rate * seq_len, local) / seq_len
    assert GOAL_MFU == 0.5 and DATASHEET_BF16_TFLOPS["H100"] == 989.0
    return 0.5 * 989e12 / flops


def test_modernbert_preset_draws_documents_in_token_budgets_beside_one_gpus_demand(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bert_ds.loader.bench", "--preset", "modernbert-tiny", "--seq-len", "256", "1024",
                   "--scale", "100k", "--loader-seconds", "0.2", "--draw-seconds", "0.3", "--json", str(out),
                   timeout=300)
    (r,) = json.loads(out.read_text())["runs"]
    assert r["data_settings"] == {"pair_task": "none", "layout": "documents", "token_budget": True, "mask_rate": 0.3}
    assert r["seq_lens"] == [256, 1024] and r["vocab_size"] == BERT_VOCAB_SIZE
    assert r["local_window"] == 16  # modernbert-tiny's local_attention 32: +-16
    assert r["cold"]["builds"] == 1 and sum(x["builds"] for x in r["two_cold"]) == 1 and r["cached"]["builds"] == 0
    assert "layout documents, pair task none, 30% masked, token-budget micro-batches" in proc.stdout
    rows = r["per_length"]
    assert [row["seq_len"] for row in rows] == [256, 1024]
    for row in rows:
        seq = row["seq_len"]
        # A token-budget micro-batch holds up to 32 x seq tokens: more than 32 samples where some are shorter
        assert 0 < row["real_tokens"] <= 32 * seq * row["micro_batches"] and row["samples"] > 32 * row["micro_batches"]
        assert row["real_tokens"] < row["padded_slots"]  # real tokens are counted, not the padded slots
        assert 0 < row["full_length"] < row["samples"] and row["longest"] == seq  # whole documents cut at seq
        # the synthetic documents are long (U[5, 600] sentences, ~8,500 tokens): most pieces fill the length
        assert row["full_length"] > 0.5 * row["samples"], row
        assert 0.27 < row["masked_tokens"] / row["real_tokens"] < 0.31  # 30% of the tokens but [CLS] and [SEP]
        assert row["real_tokens_per_s"] == pytest.approx(row["real_tokens"] / row["seconds"]) and row["seconds"] > 0
        gpu = gpu_tokens_per_s("modernbert-tiny", seq, 0.3, local_window=16)
        assert row["gpu_tokens_per_s"] == pytest.approx(gpu, rel=1e-12) and gpu > 0
        assert row["loader_processes_per_gpu"] == math.ceil(gpu / row["real_tokens_per_s"]) >= 1
        line = next(line for line in proc.stdout.splitlines() if line.startswith(f"seq {seq:,} "))
        drawn, full, gflop, demand, loaders = line[len(f"seq {seq:,}"):].split()
        assert float(drawn.replace(",", "")) == pytest.approx(row["real_tokens_per_s"], abs=0.5)
        assert float(demand.replace(",", "")) == pytest.approx(gpu, abs=0.5)
        assert int(loaders.replace(",", "")) == row["loader_processes_per_gpu"]


@pytest.mark.parametrize("args, message", [
    (["--preset", "huge"], "unknown model preset 'huge'"),
    (["--seq-len", "128", "12x"], "--seq-len takes positive integers, got '12x'"),
    (["--seq-len", "0"], "--seq-len takes positive integers, got '0'"),
    (["--preset", "modernbert-tiny", "--seq-len", "2048"], "--seq-len 2048: must be in [8, 1024]"),
])
def test_bad_preset_or_seq_len_is_one_error_line_before_anything_is_written(args, message):
    proc = run_cli("bert_ds.loader.bench", "--scale", "200k", *args, check=False, timeout=60)
    err = proc.stderr.strip().splitlines()  # the bench's progress lines ("writing ...") go there too
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], proc.stderr
