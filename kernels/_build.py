"""The one place that loads the fused CUDA extension, or says why it cannot.

Attempts, cheapest first, stopping at the first that works:
  1. already loaded in this process (``functools.cache``);
  2. prebuilt: a ``bert_ds_kernels`` module importable from ``sys.path`` (built and
     installed ahead of time) whose ``source_hash`` says it was built from these very
     sources for this torch and CUDA; any other is ignored, with a warning;
  3. a JIT build of ``kernels/csrc`` (``torch.utils.cpp_extension.load``, ninja, nvcc;
     sm_80 and sm_90 code plus sm_90 PTX) into ``~/.cache/bert-ds/kernels/<hash>``,
     where the hash covers the sources, the torch and CUDA versions and the target
     architectures: a later process, or another rank, only loads it. It links with a
     compiler that links libstdc++ dynamically (:func:`host_compiler`), and its lock is
     watched (:mod:`bert_ds.base.build_locks`): a lock left by a killed build is removed,
     one held by a live build is waited on for at most ``BERT_DS_BUILD_LOCK_TIMEOUT`` s;
  4. none: ``(None, reason)``, reason being a CPU-only torch, no CUDA device, no nvcc
     or ninja, or "the build failed" with the first error line (the full log stays in
     the build directory). ``kernels=cuda`` fails with the reason, ``kernels=auto``
     logs it.

Verdicts, recorded beside the build in one file per device, keyed by
:func:`device_key` (these sources and build flags, torch, CUDA, the device's name):
:func:`recorded` keeps each section (the self-check, the race of ``kernels=auto``), made
the first time a build meets a device by :mod:`bert_ds.kernels.choice`. This module knows
nothing of the ops: it is what they load, so it sits below them.

A record made under another key is ignored and made again. ``python -m bert_ds.kernels.build``
does step 3, the self-check and the race ahead of time (an image build, a login node
with a GPU) and prints the verdicts. Step 3's sources, flags and call are defined once
(:func:`build_options`, :func:`build_into`): ``python -m bert_ds.kernels.compile_check``
compiles the binding from them on CPU machines, and its ``--with-torch`` runs the very
build against the CUDA build of torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from bert_ds.base.atomic import atomic_write
from bert_ds.base.build_locks import bounded_build_locks, log
from bert_ds.base.errors import UserError

EXTENSION_NAME = "bert_ds_kernels"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("layer_norm.cu", "dropout_layer_norm.cu", "bias_gelu.cu", "geglu.cu", "attention.cu", "lamb.cu",
           "cross_entropy.cu", "bindings.cpp")
# SASS for A100 and H100/H200; the sm_90 PTX lets newer GPUs JIT-compile (their
# verdict is then checked like any other architecture's).
GENCODE = (
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
)

logger = logging.getLogger(__name__)


@functools.cache
def source_hash() -> str:
    """Identifies what a build contains: every csrc file, torch, CUDA and the targets."""
    import torch  # here, not at the top: the kernels' commands import this module to answer --help

    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{torch.__version__}|{torch.version.cuda}|{' '.join(GENCODE)}".encode())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """bert-ds's cache: ``$XDG_CACHE_HOME/bert-ds``, else ``~/.cache/bert-ds``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bert-ds"


def build_dir() -> Path:
    """Where this build (and its self-check verdicts) lives."""
    return cache_dir() / "kernels" / f"{EXTENSION_NAME}-{source_hash()}"


def no_cuda() -> str:
    """Why this process can run no CUDA kernel at all ("" if it may): asked without touching a device."""
    import torch

    if torch.version.cuda is None:
        return f"the installed torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return ""


@functools.cache
def load_extension() -> tuple[ModuleType | None, str]:
    """Returns ``(module, "")`` when the fused kernels can run, else ``(None, why not)``."""
    why = no_cuda()
    if why:
        return None, why
    module = _prebuilt()
    if module is not None:
        return module, ""
    return _jit_build()


def _prebuilt() -> ModuleType | None:
    try:
        module = importlib.import_module(EXTENSION_NAME)
    except ImportError:
        return None
    if getattr(module, "source_hash", None) != source_hash():
        logger.warning("ignoring the installed %s (%s): built from other sources or for another torch/CUDA",
                       EXTENSION_NAME, getattr(module, "__file__", "?"))
        return None
    return module


def _jit_build() -> tuple[ModuleType | None, str]:
    directory = build_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return None, f"cannot create the build directory {directory}: {error.strerror or error}"
    return build_into(directory)


def build_options(directory: Path) -> dict[str, object]:
    """The one definition of the build: ``torch.utils.cpp_extension.load``'s arguments.

    The JIT build and ``python -m bert_ds.kernels.compile_check`` (its host compile of the
    binding, and ``--with-torch``) all build from these, so a check made there is a
    check of what a GPU user's first run compiles.
    """
    define = f"-DBDS_SOURCE_HASH={source_hash()}"
    return {
        "name": EXTENSION_NAME,
        "sources": [str(CSRC / name) for name in SOURCES],
        "extra_cflags": ["-O3", define],
        "extra_cuda_cflags": ["-O3", "-lineinfo", *GENCODE, define],
        "extra_include_paths": [str(CSRC)],
        "build_directory": str(directory),
        "verbose": False,
    }


def build_into(directory: Path) -> tuple[ModuleType | None, str]:
    """Builds the extension in ``directory`` (an existing directory; ninja reuses what is
    up to date there) and imports it: ``(module, "")``, else ``(None, why not)``."""
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return None, "nvcc not found (no CUDA toolkit: set CUDA_HOME or put nvcc on PATH)"
    if not cpp_extension.is_ninja_available():
        return None, "ninja is not installed (pip install ninja), the JIT build needs it"
    compiler, why_not = host_compiler()
    if compiler is None:
        return None, why_not
    if why_not:
        logger.warning("kernels: %s", why_not)
    fresh = not any(directory.glob(f"{EXTENSION_NAME}*.so"))
    if fresh:
        log(f"kernels: building the fused CUDA kernels into {directory} (about a minute, once per source, torch "
            "and CUDA version; later starts load the build)")
    start = time.monotonic()
    try:
        # torch waits on another process's build with no bound: stale locks go, live ones are bounded
        with _environment(CXX=compiler), bounded_build_locks(directory.parent, "the fused kernels' build"):
            module = cpp_extension.load(**build_options(directory))
    except UserError as error:  # another build's lock, held past the bound
        return None, str(error)
    except Exception as error:  # the compiler's output is the exception's text
        build_log = directory / "build.log"
        build_log.write_text(str(error))
        return None, f"the build failed: {_first_error_line(str(error))} (full log: {build_log})"
    if fresh:
        log(f"kernels: built in {time.monotonic() - start:.0f} s")
    return module, ""


def host_compiler() -> tuple[str | None, str]:
    """The C++ compiler that links the extension: ``(compiler, note)``, or ``(None, why none)``.

    torch's JIT build compiles and links with ``$CXX`` (else ``c++``). A compiler that links
    the C++ runtime statically (GCC configured ``--with-static-standard-libraries``; one GPU
    image's ``CXX=/opt/gcc/bin/g++`` does) puts a second libstdc++ into the extension beside
    the one Python and torch have loaded. The two disagree about locale facets, so the
    first error message that formats a number (``TORCH_CHECK(..., x.size(0))``) crashed the
    process with a segmentation fault, while the kernels themselves ran and passed their
    self-check (seen on an H100 machine, torch 2.11, 2026-11-24). So the compiler must link
    ``libstdc++.so``; where ``$CXX`` does not, ``c++`` or ``g++`` from PATH is used, with a
    note; where none does, nothing is built.
    """
    wanted = os.environ.get("CXX") or "c++"
    if _links_libstdcxx_dynamically(wanted) is not False:  # True, or cannot tell: torch's choice stands
        return wanted, ""
    for candidate in ("c++", "g++"):
        path = shutil.which(candidate)
        if path and os.path.realpath(path) != os.path.realpath(shutil.which(wanted) or wanted) \
                and _links_libstdcxx_dynamically(path):
            return path, (f"CXX={wanted} links libstdc++ statically, which crashes the extension's error "
                          f"messages; building with {path} instead")
    return None, (f"the C++ compiler CXX={wanted} links libstdc++ statically (a second C++ runtime in the "
                  "extension crashes its error messages): set CXX to a compiler that links it dynamically")


def _links_libstdcxx_dynamically(compiler: str) -> bool | None:
    """Whether a shared object ``compiler`` links NEEDs ``libstdc++.so``; None when it cannot be told."""
    readelf = shutil.which("readelf")
    if readelf is None or shutil.which(compiler) is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.so"
        source = ("#include <sstream>\n#include <string>\n"
                  "std::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n")
        try:
            subprocess.run([compiler, "-shared", "-fPIC", "-x", "c++", "-", "-o", str(probe)], input=source,
                           text=True, capture_output=True, timeout=120, check=True)
            dynamic = subprocess.run([readelf, "-d", str(probe)], text=True, capture_output=True, timeout=30,
                                     check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    return "libstdc++.so" in dynamic


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Sets environment variables for the duration of the block, then restores them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _first_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines[1:]:
        if re.search(r"\berror\b", line, re.IGNORECASE):
            return line[:300]
    return lines[0][:300] if lines else "no output"


# --------------------------------------------------------------------------- verdicts

def device_key() -> dict[str, str]:
    """What a recorded verdict holds for: these sources and build flags, torch, CUDA, this device."""
    import torch

    return {"source_hash": source_hash(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cuda": str(torch.version.cuda)}


def verdict_path() -> Path:
    """Where the verdicts for this build on this device are recorded."""
    import torch

    device = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return build_dir() / f"verdicts-{device or 'unnamed'}.json"


def recorded(section: str, compute: Callable[[], Any], holds: Callable[[Any], bool] | None = None) -> Any:
    """The recorded ``section`` of this device's verdicts, computed and recorded the first time.

    ``holds(recorded)``: whether a recorded section still answers (e.g. it was made with the
    candidates there are now); one that does not is computed and recorded again.
    Concurrent processes (ranks) wait for the first one's result instead of repeating
    the work; a read-only cache computes it in every process and records nothing.
    """
    path = verdict_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")
    except OSError as error:
        logger.warning("kernels: cannot record verdicts in %s (%s)", path.parent, error)
        return compute()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = _read_record(path)
        if section not in record or (holds is not None and not holds(record[section])):
            record[section] = compute()
            atomic_write(path, json.dumps(record, indent=1))
        return record[section]


def _read_record(path: Path) -> dict[str, Any]:
    """The record at ``path`` if it was made under this :func:`device_key`, else a new, empty one."""
    key = device_key()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    return data if isinstance(data, dict) and data.get("key") == key else {"key": key}
