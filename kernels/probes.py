"""What a device can do, measured now, and what it is: the reference points of every bench.

Both benches (``bert_ds.kernels.bench`` per op, ``bert_ds.tools.bench`` per training step) express
their rates as fractions of two probes measured in the same process, on the same
device, right before or after the figures they judge:

- a square matmul (bf16 8192^3 on CUDA, fp32 2048^3 on CPU: each large enough to
  reach its device's dense peak), for compute-bound work;
- a device-to-device copy (1 GiB on CUDA, 64 MiB on CPU), counted as bytes read plus
  bytes written, for memory-bound work.

Each probe is the best of several timed repetitions after one untimed call, so that
start-up and a passing burst of load elsewhere do not lower the reference.
:func:`environment` records what a result needs to be compared later: device,
driver, versions, git commit.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bert_ds.kernels import _build

# (matrix size, dtype) of the matmul probe, and copy size in MiB, per device type.
MATMUL_PROBE = {"cpu": (2048, torch.float32), "cuda": (8192, torch.bfloat16)}
COPY_PROBE_MIB = {"cpu": 64, "cuda": 1024}
REPS = {"cpu": 3, "cuda": 20}
_REPO = Path(__file__).resolve().parents[1]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Seconds of the fastest of ``reps`` calls, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_tflops(device: torch.device) -> tuple[float, str]:
    """TFLOP/s of the device's matmul probe, and what it multiplied (e.g. "bfloat16 8192^3")."""
    n, dtype = MATMUL_PROBE[device.type]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    seconds = best_seconds(lambda: a @ b, device, REPS[device.type])
    return 2 * n**3 / seconds / 1e12, f"{str(dtype).removeprefix('torch.')} {n}^3"


def copy_gb_per_s(device: torch.device) -> float:
    """GB/s (read + write) of the device's copy probe."""
    numel = COPY_PROBE_MIB[device.type] * 2**20 // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), device, REPS[device.type])
    return 2 * numel * 4 / seconds / 1e9


def measure(device: torch.device) -> dict[str, Any]:
    """Both probes: ``matmul_tflops``, ``matmul`` (its shape and dtype) and ``copy_gb_per_s``."""
    tflops, what = matmul_tflops(device)
    return {"matmul_tflops": tflops, "matmul": what, "copy_gb_per_s": copy_gb_per_s(device)}


def best_of(*probes: dict[str, Any]) -> dict[str, Any]:
    """The higher of each figure over several :func:`measure` results (e.g. before and after a run)."""
    return {"matmul": probes[0]["matmul"],
            **{key: max(p[key] for p in probes) for key in ("matmul_tflops", "copy_gb_per_s")}}


def _command(*cmd: str) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=_REPO, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(device: torch.device) -> dict[str, Any]:
    """Device, driver, versions and git commit: what a result needs to be compared with another."""
    dirty = _command("git", "status", "--porcelain", "--untracked-files=no")
    env: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "git_commit": _command("git", "rev-parse", "HEAD"), "git_dirty": None if dirty is None else bool(dirty),
        "extension_source_hash": _build.source_hash(),
    }
    if device.type == "cuda":
        driver = _command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        env.update(device=torch.cuda.get_device_name(device),
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                   driver=driver.splitlines()[0] if driver else None, cuda=torch.version.cuda)
    else:
        env.update(device=f"CPU ({env['cpu']}, {env['threads']} threads)", capability=None, driver=None, cuda=None)
    return env
