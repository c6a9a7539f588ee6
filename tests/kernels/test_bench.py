"""bert_ds.kernels.bench's CPU-side behaviour: its message without a GPU, its report, the work each op
does per call, its roofline arithmetic and its padding."""

import pytest
import torch

from bert_ds.kernels import bench, bench_cases, bench_work
from bert_ds.kernels.local_attention import local_pairs


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the bench would run")
def test_without_a_gpu_the_bench_says_so_and_succeeds(capsys):
    assert bench.main([]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and "GPU" in out


def test_unknown_ops_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--ops", "layer_norm,softmax"])


ENV = {"device": "H100", "driver": "550.1", "torch": "2.11", "cuda": "13.0", "git_commit": "abc123def4567",
       "git_dirty": False}
PROBES = {"copy_gb_per_s": 2500.0, "matmul_tflops": 700.0}


def test_report_lists_rates_fractions_speedups_and_refusals():
    rows = [
        {"op": "layer_norm", "model": "base", "shape": "s", "impl": "torch eager", "pass": "forward", "ms": 0.2,
         "flops": 8e6, "bytes": 1e8, "rate": 500.0, "unit": "GB/s", "fraction_of_peak": 0.2, "note": ""},
        {"op": "layer_norm", "model": "base", "shape": "s", "impl": "fused", "pass": "forward", "ms": 0.05,
         "flops": 8e6, "bytes": 1e8, "rate": 2000.0, "unit": "GB/s", "fraction_of_peak": 0.8, "note": ""},
        {"op": "varlen_attention", "model": "base", "shape": "a", "impl": "sdpa cuDNN", "pass": "forward",
         "ms": None, "flops": 7e9, "bytes": 1e6, "rate": None, "unit": "TFLOP/s", "fraction_of_peak": None,
         "note": "No available kernel"},
    ]
    text = bench.markdown({"environment": ENV, "device_probes": PROBES, "dtype": "bf16", "rows": rows})
    assert "| 0.050 | 2000.0 GB/s | 80% | 4.00x |" in text
    assert "refused: No available kernel" in text
    assert "copy 2500 GB/s" in text and "commit abc123def456" in text


# --------------------------------------------------------------------------- work and roofline

def test_layer_norm_work_counts_each_input_and_output_once():
    # 10 x 8 bf16: x, residual, y = 3 * 160 B; weight, bias 2 * 16 B; mean, rstd 2 * 40 B
    fwd = bench_work.layer_norm_work(10, 8, 2, "forward")
    assert fwd == bench_work.Work(flops=8 * 80, bytes=480 + 32 + 80)
    # backward: dy, x, residual, dx 4 * 160 B; mean, rstd 80 B; weight 16 B; dweight, dbias 32 B
    both = bench_work.layer_norm_work(10, 8, 2, "forward+backward")
    assert both == bench_work.Work(flops=20 * 80, bytes=592 + 640 + 80 + 16 + 32)


def test_dropout_add_layer_norm_work_counts_each_input_and_output_once():
    # 10 x 8 bf16: x, residual, y = 3 * 160 B; bias, weight, ln_bias 3 * 16 B; mean, rstd 2 * 40 B; no mask
    fwd = bench_work.dropout_add_layer_norm_work(10, 8, 2, "forward")
    assert fwd == bench_work.Work(flops=10 * 80, bytes=480 + 48 + 80)
    # backward: dy, x, residual, dx, dresidual 5 * 160 B; mean, rstd 80 B; bias, weight 32 B; three dparams 48 B
    both = bench_work.dropout_add_layer_norm_work(10, 8, 2, "forward+backward")
    assert both == bench_work.Work(flops=24 * 80, bytes=608 + 800 + 80 + 32 + 48)


def test_bias_gelu_work_counts_each_input_and_output_once():
    # 4 x 6 fp32: x and y 2 * 96 B + bias 24 B; backward dy, x, dx 3 * 96 B + bias and dbias 48 B
    assert bench_work.bias_gelu_work(4, 6, 4, "forward") == bench_work.Work(6 * 24, 216)
    assert bench_work.bias_gelu_work(4, 6, 4, "forward+backward") == bench_work.Work(19 * 24, 216 + 336)


def test_attention_work_counts_useful_flops_of_unpadded_sequences():
    # lengths 3 and 5, 2 heads of 4, fp16: 4 * 2 * 4 * (9 + 25) FLOPs; 8 tokens * 2 * 4 * 2 B = 128 B a tensor
    fwd = bench_work.attention_work([3, 5], 2, 4, 2, "forward")
    assert fwd == bench_work.Work(1088, 4 * 128 + 64)
    assert bench_work.attention_work([3, 5], 2, 4, 2, "forward+backward") == bench_work.Work(3.5 * 1088, 12 * 128 + 128)


def test_windowed_attention_work_counts_the_pairs_within_the_window_as_done():
    # a window of 1 in sequences of 3 and 5: 7 and 13 pairs (local_attention.local_pairs), against 9 + 25
    pairs = int(local_pairs(torch.tensor([3, 5]), 1).sum())
    assert pairs == 20
    assert bench_work.attention_work([3, 5], 2, 4, 2, "forward", pairs) == bench_work.Work(32 * 20, 4 * 128 + 64)


def test_geglu_work_reads_both_halves_and_writes_both_gradients():
    # 4 rows of 2 x 6 bf16: x 96 B, y 48 B; backward dy 48 B, x 96 B in, dx 96 B out
    assert bench_work.geglu_work(4, 6, 2, "forward") == bench_work.Work(7 * 24, 144)
    assert bench_work.geglu_work(4, 6, 2, "forward+backward") == bench_work.Work(18 * 24, 144 + 240)


def test_modernbert_cases_time_every_candidate_of_their_ops():
    """GeGLU at ModernBERT-base's width, the local attention at its window with each of the op's
    candidates (its native one aside: varlen_attn or the reference, timed as themselves)."""
    from bert_ds.kernels import local_attention

    shape, impls, inputs, grad, work = bench_cases.geglu_cases("base", 8, torch.float32, "cpu")
    assert inputs[0].shape == (8, 2 * 1152) and grad.shape == (8, 1152) and "2 x 1152" in shape
    assert set(impls) == {"fused", "torch eager", "torch native"}
    torch.testing.assert_close(impls["torch native"](*inputs), impls["torch eager"](*inputs))
    shape, impls, work = bench_cases.local_attention_cases("base", 300, torch.float32, 150, "cpu")
    assert set(impls) == {"torch eager", *local_attention.IMPLEMENTATIONS} - {"native"} and "window +-64" in shape
    fn, (q, k, v), grad = impls["torch eager"]
    assert q.shape[1:] == (12, 64) and fn(q, k, v).shape == q.shape
    assert work["forward"].flops < bench_work.attention_work([q.shape[0]], 12, 64, 4, "forward").flops


def test_mlm_cross_entropy_work_counts_each_input_and_output_once():
    # 3 x 8 bf16 logits 48 B, int64 labels 24 B, loss and count 16 B; backward: logits read 48 B and
    # their gradient written 48 B, labels 24 B, lse 12 B, the sum's gradient 4 B
    assert bench_work.mlm_cross_entropy_work(3, 8, 2, "forward") == bench_work.Work(4 * 24, 48 + 24 + 16)
    assert bench_work.mlm_cross_entropy_work(3, 8, 2, "forward+backward") == bench_work.Work(
        8 * 24, 88 + 96 + 24 + 12 + 4)


def test_unknown_pass_is_refused():
    with pytest.raises(ValueError, match="backward"):
        bench_work.layer_norm_work(1, 8, 2, "backward")


def test_roofline_bound_is_the_slower_of_compute_and_memory():
    device = {"matmul_tflops": 100.0, "copy_gb_per_s": 1000.0}
    # 1 TFLOP at 100 TFLOP/s: 10 ms; 1 GB at 1000 GB/s: 1 ms
    assert bench_work.roofline(bench_work.Work(1e12, 1e9), device) == {"compute_ms": 10.0, "memory_ms": 1.0,
                                                            "bound_ms": 10.0, "limit": "compute"}
    line = bench_work.roofline(bench_work.Work(1e9, 4e9), device)
    assert line["bound_ms"] == pytest.approx(4.0) and line["limit"] == "memory"


def test_roofline_table_lists_ours_and_the_attention_alternatives_beside_measured_times():
    def row(impl, ms, note=""):
        return {"op": "varlen_attention", "model": "base", "shape": "a", "pass": "forward", "impl": impl, "ms": ms,
                "flops": 7e9, "bytes": 2.5e8, "rate": None, "unit": "TFLOP/s", "fraction_of_peak": None, "note": note}
    rows = [row("fused", 0.25), row("varlen_attn", 0.15), row("torch eager", 1.0),
            row("sdpa cuDNN", None, "No available kernel")]
    text = bench.roofline_table({"device_probes": PROBES, "rows": rows})
    # 7 GFLOP at 700 TFLOP/s: 0.01 ms; 250 MB at 2500 GB/s: 0.1 ms -> memory-bound at 0.1 ms
    assert "| fused | 7.000 | 250.00 | 0.0100 | 0.1000 | memory | 0.250 | 2.50x |" in text
    assert "| varlen_attn | 7.000 | 250.00 | 0.0100 | 0.1000 | memory | 0.150 | 1.50x |" in text
    assert "| sdpa cuDNN |" in text and "refused: No available kernel" in text
    assert "torch eager" not in text  # the roofline lines are for the fastest candidates only


def test_padding_puts_each_sequence_at_the_start_of_its_row():
    x = torch.arange(6 * 2, dtype=torch.float32).view(6, 1, 2)  # (T=6, nh=1, hd=2)
    padded = bench_cases._padded(x, [2, 4], 4)  # (B=2, nh=1, S=4, hd=2)
    assert padded.shape == (2, 1, 4, 2)
    assert torch.equal(padded[0, 0, :2], x[:2, 0]) and torch.equal(padded[0, 0, 2:], torch.zeros(2, 2))
    assert torch.equal(padded[1, 0], x[2:, 0])


def test_loader_lengths_are_mostly_full():
    lengths = bench_cases.loader_lengths(1000, 512, torch.Generator().manual_seed(0))
    assert 0.85 < sum(L == 512 for L in lengths) / 1000 < 0.95 and min(lengths) >= 2
