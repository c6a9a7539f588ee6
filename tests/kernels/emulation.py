"""Builds CUDA sources into a CPU library against the emulator in ``tests/kernels/emu``.

``build_library`` is the one place that turns ``.cu`` text into something ctypes can load:
kernel launches (``k<<<grid, block, smem, stream>>>(args)``) are rewritten to
``::emu::launch(k, grid, block, smem, stream, args)``, dynamic shared memory
(``extern __shared__ T name[];``) to ``T* const name = ::emu::dynamic_shared<T>();`` (the
launch's ``smem`` bytes of the emulator's buffer), and the result is compiled by g++ as
C++ with ``-DBDS_EMULATE`` and the emulator's ``cuda_runtime.h`` first on the include path.
Sources are paths or ``{file name: text}``, so a test can build an edited copy of a kernel
(a barrier removed, a wait dropped) next to the real one.

The emulator ends the process on a kernel error (``emu: ...`` on stderr, then abort), so
tests that expect one run the library in a fresh interpreter: ``run_python``.
"""

import fcntl
import functools
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "kernels" / "csrc"
EMU = Path(__file__).resolve().parent / "emu"
# `kernel<...><<<grid, block, smem, stream>>>(args)` -> `::emu::launch(kernel<...>, grid, block, smem, stream, args)`
LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)
# `extern __shared__ [__align__(n)] T name[];` -> `T* const name = ::emu::dynamic_shared<T>();`
EXTERN_SHARED = re.compile(r"\bextern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?"
                           r"([A-Za-z_][\w:]*(?:\s+[A-Za-z_][\w:]*)*?)\s+([A-Za-z_]\w*)\s*\[\s*\]\s*;")
# -fno-gnu-unique: the emulator's state and the kernels' __shared__ arrays are statics in inline
# functions, which g++ otherwise binds process-wide (STB_GNU_UNIQUE) across every library loaded,
# so two libraries built from different sources would share, and corrupt, each other's.
CXXFLAGS = ["-std=c++17", "-O1", "-g0", "-shared", "-fPIC", "-fno-strict-aliasing", "-fno-gnu-unique", "-DBDS_EMULATE"]
COMPILED = (".cu", ".cpp")  # translation units; any other file is a header, written beside them


class BuildError(RuntimeError):
    """A source the emulation cannot take, or a failed compile (the message carries g++'s output)."""


def cuda_include() -> Path | None:
    """The CUDA toolkit's include directory (for cuda_bf16.h and friends), or None."""
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return next((c for c in candidates if (c / "cuda_bf16.h").exists()), None)


def unavailable() -> str:
    """Why nothing can be built here ('' when g++ and the CUDA headers are present)."""
    if shutil.which("g++") is None or cuda_include() is None:
        return "needs g++ and the CUDA headers (cuda_bf16.h)"
    return ""


def rewrite_launches(text: str, name: str) -> str:
    """``text`` with every ``<<<...>>>`` launch turned into a call of ``emu::launch``."""
    text = LAUNCH.sub(lambda m: f"::emu::launch({m.group(1)}, {m.group(2)}, ", text)
    if "<<<" in text:
        raise BuildError(f"{name}: a kernel launch the emulation cannot rewrite")
    return text


def rewrite_extern_shared(text: str, name: str) -> str:
    """``text`` with every ``extern __shared__`` array turned into a pointer to the emulator's
    dynamic shared memory (the alignment is the emulator's: 128 bytes)."""
    text = EXTERN_SHARED.sub(lambda m: f"{m.group(1)}* const {m.group(2)} = ::emu::dynamic_shared<{m.group(1)}>();",
                             text)
    if re.search(r"\bextern\s+__shared__\b", re.sub(r"//[^\n]*", "", text)):  # comments may name it
        raise BuildError(f"{name}: an extern __shared__ declaration the emulation cannot rewrite")
    return text


def rewrite_for_emulation(text: str, name: str) -> str:
    """``text`` as the emulator compiles it: launches and dynamic shared memory rewritten."""
    return rewrite_extern_shared(rewrite_launches(text, name), name)


def _as_texts(sources: Iterable[str | Path] | Mapping[str, str]) -> dict[str, str]:
    if isinstance(sources, Mapping):
        return dict(sources)
    return {Path(p).name: Path(p).read_text() for p in sources}


def csrc_sources() -> list[Path]:
    """kernels/csrc's .cu files and the headers that launch kernels: what the extension is built from."""
    return sorted(CSRC.glob("*.cu*"))


def build_library(sources: Iterable[str | Path] | Mapping[str, str], out_dir: str | Path,
                  name: str = "libbds_emu.so", *, dtype: str | None = None,
                  defines: Mapping[str, int | str] | None = None) -> Path:
    """Compiles ``sources`` into ``out_dir / name`` and returns its path.

    ``dtype`` (a ``BdsDtype`` name, ``"BDS_FLOAT32"``): compile that dtype's kernels alone
    (``compiled_dtype`` in common.cuh), for an edited copy of a kernel that is checked in one
    dtype: a third of the compile, which is most of such a test's time on a cold cache.
    ``defines``: more macros for the compile, ``{name: value}``, e.g. attention.cu's
    ``BDS_EMULATE_HEAD_DIM`` (``compiled_attention``), which narrow an edited copy to what its check runs.

    Every source is written into ``out_dir`` rewritten (:func:`rewrite_for_emulation`); ``.cu`` files
    become ``.cpp`` translation units. Headers given here shadow kernels/csrc's for the
    sources beside them (``#include "x.cuh"`` looks in the includer's folder first); headers
    not given come from kernels/csrc.
    """
    include = cuda_include()
    if shutil.which("g++") is None or include is None:
        raise BuildError(unavailable())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    units, headers = [], {}
    for file_name, text in _as_texts(sources).items():
        path = Path(file_name)
        written = out_dir / (f"{path.stem}.cpp" if path.suffix == ".cu" else path.name)
        written.write_text(rewrite_for_emulation(text, file_name))
        if path.suffix in COMPILED:
            units.append(str(written))
        else:
            headers[path.name] = written.read_text()
    if not units:
        raise BuildError("no .cu or .cpp file among the sources")
    flags = [*CXXFLAGS, *([f"-DBDS_EMULATE_DTYPE={dtype}"] if dtype else []),
             *(f"-D{name}={value}" for name, value in (defines or {}).items())]
    key = _headers_key(include, headers, flags)
    objects = [_object(Path(unit), key, include, flags) for unit in units]
    library = out_dir / name
    proc = subprocess.run(["g++", *flags, *map(str, objects), "-o", str(library)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"g++ failed to link ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return library


# --------------------------------------------------------------------------- the object cache

def cache_dir() -> Path:
    """Where compiled translation units are kept, by content: ``BDS_EMU_CACHE``, else one folder
    per user in the temporary directory. The xdist workers and the children of one suite share
    it, so the kernels compile once however many tests and workers load them, and a test's
    edited copy of one kernel recompiles that kernel alone."""
    return Path(os.environ.get("BDS_EMU_CACHE") or Path(tempfile.gettempdir()) / f"bert-ds-emu-{os.getuid()}")


@functools.cache
def _compiler() -> str:
    return subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout


def _headers_key(include: Path, given: Mapping[str, str], flags: list[str]) -> str:
    """A digest of everything a unit may include besides itself: the headers written beside it,
    kernels/csrc's and the emulator's, the toolkit's include folder, the compiler and flags."""
    digest = hashlib.sha256(f"{_compiler()}\0{flags}\0{include}\0{EMU}\0{CSRC}".encode())
    for folder, texts in (("given", given), ("csrc", _texts(CSRC)), ("emu", _texts(EMU))):
        for file_name in sorted(texts):
            digest.update(f"\0{folder}/{file_name}\0{texts[file_name]}".encode())
    return digest.hexdigest()


def _texts(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir() if p.is_file() and p.suffix not in COMPILED}


def _object(unit: Path, headers_key: str, include: Path, flags: list[str]) -> Path:
    """``unit`` compiled to an object in the cache (compiled here unless it is there already; a
    unit being compiled by another process is waited for, not compiled twice)."""
    text = unit.read_text()
    key = hashlib.sha256(f"{headers_key}\0{unit.name}\0{text}".encode()).hexdigest()[:32]
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    obj = folder / f"{unit.stem}-{key}.o"
    with open(folder / f"{obj.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not obj.is_file():
            partial = obj.with_name(f"{obj.name}.{os.getpid()}.partial")
            cmd = ["g++", *flags, f"-I{EMU}", f"-I{CSRC}", f"-I{include}", "-c", str(unit), "-o", str(partial)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                partial.unlink(missing_ok=True)
                raise BuildError(f"g++ failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
            os.replace(partial, obj)  # whole or absent: a killed compile leaves no object
    return obj


@dataclass
class Outcome:
    """How a child interpreter ended: its exit code (negative: the signal) and its stderr."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def aborted(self) -> bool:
        return self.returncode == -signal.SIGABRT

    @property
    def emu_error(self) -> str:
        """The emulator's one-line report (``emu: ...``), or '' if there is none."""
        return next((line for line in self.stderr.splitlines() if line.startswith("emu: ")), "")


def run_python(code: str, timeout: float = 600) -> Outcome:
    """Runs ``code`` in a fresh interpreter with this checkout first on the path, so that an
    emulator abort ends the child, not the test process; the caller asserts on the Outcome."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)
    return Outcome(proc.returncode, proc.stdout, proc.stderr)
