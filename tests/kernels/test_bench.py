"""kernels.bench's CPU-side behaviour: its message without a GPU, its report and its padding."""

import pytest
import torch

from kernels import bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the bench would run")
def test_without_a_gpu_the_bench_says_so_and_succeeds(capsys):
    assert bench.main([]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and "GPU" in out


def test_unknown_ops_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--ops", "layer_norm,softmax"])


def test_report_lists_rates_fractions_speedups_and_refusals():
    env = {"device": "H100", "driver": "550.1", "torch": "2.11", "cuda": "13.0", "git_commit": "abc123def4567",
           "git_dirty": False}
    rows = [
        {"op": "layer_norm", "model": "base", "shape": "s", "impl": "torch eager", "pass": "forward", "ms": 0.2,
         "rate": 500.0, "unit": "GB/s", "fraction_of_peak": 0.2, "note": ""},
        {"op": "layer_norm", "model": "base", "shape": "s", "impl": "fused", "pass": "forward", "ms": 0.05,
         "rate": 2000.0, "unit": "GB/s", "fraction_of_peak": 0.8, "note": ""},
        {"op": "varlen_attention", "model": "base", "shape": "a", "impl": "sdpa cuDNN", "pass": "forward",
         "ms": None, "rate": None, "unit": "TFLOP/s", "fraction_of_peak": None, "note": "No available kernel"},
    ]
    text = bench.markdown({"environment": env, "device_probes": {"copy_gb_per_s": 2500.0, "matmul_tflops": 700.0},
                           "dtype": "bf16", "rows": rows})
    assert "| 0.050 | 2000.0 GB/s | 80% | 4.00x |" in text
    assert "refused: No available kernel" in text
    assert "copy 2500 GB/s" in text and "commit abc123def456" in text


def test_padding_puts_each_sequence_at_the_start_of_its_row():
    x = torch.arange(6 * 2, dtype=torch.float32).view(6, 1, 2)  # (T=6, nh=1, hd=2)
    padded = bench._padded(x, [2, 4], 4)  # (B=2, nh=1, S=4, hd=2)
    assert padded.shape == (2, 1, 4, 2)
    assert torch.equal(padded[0, 0, :2], x[:2, 0]) and torch.equal(padded[0, 0, 2:], torch.zeros(2, 2))
    assert torch.equal(padded[1, 0], x[2:, 0])


def test_loader_lengths_are_mostly_full():
    lengths = bench.loader_lengths(1000, 512, torch.Generator().manual_seed(0))
    assert 0.85 < sum(L == 512 for L in lengths) / 1000 < 0.95 and min(lengths) >= 2
