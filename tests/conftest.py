"""Shared fixtures: a small real dataset built from the bundled sample corpus,
and helpers that run the entry points the way a user does (as processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "data_tools" / "sample"


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed must not probe for CUDA in CPU tests
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_cli(*args: str, timeout: float = 600, check: bool = True, nproc: int = 1,
            launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """Run ``python -m ARGS`` (``nproc`` > 1: under torchrun or the deepspeed launcher)."""
    cmd = [sys.executable, "-m"]
    if nproc > 1 and launcher == "torchrun":
        cmd += ["torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"]
    elif nproc > 1:
        port = str(20000 + os.getpid() % 20000)
        cmd += ["deepspeed.launcher.runner", f"--num_gpus={nproc}", f"--master_port={port}", "--module"]
    proc = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=cli_env(), cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory) -> dict[str, Path]:
    """Train and held-out shards from the sample corpus, with a 2,048-token vocabulary."""
    root = tmp_path_factory.mktemp("sample-data")
    run_cli("data_tools", "build", "--input", str(SAMPLE / "valid.txt"), "--output", str(root / "train"),
            "--train-vocab", "2048", "--split-sentences", "--workers", "1")
    run_cli("data_tools", "build", "--input", str(SAMPLE / "test.txt"), "--output", str(root / "heldout"),
            "--vocab", str(root / "train" / "vocab.txt"), "--split-sentences", "--workers", "1")
    return {"train": root / "train", "heldout": root / "heldout"}
