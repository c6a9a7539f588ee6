"""The one place that loads the fused CUDA extension, or says why it cannot.

Attempts, cheapest first, stopping at the first that works:
  1. already loaded in this process (``functools.cache``);
  2. prebuilt: a ``bert_ds_kernels`` module importable from ``sys.path`` (built and
     installed ahead of time) whose ``source_hash`` says it was built from these very
     sources for this torch and CUDA; any other is ignored, with a warning;
  3. a JIT build of ``kernels/csrc`` (``torch.utils.cpp_extension.load``, ninja, nvcc;
     sm_80 and sm_90 code plus sm_90 PTX) into ``~/.cache/bert-ds/kernels/<hash>``,
     where the hash covers the sources, the torch and CUDA versions and the target
     architectures: a later process, or another rank, only loads it;
  4. none: ``(None, reason)``, reason being a CPU-only torch, no CUDA device, no nvcc
     or ninja, or "the build failed" with the first error line (the full log stays in
     the build directory). ``kernels=cuda`` fails with the reason, ``kernels=auto``
     logs it.

Self-check: the first time a build meets a device architecture, :func:`op_verdicts`
runs every op against its ``<op>_ref`` (``kernels/selfcheck.py``: every dtype, a few
shapes, forward and backward) and records the verdicts beside the build. An op that
failed is refused by :mod:`kernels.dispatch`: an error under ``kernels=cuda``, the
reference path with a warning under ``kernels=auto``.

``python -m kernels.build`` does step 3 and the self-check ahead of time (an image
build, a login node with a GPU) and prints the verdicts. Step 3's sources, flags and
call are defined once (:func:`build_options`, :func:`build_into`):
``python -m kernels.compile_check`` compiles the binding from them on CPU machines, and
its ``--with-torch`` runs the very build against the CUDA build of torch.
"""

import fcntl
import functools
import hashlib
import importlib
import json
import logging
import os
import re
from pathlib import Path
from types import ModuleType

import torch

from data_tools.atomic import atomic_write

EXTENSION_NAME = "bert_ds_kernels"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("layer_norm.cu", "bias_gelu.cu", "attention.cu", "bindings.cpp")
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


@functools.cache
def load_extension() -> tuple[ModuleType | None, str]:
    """Returns ``(module, "")`` when the fused kernels can run, else ``(None, why not)``."""
    if torch.version.cuda is None:
        return None, f"the installed torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        return None, "no CUDA device"
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

    The JIT build and ``python -m kernels.compile_check`` (its host compile of the
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
    try:
        module = cpp_extension.load(**build_options(directory))
    except Exception as error:  # the compiler's output is the exception's text
        log = directory / "build.log"
        log.write_text(str(error))
        return None, f"the build failed: {_first_error_line(str(error))} (full log: {log})"
    return module, ""


def _first_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines[1:]:
        if re.search(r"\berror\b", line, re.IGNORECASE):
            return line[:300]
    return lines[0][:300] if lines else "no output"


# --------------------------------------------------------------------------- self-check

def verdict_path() -> Path:
    """Where the verdicts for this build on this device's architecture are recorded."""
    major, minor = torch.cuda.get_device_capability()
    return build_dir() / f"selfcheck-sm{major}{minor}.json"


@functools.cache
def op_verdicts() -> dict[str, str]:
    """Per op, "" if its kernels passed the self-check on this device's architecture, else why not.

    Empty when the extension does not load. Recorded beside the build, so the check
    runs once per build and architecture; concurrent processes (ranks) wait for the
    first one's verdicts instead of repeating the check.
    """
    extension, _ = load_extension()
    if extension is None:
        return {}
    path = verdict_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")
    except OSError as error:  # a read-only cache: check in this process, remember nothing
        logger.warning("kernels: cannot record self-check verdicts in %s (%s)", path.parent, error)
        return _run_selfcheck()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        recorded = _read_verdicts(path)
        if recorded is not None:
            return recorded
        verdicts = _run_selfcheck()
        atomic_write(path, json.dumps({
            "source_hash": source_hash(),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "verdicts": verdicts,
        }, indent=1))
        return verdicts


def _read_verdicts(path: Path) -> dict[str, str] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("source_hash") != source_hash():
        return None
    return {op: str(reason) for op, reason in data["verdicts"].items()}


def _run_selfcheck() -> dict[str, str]:
    from kernels import selfcheck  # imports the ops, which import this module

    logger.info("kernels: self-checking the fused CUDA kernels on %s", torch.cuda.get_device_name())
    return selfcheck.run_all()
