"""The CUDA sources compile with nvcc for sm_80 and sm_90 and the binding with the host
compiler as torch builds it (CPU CI with a toolkit), and the extension's pieces agree
with each other without building it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.kernels import compile_check

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "kernels" / "csrc"


def _run_compile_check(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bert_ds.kernels.compile_check", *args], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=900)


@pytest.mark.long
@pytest.mark.skipif(compile_check.find_nvcc() is None, reason="nvcc not found")
def test_the_check_compiles_the_binding_for_the_host():
    """The command and its report on the binding. Its report on a kernel source for sm_80 and
    sm_90 is checked by test_gpu_checks' rehearsal (its kernels_build step compiles lamb.cu
    with this command); that every source compiles for both architectures with these flags is
    test_static's test_every_source_compiles_for_both_archs."""
    proc = _run_compile_check(dict(os.environ), "--sources", "bindings.cpp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    blocker = compile_check.host_compile_blocker()
    binding = (rf"bindings\.cpp\s+skipped: {re.escape(blocker)}" if blocker
               else r"bindings\.cpp\s+host c\+\+\d+\s+ok\s+-Wall -Wextra -Werror")
    assert re.search(binding, proc.stdout), proc.stdout


def test_compile_check_skips_without_nvcc():
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = str(Path(sys.executable).parent)  # python, but no nvcc
    proc = _run_compile_check(env)
    assert proc.returncode == 0 and "skipping" in proc.stdout


def test_bindings_call_every_launcher_declared_in_the_header():
    declared = set(re.findall(r"\b(bds_\w+)\(", (CSRC / "launchers.h").read_text()))
    bindings = (CSRC / "bindings.cpp").read_text()
    defined = set()
    for cu in CSRC.glob("*.cu"):
        defined |= set(re.findall(r'extern "C" \w+ (bds_\w+)\(', cu.read_text()))
    assert declared == defined, f"declared but not defined: {declared - defined}; undeclared: {defined - declared}"
    assert not [name for name in declared if name not in bindings], "a launcher no binding calls"


def test_extension_sources_are_all_in_the_build_list():
    from bert_ds.kernels import _build

    on_disk = {p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cpp")}
    assert on_disk == set(_build.SOURCES)
