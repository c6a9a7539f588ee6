"""Compile checks of the fused kernels that need no GPU: the CI check that a kernel
change still builds, and a user's check of the build before renting a GPU.

    python -m bert_ds.kernels.compile_check [--verbose] [--sources lamb.cu,bindings.cpp]
    python -m bert_ds.kernels.compile_check --with-torch [--index-url URL]

Without options (fast, no download; part of the test suite):

- every ``kernels/csrc/*.cu`` with nvcc alone, for sm_80 and sm_90, each to an object
  in a temporary directory, with the defines torch's extension builder adds (no
  implicit half/bfloat16 conversions, relaxed constexpr), every warning an error, and
  ``-Xptxas -v``; one line per file and architecture sums up ptxas (kernels, largest
  register count, shared memory, spills). The two architectures are compiled under the
  two C++ standards torch has built extensions with (sm_80: c++17, sm_90: c++20), so
  both are covered at no extra cost;
- ``csrc/bindings.cpp`` with the host compiler, from the compile rule and flags torch's
  extension builder writes for it (the installed torch's headers, the toolkit's), with
  ``-Wall -Wextra -Werror``. Against a CPU-only torch this is as close as a compile
  gets: of the ~4,850 headers the binding includes, the CPU wheel of torch 2.13 differs
  from the CUDA one only in lacking ``c10/cuda/impl/cuda_cmake_macros.h`` (generated;
  its one define matters on Windows only), which is skipped with torch's own switch
  ``C10_CUDA_NO_CMAKE_CONFIGURE_FILE``. Linking needs the CUDA build of torch.

``--with-torch`` (slow once: about 5 GB installed): builds the extension exactly as a
GPU user's first run does. It prepares, once, a separate environment with the CUDA
build of the installed torch's version (from PyPI, whose Linux torch is the CUDA build;
``--index-url`` for a mirror or another CUDA), cached under
``~/.cache/bert-ds/torch-cuda/<torch>-<cuXYZ>`` with the tag of the installed toolkit;
then, in that environment and with ``CUDA_HOME`` at the toolkit, builds and imports the
extension through ``bert_ds.kernels._build.build_into`` (the loader's own build, in a fresh
directory) and checks that every op refuses CPU tensors with the binding's one-line
error. No GPU is needed. It prints what it did and how long each part took.

Exit status 0 when everything compiles, or when nvcc is not found without
``--with-torch`` (it says so and skips: CPU machines without a toolkit cannot check); 1
when anything fails; 2 (``error: ...``) when ``--with-torch`` lacks the toolkit or
cannot install torch.
"""

import argparse
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import UserError, guarded
from bert_ds.kernels import _build

REPO = Path(__file__).resolve().parents[1]
CSRC = Path(__file__).resolve().parent / "csrc"
TARGETS = (("80", "c++17"), ("90", "c++20"))  # (sm, C++ standard)
TORCH_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr",
)
STRICT_WARNINGS = ("-Wall", "-Wextra", "-Werror")
# Generated when torch is built with CUDA, so missing from the CPU wheel (module docstring).
CUDA_MACROS_HEADER = Path("c10", "cuda", "impl", "cuda_cmake_macros.h")
PYPI = "https://pypi.org/simple"
# Besides torch: what the JIT build needs (ninja; setuptools, which cpp_extension
# imports) and numpy, without which torch warns at import.
ENV_PACKAGES = ("ninja", "setuptools", "numpy")


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


def toolkit_root() -> Path | None:
    """The CUDA toolkit's root: $CUDA_HOME or $CUDA_PATH as torch reads them, else asked
    of nvcc itself (``--dryrun`` names its TOP), which sees through a wrapper script on
    PATH where torch's guess (nvcc's grandparent directory) would not."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(variable)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return Path(root)
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    dryrun = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True)
    top = re.search(r"^#\$ TOP=(.+)$", dryrun.stdout + dryrun.stderr, re.MULTILINE)
    return Path(top[1].strip()).resolve() if top else Path(nvcc).resolve().parents[1]


@dataclass
class Result:
    source: str
    arch: str
    ok: bool
    summary: str
    output: str


# --------------------------------------------------------------------------- nvcc alone

def nvcc_flags(arch: str, std: str) -> list[str]:
    """How every kernel source is compiled for one architecture: torch's extension defines,
    every warning an error, ptxas's resource report (bert_ds.kernels.inspect adds its outputs)."""
    return [f"-std={std}", "-O3", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}", *TORCH_DEFINES,
            "-Werror", "all-warnings", "-Xptxas", "-v", f"-I{CSRC}"]


def compile_one(nvcc: str, source: Path, arch: str, std: str, out_dir: Path) -> Result:
    cmd = [nvcc, *nvcc_flags(arch, std), "-Xcompiler", "-fPIC", "-c", str(source),
           "-o", str(out_dir / f"{source.stem}.sm_{arch}.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return Result(source.name, arch, False, _first_problem(output, "nvcc failed"), output)
    return Result(source.name, arch, True, _ptxas_summary(output), output)


def _first_problem(output: str, fallback: str) -> str:
    """The compiler's first diagnostic ("x.cpp:3:7: error: ...", "x.cu(3): warning #177-D: ..."),
    else the first line that mentions one (paths may contain the words: last resort)."""
    for pattern in (r"\b(error|warning)\b[^:]{0,12}:", r"error|warning|fatal"):
        lines = [line.strip() for line in output.splitlines() if re.search(pattern, line, re.IGNORECASE)]
        if lines:
            return lines[0]
    return fallback


def _ptxas_summary(output: str) -> str:
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", output)]
    smem = [int(n) for n in re.findall(r"(\d+) bytes smem", output)]
    spills = [(int(stores), int(loads)) for stores, loads in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", output)]
    spilling = [s for s in spills if s != (0, 0)]
    text = (f"{len(registers)} kernels, max {max(registers, default=0)} registers, "
            f"max {max(smem, default=0)} B static smem")
    if spilling:
        worst = max(spilling)
        text += f", {len(spilling)} spilling (worst {worst[0]} B stores / {worst[1]} B loads)"
    else:
        text += ", no spills"
    return text


# --------------------------------------------------------------------------- the binding, host compiler

def host_compile_blocker() -> str:
    """Why the binding cannot be host-compiled here, or "" when it can."""
    from torch.utils import cpp_extension

    if toolkit_root() is None:
        return "no CUDA toolkit (the binding needs its headers)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed"
    return ""


def compile_bindings(out_dir: Path, source: Path = CSRC / "bindings.cpp") -> Result:
    """Compiles ``source`` (the binding, or a test's copy of it) to an object with the
    rule and flags torch's extension builder writes for the JIT build's C++ file, every
    warning an error. ``out_dir`` must exist; the build file and object land there."""
    import torch
    from torch.utils import cpp_extension

    options = _build.build_options(out_dir)
    flags = [*options["extra_cflags"], f"-isystem {shlex.quote(str(toolkit_root() / 'include'))}",
             *STRICT_WARNINGS]
    torch_headers = Path(cpp_extension.include_paths("cpu")[0])
    cpu_wheel = not (torch_headers / CUDA_MACROS_HEADER).is_file()
    if cpu_wheel:
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    # torch's own build-file writer (private, but what load() runs), so the defines,
    # include order, C++ standard and compile command are the JIT build's. with_cuda=False
    # spares a CPU-only torch the CUDA_HOME lookup it would refuse; the toolkit's headers
    # come in as the -isystem that include_paths("cuda") adds in a CUDA torch.
    cpp_extension._write_ninja_file_to_build_library(
        path=str(out_dir / "build.ninja"), name=options["name"], sources=[str(source)],
        extra_cflags=flags, extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=[],
        extra_include_paths=options["extra_include_paths"], with_cuda=False, with_sycl=False,
        is_standalone=False)
    proc = subprocess.run(["ninja", "-C", str(out_dir), f"{source.stem}.o"], capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    std = re.search(r"-std=(\S+)", (out_dir / "build.ninja").read_text())
    label = f"host {std[1] if std else ''}"
    if proc.returncode != 0:
        return Result(source.name, label, False, _first_problem(output, "the host compiler failed"), output)
    headers = f"torch {torch.__version__} headers" + (f" less {CUDA_MACROS_HEADER.name}" if cpu_wheel else "")
    return Result(source.name, label, True, f"{' '.join(STRICT_WARNINGS)}, {headers}", output)


# --------------------------------------------------------------------------- the default check

def source_paths(names: str | None) -> list[Path]:
    """``names`` ("lamb.cu,attention.cu"; None: every source) as paths in csrc/; a name that is not
    there is a UserError."""
    if not names:
        return sorted(CSRC.glob("*.cu")) + [CSRC / "bindings.cpp"]
    paths = [CSRC / name.strip() for name in names.split(",") if name.strip()]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise UserError(f"not in {CSRC}: {', '.join(missing)}")
    return paths


def check_sources(verbose: bool, sources: list[Path] | None = None) -> int:
    """Compiles ``sources`` (default: every .cu for both architectures, and the binding); one
    line each. The nvcc runs are independent and single-threaded: one per core."""
    nvcc = find_nvcc()
    if nvcc is None:
        print("compile_check: nvcc not found (PATH, CUDA_HOME, CUDA_PATH); skipping the CUDA compile check")
        return 0
    sources = sources or source_paths(None)
    kernels = [s for s in sources if s.suffix == ".cu"]
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"compile_check: {nvcc} ({version[-1] if version else 'unknown version'})")
    with tempfile.TemporaryDirectory(prefix="bds-compile-check-") as tmp:
        jobs = [(source, arch, std) for source in kernels for arch, std in TARGETS]
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            results = list(pool.map(lambda job: compile_one(nvcc, *job, Path(tmp)), jobs))
        for result, (_, arch, std) in zip(results, jobs):
            _print_result(result, f"sm_{arch} {std}", verbose)
        if any(s.name == "bindings.cpp" for s in sources):
            blocker = host_compile_blocker()
            if blocker:
                print(f"  {'bindings.cpp':16s} skipped: {blocker}")
            else:
                results.append(compile_bindings(Path(tmp)))
                _print_result(results[-1], results[-1].arch, verbose)
    passed = sum(result.ok for result in results)
    print(f"compile_check: {passed} of {len(results)} compiled")
    return 0 if passed == len(results) else 1


def _print_result(result: Result, label: str, verbose: bool) -> None:
    print(f"  {result.source:16s} {label}  {'ok  ' if result.ok else 'FAIL'}  {result.summary}")
    if verbose or not result.ok:
        print(result.output.rstrip(), file=sys.stdout if result.ok else sys.stderr)


# --------------------------------------------------------------------------- --with-torch

@dataclass
class TorchEnv:
    python: Path
    torch: str  # torch.__version__ there, e.g. 2.13.0+cu130
    cuda: str | None  # torch.version.cuda there


def with_torch(index_url: str) -> int:
    """Builds the extension in a CUDA torch environment, as a GPU user's first run would."""
    root = toolkit_root()
    if root is None:
        raise UserError("--with-torch needs a CUDA toolkit: nvcc on PATH, or CUDA_HOME naming the toolkit")
    cuda, tag = toolkit_version(root)
    version = installed_torch_release()
    directory = torch_env_dir(version, tag)
    print(f"compile_check --with-torch: torch {version} for CUDA {cuda} ({tag}); toolkit {root}")
    start = time.perf_counter()
    env, reused = prepare_torch_env(directory, version, cuda, index_url)
    how = "reused" if reused else f"created (torch from {index_url})"
    print(f"  environment   {time.perf_counter() - start:6.1f} s  {how}: {directory} (torch {env.torch})", flush=True)
    child = {**os.environ, "CUDA_HOME": str(root), "PYTHONPATH": str(REPO)}
    script = "import sys; from bert_ds.kernels.compile_check import check_torch_build; sys.exit(check_torch_build(sys.argv[1]))"
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time in directory/build
        proc = subprocess.run([str(env.python), "-c", script, str(directory / "build")], env=child, cwd=REPO)
    print(f"compile_check --with-torch: {'ok' if proc.returncode == 0 else 'FAILED'} "
          f"in {time.perf_counter() - start:.1f} s")
    return 1 if proc.returncode else 0


def toolkit_version(root: Path) -> tuple[str, str]:
    """The toolkit's CUDA release and wheel tag, e.g. ("13.0", "cu130")."""
    proc = subprocess.run([str(root / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
    release = re.search(r"release (\d+)\.(\d+)", proc.stdout)
    if release is None:
        raise UserError(f"cannot read the CUDA release of {root / 'bin' / 'nvcc'} (nvcc --version)")
    return f"{release[1]}.{release[2]}", f"cu{release[1]}{release[2]}"


def installed_torch_release() -> str:
    """The installed torch's version without its local tag (2.13.0+cpu -> 2.13.0)."""
    try:
        return metadata.version("torch").split("+")[0]
    except metadata.PackageNotFoundError:
        raise UserError("torch is not installed: --with-torch builds the CUDA build of the installed "
                        "torch's version") from None


def torch_env_dir(torch_release: str, cuda_tag: str) -> Path:
    return _build.cache_dir() / "torch-cuda" / f"{torch_release}-{cuda_tag}"


def prepare_torch_env(directory: Path, torch_release: str, cuda: str, index_url: str) -> tuple[TorchEnv, bool]:
    """The environment in ``directory`` with the CUDA build of torch ``torch_release``,
    made and filled the first time: ``(env, reused)``. It counts as made once torch in it
    is a CUDA build of ``cuda``'s major version (torch's builder refuses another major);
    until then each call resumes the install. Concurrent calls wait for the first."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready = _read_ready(directory)
        if ready is not None:
            return ready, True
        python = directory / "venv" / "bin" / "python"
        if not python.is_file():
            _run_logged([sys.executable, "-m", "venv", str(directory / "venv")], directory / "venv.log",
                        "cannot create a virtual environment")
        print(f"  installing torch=={torch_release} ({', '.join(ENV_PACKAGES)} beside it) from {index_url}, "
              "about 5 GB, once", flush=True)
        # --isolated: a find-links directory or extra index in the user's pip configuration
        # may hold torch==X+cpu, which pip prefers (a local version sorts above X).
        _run_logged([str(python), "-m", "pip", "install", "--isolated", "--index-url", index_url,
                     f"torch=={torch_release}", *ENV_PACKAGES], directory / "pip.log",
                    f"cannot install torch=={torch_release} from {index_url}")
        env = _probe(python)
        if env.cuda is None or env.cuda.split(".")[0] != cuda.split(".")[0]:
            raise UserError(f"torch {env.torch} from {index_url} is built for CUDA {env.cuda or 'none (CPU only)'}, "
                            f"the toolkit is CUDA {cuda}: pass --index-url https://download.pytorch.org/whl/cuXYZ "
                            f"for the toolkit's CUDA, or point CUDA_HOME at a matching toolkit")
        atomic_write(directory / "ready.json", json.dumps({"torch": env.torch, "cuda": env.cuda}))
        return env, False


def _read_ready(directory: Path) -> TorchEnv | None:
    python = directory / "venv" / "bin" / "python"
    try:
        recorded = json.loads((directory / "ready.json").read_text())
    except (OSError, ValueError):
        return None
    return TorchEnv(python, recorded["torch"], recorded["cuda"]) if python.is_file() else None


def _run_logged(cmd: list[str], log: Path, failure: str) -> None:
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        lines = log.read_text().splitlines()
        errors = [line.strip() for line in lines if line.startswith("ERROR")] or [line.strip() for line in lines[-1:]]
        raise UserError(f"{failure}: {errors[0] if errors else f'exit status {code}'} (log: {log})")


def _probe(python: Path) -> TorchEnv:
    script = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))"
    proc = subprocess.run([str(python), "-c", script], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"torch does not import in {python}: {_first_problem(proc.stderr, 'no output')}")
    version, cuda = json.loads(proc.stdout.splitlines()[-1])
    return TorchEnv(python, version, cuda)


# ------------------------------------------------- --with-torch, inside the CUDA torch environment

def check_torch_build(directory: str) -> int:
    """Builds and imports the extension in a fresh ``directory`` through the loader's own
    build, then checks that every op refuses CPU tensors. Runs in the CUDA torch
    environment (``with_torch`` starts it there)."""
    import torch

    build = Path(directory)
    shutil.rmtree(build, ignore_errors=True)  # a fresh build: the check compiles every time
    build.mkdir(parents=True)
    print(f"  torch {torch.__version__}, CUDA {torch.version.cuda}, CUDA_HOME {os.environ.get('CUDA_HOME')}, "
          f"GPU {'yes' if torch.cuda.is_available() else 'none'}, {os.cpu_count()} cores", flush=True)
    start = time.perf_counter()
    module, reason = _build.build_into(build)
    took = time.perf_counter() - start
    if module is None:
        print(f"  build+import  {took:6.1f} s  FAIL  {reason}")
        return 1
    if module.source_hash != _build.source_hash():
        print(f"  build+import  {took:6.1f} s  FAIL  source_hash {module.source_hash}, expected {_build.source_hash()}")
        return 1
    print(f"  build+import  {took:6.1f} s  ok: {module.__file__} (source_hash {module.source_hash})")
    start = time.perf_counter()
    problems, example = cpu_refusal_problems(module)
    took = time.perf_counter() - start
    if problems:
        print(f"  CPU tensors   {took:6.1f} s  FAIL  " + "; ".join(problems))
        return 1
    print(f"  CPU tensors   {took:6.1f} s  ok: every op refuses them in one line, e.g. {example!r}")
    return 0


def _cpu_calls() -> dict[str, Callable[[ModuleType], object]]:
    """One call per op of the binding, with CPU tensors of shapes it would otherwise take."""
    import torch

    x, w, stats = torch.randn(4, 8), torch.randn(8), torch.randn(4)
    q = torch.randn(4, 2, 64)
    lse, cu_seqlens = torch.randn(2, 4), torch.tensor([0, 4], dtype=torch.int32)
    return {
        "layer_norm_fwd": lambda m: m.layer_norm_fwd(x, w, w, None, 1e-5),
        "layer_norm_bwd": lambda m: m.layer_norm_bwd(x, x, None, w, stats, stats),
        "bias_gelu_fwd": lambda m: m.bias_gelu_fwd(x, w, False),
        "bias_gelu_bwd": lambda m: m.bias_gelu_bwd(x, x, w, False),
        "geglu_fwd": lambda m: m.geglu_fwd(x, False),
        "geglu_bwd": lambda m: m.geglu_bwd(x[:, :4], x, False),
        "varlen_attention_fwd": lambda m: m.varlen_attention_fwd(q, q, q, cu_seqlens, 4, 0.0, 0.125),
        "varlen_attention_bwd": lambda m: m.varlen_attention_bwd(q, q, q, q, q, lse, cu_seqlens, 4, 0.125),
    }


def cpu_refusal_problems(module: ModuleType) -> tuple[list[str], str]:
    """(what is wrong, one refusal's text): each op must raise the binding's own check,
    ``<input> must be a CUDA tensor, got one on cpu``, as one line."""
    calls = _cpu_calls()
    ops = {name for name in dir(module) if not name.startswith("_") and callable(getattr(module, name))}
    problems = [f"{name}: no CPU call written for it" for name in sorted(ops - set(calls))]
    problems += [f"{name}: not in the module" for name in sorted(set(calls) - ops)]
    example = ""
    for name in sorted(ops & set(calls)):
        try:
            calls[name](module)
        except RuntimeError as error:
            example = str(error)
            if not re.fullmatch(r"\w+ must be a CUDA tensor, got one on cpu", example):
                problems.append(f"{name}: refused with {example!r}")
        except Exception as error:  # a signature the call table got wrong, not a refusal
            problems.append(f"{name}: {type(error).__name__}: {error}")
        else:
            problems.append(f"{name}: accepted CPU tensors")
    return problems, example


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.kernels.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true", help="print the compilers' full output")
    parser.add_argument("--with-torch", action="store_true",
                        help="build and import the extension against the CUDA build of the installed torch's "
                             "version, installed once into a cached environment (about 5 GB)")
    parser.add_argument("--index-url", default=PYPI,
                        help=f"where --with-torch gets torch (default {PYPI}: its Linux x86_64 torch is the CUDA "
                             "build; https://download.pytorch.org/whl/cuXYZ for another CUDA)")
    parser.add_argument("--sources", default=None,
                        help="comma-separated files of kernels/csrc to compile (default: every .cu and bindings.cpp)")
    args = parser.parse_args(argv)
    if not args.with_torch:
        return guarded(lambda: check_sources(args.verbose, source_paths(args.sources)))
    return guarded(lambda: with_torch(args.index_url))


if __name__ == "__main__":
    sys.exit(main())
