"""bert_ds.tools.bench: the four variants in one run, their figures, the goals and the projection;
ModernBERT's against transformers' ModernBertForMaskedLM, and the first-batch loss check."""

import importlib.util
import json

import numpy as np
import pytest
import torch

from bert_ds.model.families import FAMILIES
from bert_ds.tools import bench, bench_variants
from bert_ds.tools.bench_variants import FULL_LENGTH_PROB, SyntheticPretraining, synthetic_length, synthetic_sample
from bert_ds.tools.projection import ANCHOR, anchor_mfu, hours_minutes, project
from bert_ds.kernels.dispatch import KernelUnavailable
from tests.conftest import run_cli

SMOKE = ["--device", "cpu", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--batch-size", "8", "--seq-len", "64",
         "--vocab-size", "2048"]  # the smallest shapes that run every variant: the bench's paths, not its figures
# ModernBERT's: seq 64 is past the tiny preset's window of +-16, so its local layers compute fewer pairs
MODERNBERT_SMOKE = ["--device", "cpu", "--preset", "modernbert-tiny", "--steps", "2", "--warmup", "1", "--batch-size",
                    "4", "--seq-len", "64", "--vocab-size", "2048"]


def _table_rows(text):
    rows = [line for line in text.splitlines() if line.startswith("| (")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def _number(cell):
    return float(cell.replace(",", "").rstrip("%x").removesuffix(" GiB"))


def test_smoke_runs_the_four_variants_and_writes_json_and_markdown(tmp_path):
    proc = run_cli("bert_ds.tools.bench", *SMOKE, "--variants", "a,b,c,d", "--threads", "1",
                   "--json", str(tmp_path / "b.json"), "--markdown", str(tmp_path / "b.md"))
    assert (tmp_path / "b.md").read_text().strip() == proc.stdout.strip()
    rows = _table_rows(proc.stdout.split("## Projection")[0])
    assert [row[0][:3] for row in rows] == ["(a)", "(b)", "(c)", "(d)"]
    for row in rows:  # ms/step, tokens/s, vs (c), data wait, TFLOP/s, MFU vs matmul: all measured, all > 0
        assert all(_number(row[i]) > 0 for i in (2, 3, 4, 6, 8)), row
        assert row[7] == "n/a" and row[9] == "n/a"  # no datasheet peak, no per-variant memory on a CPU

    result = json.loads((tmp_path / "b.json").read_text())
    assert result["settings"]["steps"] == 2 and result["settings"]["warmup"] == 1
    (config,) = result["configs"]
    figures = config["results"]
    assert set(figures) == {"a", "b", "c", "d"} and figures["a"]["kernels"] == "torch (no CUDA device)"
    assert figures["d"]["kernels"] == "layers compiled; attention: torch"
    losses = [x["first_batch_loss"] for x in figures.values()]
    assert max(losses) - min(losses) < 1e-3  # same weights, same batch: same loss
    for x in figures.values():
        assert 0 <= x["data_wait_share"] < 1 and x["data_wait_ms_per_step"] >= 0
        assert x["compute_ms_per_step_min"] <= x["ms_per_step"]  # compute is part of the timed wall
        assert x["real_tokens_per_s"] == pytest.approx(config["batches"]["real_tokens_per_step"] / x["ms_per_step"] * 1e3)
    assert figures["c"]["speedup_vs_transformers"] == 1.0
    assert figures["a"]["speedup_vs_transformers"] == pytest.approx(
        figures["a"]["real_tokens_per_s"] / figures["c"]["real_tokens_per_s"])
    # Unpadded with a sparse decoder, bert_ds does less work than the padded dense model.
    assert config["batches"]["padded_dense_gflop_per_step"] > config["batches"]["useful_gflop_per_step"]
    assert result["probes"]["matmul_tflops"] > 0 and result["probes"]["copy_gb_per_s"] > 0
    assert result["environment"]["git_commit"] and result["goals"] == []  # goals are for a GPU
    assert result["projection"]["variants"] == {}  # no datasheet peak on a CPU: nothing to carry to an A100
    assert "10 h 38 min" in proc.stdout and "No projection: no MFU against a datasheet bf16 peak" in proc.stdout


def test_two_sequence_lengths_in_one_run_from_real_shards(sample_data, tmp_path):
    bench.main(["--device", "cpu", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--tokens-per-step", "512",
                "--seq-len", "32,64", "--data", str(sample_data["train"]), "--workers", "1", "--variants", "b,c",
                "--no-probes", "--json", str(tmp_path / "b.json")])
    result = json.loads((tmp_path / "b.json").read_text())
    assert [(c["seq_len"], c["batch_size"]) for c in result["configs"]] == [(32, 16), (64, 8)]
    for config in result["configs"]:
        assert config["source"].startswith("real shards") and config["vocab_size"] == 2048
        assert set(config["results"]) == {"b", "c"}
        assert config["batches"]["mean_real_length"] <= config["seq_len"]
        assert all(x["mfu_vs_matmul"] is None for x in config["results"].values())  # --no-probes


@pytest.mark.parametrize("smoke", [SMOKE, [*MODERNBERT_SMOKE, "--variants", "a,c"]], ids=["bert", "modernbert"])
def test_bf16_autocast_path_runs(smoke, tmp_path):
    """The CUDA default (bf16 autocast for every variant asked for), exercised on the CPU: the
    variants pass the loss check's bf16 allowance."""
    assert bench.main([*smoke, "--precision", "bf16", "--steps", "1", "--no-probes",
                       "--json", str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["settings"]["precision"] == "bf16"
    (config,) = result["configs"]
    losses = [x["first_batch_loss"] for x in config["results"].values()]
    assert max(losses) - min(losses) < 0.05  # bf16 rounding, same model
    assert config["loss_check"]["tolerance"] < 0.05  # and the allowance is of that size, not a blank cheque


def test_a_variant_that_cannot_run_fused_is_reported_and_the_others_still_run(monkeypatch):
    real = bench_variants.build_variant

    def build(v, *args):
        if v.key == "a":
            raise KernelUnavailable("kernels=cuda: varlen_attention cannot run fused: head_dim 80")
        return real(v, *args)

    monkeypatch.setattr(bench_variants, "build_variant", build)
    result = bench.run(bench.settings_from(bench.parse_args(SMOKE)))
    figures = result["configs"][0]["results"]
    assert "head_dim 80" in figures["a"]["not_run"] and figures["b"]["real_tokens_per_s"] > 0
    text = bench.markdown(result)
    assert "| (a) bert_ds: fused kernels, unpadded, sparse MLM decoder, LAMB | not run: kernels=cuda" in text


def test_goals_compare_the_measured_figures_with_the_targets():
    def config(seq, speedup, mfu):
        return {"preset": "base", "seq_len": seq, "results": {"a": {"speedup_vs_transformers": speedup,
                                                                   "mfu_vs_datasheet_bf16": mfu}}}

    result = {"settings": {"device": "cuda"}, "configs": [config(128, 2.6, 0.45), config(512, 2.9, 0.5)]}
    assert [(g["measured"], g["met"]) for g in bench.goals(result)] == [
        ("2.60x", True), ("45.0%", False), ("2.90x", False)]
    not_run = {"preset": "base", "seq_len": 128, "results": {"a": {"not_run": "no extension"}}}
    assert bench.goals({**result, "configs": [not_run]}) == [
        {"goal": "(a) at seq 128", "measured": "not run: no extension", "met": False}]
    assert bench.goals({**result, "settings": {"device": "cpu"}}) == []


def test_projection_carries_each_measured_gpu_mfu_to_the_anchor_run():
    batches = {"real_tokens_per_step": 16000, "sum_sq_len_per_step": 16000 * 124, "masked_per_step": 2350}
    results = {"a": {"not_run": "no extension"}, "b": {"mfu_vs_datasheet_bf16": 0.40},
               "c": {"mfu_vs_datasheet_bf16": 0.10}}
    result = {"environment": {"device": "NVIDIA H100"},
              "configs": [{"preset": "base", "seq_len": 512, "batches": batches, "results": {}},
                          {"preset": "base", "seq_len": 128, "batches": batches, "results": results}]}
    p = bench.projection(result)
    assert p["from"]["seq_len"] == 128 and set(p["variants"]) == {"b", "c"}  # the anchor's seq; (a) did not run
    assert p["variants"]["b"]["seconds"] == pytest.approx(p["variants"]["c"]["seconds"] / 4)
    assert p["variants"]["b"]["speedup"] == pytest.approx(0.40 / p["anchor_mfu"])
    text = "\n".join(bench.projection_markdown(p))
    assert f"| (b) | 40.0% | {p['variants']['b']['tokens_per_s_per_gpu']:,.0f} |" in text


def test_projection_arithmetic_reproduces_the_anchor():
    assert hours_minutes(ANCHOR.seconds) == "10 h 38 min"
    assert ANCHOR.tokens_per_s_per_gpu == pytest.approx(32.8e9 / 38280 / 8)
    assert (ANCHOR.mlm_loss, ANCHOR.mlm_accuracy) == (1.59, 0.67)
    per_token = 0.545e9
    same = project(anchor_mfu(per_token), per_token)
    assert same["seconds"] == pytest.approx(ANCHOR.seconds) and same["speedup"] == pytest.approx(1.0)
    twice = project(2 * anchor_mfu(per_token), per_token)
    assert twice["seconds"] == pytest.approx(ANCHOR.seconds / 2)
    # 50% MFU on a 312 TFLOP/s A100 at 0.545 GFLOP/token: 286k tokens/s per GPU, 32.8B tokens in 3.98 h.
    half = project(0.5, per_token)
    assert half["tokens_per_s_per_gpu"] == pytest.approx(0.5 * 312e12 / per_token)
    assert hours_minutes(half["seconds"]) == "3 h 59 min"
    with pytest.raises(ValueError):
        project(0.0, per_token)


def test_synthetic_lengths_mimic_the_loader():
    rng = np.random.default_rng(0)
    lengths = np.array([synthetic_length(rng, 128) for _ in range(20_000)])
    assert lengths.min() >= 5 and lengths.max() == 128
    assert abs((lengths == 128).mean() - 0.92) < 0.01 and (lengths == 128).mean() >= FULL_LENGTH_PROB
    assert 122 < lengths.mean() < 125  # the loader gives 124.1 on the bundled WikiText sample


def test_synthetic_sample_is_a_masked_nsp_pair():
    s = synthetic_sample(np.random.default_rng(1), 128, 1000, mask_rate=0.15)
    ids, types, labels = s["input_ids"], s["token_type_ids"], s["labels"]
    n = len(ids)
    assert ids[0] == 2 and ids[-1] == 3 and (ids == 3).sum() == 2  # [CLS] A [SEP] B [SEP]
    assert types[0] == 0 and types[-1] == 1
    masked = labels != -100
    assert masked.sum() == round((n - 3) * 0.15) and (labels[masked] >= 5).all()
    assert (ids[masked] == 4).all()


def test_synthetic_samples_depend_only_on_seed_and_position():
    data = FAMILIES["bert"].data_defaults
    a, b = SyntheticPretraining(64, 1000, 3, data), SyntheticPretraining(64, 1000, 3, data)
    assert all(np.array_equal(a[p]["input_ids"], b[p]["input_ids"]) for p in (0, 7, 10**6))
    assert not np.array_equal(a[0]["input_ids"], SyntheticPretraining(64, 1000, 4, data)[0]["input_ids"])


@pytest.mark.parametrize("args, message", [
    (["--variants", "a,x"], "--variants"),
    (["--seq-len", "128,abc"], "--seq-len"),
    (["--seq-len", "1024"], "--seq-len"),
    (["--preset", "huge"], "preset"),
    (["--preset", "tiny,modernbert-tiny"], "one model family per run"),
    (["--preset", "modernbert-tiny", "--variants", "a,e"], "--variants"),
    (["--preset", "modernbert-tiny", "--seq-len", "2048"], "--seq-len must be in [8, 1024]"),
    (["--data", "/nonexistent/data"], "--data"),
])
def test_bad_settings_are_one_line_errors(args, message, capsys):
    assert bench.main([*SMOKE, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_one_line_error(capsys):
    assert bench.main([*SMOKE, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "CUDA" in err[0]


def test_modernbert_runs_beside_transformers_modernbert_with_its_figures(tmp_path):
    from bert_ds.model.families import model_preset
    from bert_ds.model.flops import training_flops

    proc = run_cli("bert_ds.tools.bench", *MODERNBERT_SMOKE, "--threads", "1", "--json", str(tmp_path / "m.json"),
                   "--markdown", str(tmp_path / "m.md"))
    assert (tmp_path / "m.md").read_text().strip() == proc.stdout.strip()
    assert proc.stdout.startswith("# ModernBERT pretraining throughput") and "## Projection" not in proc.stdout
    rows = _table_rows(proc.stdout)
    assert [row[0][:3] for row in rows] == ["(a)", "(b)", "(c)", "(f)"]
    for row in rows[:3]:  # ms/step, tokens/s, vs (c), data wait, TFLOP/s, MFU vs matmul: measured, > 0
        assert all(_number(row[i]) > 0 for i in (2, 3, 4, 7, 9)), row
        assert row[5] == "n/a" and row[8] == "n/a" and row[10] == "n/a"  # no (f), no datasheet peak, no GPU memory
    result = json.loads((tmp_path / "m.json").read_text())
    assert result["arch"] == "modernbert" and result["goals"] == [] and result["projection"] is None
    (config,) = result["configs"]
    figures, check = config["results"], config["loss_check"]
    flash = "flash-attn package is not installed" if importlib.util.find_spec("flash_attn") is None else "CUDA"
    assert flash in figures["f"]["not_run"]  # said plainly, in the row and the JSON
    assert "| (f) transformers ModernBertForMaskedLM: flash_attention_2, padded, fused AdamW | not run: " in proc.stdout
    for key in "abc":
        x = figures[key]
        for name in ("ms_per_step", "real_tokens_per_s", "useful_tflops", "mfu_vs_matmul", "speedup_vs_transformers"):
            assert x[name] > 0, (key, name)
        assert x["peak_memory_gib"] is None and x["speedup_vs_flash_attention_2"] is None
        assert abs(x["first_batch_loss"] - check["fp32"]) <= check["tolerance"]
    assert check["precision"] == "fp32" and check["tolerance"] == pytest.approx(1e-4 * check["fp32"])
    assert f"gives {check['fp32']:.6f} in fp32; every variant below is within" in proc.stdout  # one fp32 figure
    assert figures["a"]["optimizer"] == "stable_adamw" and figures["c"]["kernels"] == "SDPA"
    # MFU by the one accounting, the local layers credited with their windows' pairs only
    b = config["batches"]
    assert 0 < b["local_pairs_per_step"] < b["sum_sq_len_per_step"]
    cfg = model_preset("modernbert-tiny", 2048)
    useful = training_flops(cfg, b["real_tokens_per_step"], b["sum_sq_len_per_step"], b["masked_per_step"],
                            b["local_pairs_per_step"])
    assert b["useful_gflop_per_step"] == pytest.approx(useful / 1e9)
    assert b["masked_per_step"] / b["real_tokens_per_step"] == pytest.approx(0.3, abs=0.02)  # ModernBERT's rate
    assert figures["a"]["mfu_vs_matmul"] == pytest.approx(figures["a"]["useful_tflops"] / result["probes"]["matmul_tflops"])


def test_modernbert_s_compiled_variant_is_its_model_with_the_layers_compiled():
    """(d) for ModernBERT, as for BERT: (a)'s model and weights with every encoder layer under
    torch.compile (compiled at its first step, which this does not run: a minute on a CPU)."""
    from bert_ds.model.families import model_preset
    from bert_ds.model.modernbert.model import ModernBertForPreTraining

    cfg = model_preset("modernbert-tiny", 2048)
    weights = ModernBertForPreTraining(cfg).state_dict()
    v = FAMILIES["modernbert"].bench.variants["d"]
    model, ran = bench_variants.bert_ds_model(v, cfg, weights, torch.device("cpu"), 64)
    assert model.config.compile_layers and ran == "layers compiled; attention: torch"
    assert all(torch.equal(model.state_dict()[name], w) for name, w in weights.items())
    assert (v.optimizer, v.kernels) == ("stable_adamw", "auto") and "d" not in FAMILIES["modernbert"].bench.default_variants


def test_a_planted_weight_mismatch_is_refused_before_it_is_timed(monkeypatch, tmp_path, capsys):
    real = bench_variants.transformers_model

    def planted(v, cfg, weights, device):  # transformers gets a decoder bias ours does not have
        return real(v, cfg, {**weights, "decoder.bias": weights["decoder.bias"] + 1.0 * torch.randn(cfg.vocab_size)},
                    device)

    timed = []
    monkeypatch.setattr(bench_variants, "transformers_model", planted)
    monkeypatch.setattr(bench_variants, "time_variant", lambda *args: timed.append(args) or pytest.fail("timed"))
    assert bench.main([*MODERNBERT_SMOKE, "--variants", "c", "--no-probes", "--json", str(tmp_path / "m.json")]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("error: modernbert-tiny at seq 64: (c) transformers ModernBertForMaskedLM: SDPA")
    assert "first-batch loss of" in err and "fp32 allows" in err and "same weights" in err
    assert not timed and not (tmp_path / "m.json").exists()


def test_the_loss_check_allows_twice_the_references_own_error_and_the_precisions_slack():
    from bert_ds.tools.bench_variants import LOSS_SLACK, LossCheck, LossMismatch

    v = FAMILIES["modernbert"].bench.variants["c"]
    tolerance = 2 * 0.003 + LOSS_SLACK["bf16"] * 10.0
    check = LossCheck(fp32=10.0, run_precision=10.003, precision="bf16", tolerance=tolerance)
    check.hold(v, 10.0 + 0.99 * tolerance, "here")
    for wrong in (10.0 + 1.01 * tolerance, 10.0 - 1.01 * tolerance, float("nan")):
        with pytest.raises(LossMismatch, match="bf16 allows"):
            check.hold(v, wrong, "here")


def test_modernbert_goal_is_against_flash_attention_2_and_says_when_it_is_not_measured():
    def config(f):
        results = {"a": {"speedup_vs_flash_attention_2": 1.6}, "c": {}, **({"f": f} if f is not None else {})}
        return {"preset": "modernbert-base", "seq_len": 1024, "results": results}

    result = {"settings": {"device": "cuda"}}
    (met,) = bench.goals({**result, "configs": [config({"real_tokens_per_s": 1.0})]})
    assert (met["measured"], met["met"]) == ("1.60x", True) and "flash_attention_2 at seq 1024" in met["goal"]
    (unknown,) = bench.goals({**result, "configs": [config({"not_run": "the flash-attn package is not installed"})]})
    assert unknown["met"] is None and unknown["measured"] == "not measured: (f) not run: the flash-attn package is not installed"
    assert bench.met_text(None) == "not measured"
    at_8192 = {**config(None), "seq_len": 8192}
    assert bench.goals({**result, "configs": [at_8192]}) == []


def test_modernbert_reads_real_shards_as_documents(sample_data, tmp_path):
    bench.main([*MODERNBERT_SMOKE, "--steps", "1", "--warmup", "0", "--data", str(sample_data["train"]),
                "--variants", "b,c", "--no-probes", "--json", str(tmp_path / "m.json")])
    (config,) = json.loads((tmp_path / "m.json").read_text())["configs"]
    assert config["source"].startswith("real shards") and set(config["results"]) == {"b", "c"}
    assert config["batches"]["masked_per_step"] > 0 and config["results"]["c"]["real_tokens_per_s"] > 0
