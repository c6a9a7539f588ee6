"""benchmarks/gpu_checks.sh: where no GPU is visible it says so in one line and runs nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_checks.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would run every check")
def test_without_a_gpu_the_script_refuses_in_one_line(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"gpu_checks.sh: no CUDA device is visible to {sys.executable}"]
    assert not out.exists()


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
