"""Compiles every ``kernels/csrc/*.cu`` with nvcc alone, for sm_80 and sm_90: the CI
check that a kernel change still builds, on a machine without a GPU or a CUDA torch.

    python -m kernels.compile_check [--verbose]

Each file is compiled to an object in a temporary directory, one nvcc at a time, with
the defines torch's extension builder adds (no implicit half/bfloat16 conversions,
relaxed constexpr), every warning an error, and ``-Xptxas -v``; one line per file and
architecture sums up ptxas (kernels, largest register count, shared memory, spills).
The two architectures are compiled under the two C++ standards torch has built
extensions with (sm_80: c++17, sm_90: c++20), so both are covered at no extra cost.

Exit status 0 when everything compiles, or when nvcc is not found (it says so and
skips: CPU machines without a toolkit cannot check); 1 when anything fails.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
TARGETS = (("80", "c++17"), ("90", "c++20"))  # (sm, C++ standard)
TORCH_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr",
)


def find_nvcc() -> str | None:
    """nvcc on PATH, else in $CUDA_HOME/bin or $CUDA_PATH/bin (torch's convention)."""
    found = shutil.which("nvcc")
    if found:
        return found
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(variable)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


@dataclass
class Result:
    source: str
    arch: str
    ok: bool
    summary: str
    output: str


def compile_one(nvcc: str, source: Path, arch: str, std: str, out_dir: Path) -> Result:
    cmd = [nvcc, f"-std={std}", "-O3", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           *TORCH_DEFINES, "-Werror", "all-warnings", "-Xptxas", "-v", "-Xcompiler", "-fPIC",
           f"-I{CSRC}", "-c", str(source), "-o", str(out_dir / f"{source.stem}.sm_{arch}.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        errors = [line for line in output.splitlines() if re.search(r"error|warning", line, re.IGNORECASE)]
        return Result(source.name, arch, False, (errors or ["nvcc failed"])[0].strip(), output)
    return Result(source.name, arch, True, _ptxas_summary(output), output)


def _ptxas_summary(output: str) -> str:
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", output)]
    smem = [int(n) for n in re.findall(r"(\d+) bytes smem", output)]
    spills = [(int(s), int(l)) for s, l in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", output)]
    spilling = [s for s in spills if s != (0, 0)]
    text = f"{len(registers)} kernels, max {max(registers, default=0)} registers, max {max(smem, default=0)} B smem"
    if spilling:
        worst = max(spilling)
        text += f", {len(spilling)} spilling (worst {worst[0]} B stores / {worst[1]} B loads)"
    else:
        text += ", no spills"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true", help="print nvcc's full output")
    args = parser.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("compile_check: nvcc not found (PATH, CUDA_HOME, CUDA_PATH); skipping the CUDA compile check")
        return 0
    sources = sorted(CSRC.glob("*.cu"))
    if not sources:
        print(f"compile_check: no .cu files in {CSRC}", file=sys.stderr)
        return 1
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"compile_check: {nvcc} ({version[-1] if version else 'unknown version'})")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="bds-compile-check-") as tmp:
        for source in sources:
            for arch, std in TARGETS:
                result = compile_one(nvcc, source, arch, std, Path(tmp))
                failed += not result.ok
                print(f"  {result.source:16s} sm_{arch} {std}  {'ok  ' if result.ok else 'FAIL'}  {result.summary}")
                if args.verbose or not result.ok:
                    print(result.output.rstrip(), file=sys.stdout if result.ok else sys.stderr)
    print(f"compile_check: {len(sources) * len(TARGETS) - failed} of {len(sources) * len(TARGETS)} compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
