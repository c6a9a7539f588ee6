"""DeepSpeed's JIT-compiled extensions: built at set-up, cached per environment, and never
waited on forever.

    python -m bert_ds.train.extensions     build what this machine's runs need (``./run.sh setup`` does it)

On a CPU machine ``deepspeed.init_distributed`` loads its shared-memory communication op
(``deepspeed_shm_comm``), which ``torch.utils.cpp_extension`` compiles on first use (35-50 s,
needs a C++ compiler and ninja) inside a build folder guarded by a ``lock`` file. The same
lock guards every DeepSpeed op JIT-built on a GPU.

Design choices:

- The op is built during set-up rather than skipped. Training never uses it (DeepSpeed
  calls it only from ``inference_all_reduce``; our all-reduces go through
  ``torch.distributed``), but DeepSpeed has no switch that keeps ``init_distributed`` from
  loading it: ``DS_BUILD_SHM_COMM`` only selects ops to pre-build into DeepSpeed's own
  wheel, and skipping it would mean editing DeepSpeed's private table of compatible ops.
  Set-up calls DeepSpeed's own loader (``deepspeed.comm.torch.build_shm_op``), so what is
  built is exactly what ``init_distributed`` loads; on a GPU it builds nothing.
- The build cache is per environment: ``TORCH_EXTENSIONS_DIR`` defaults to
  ``<environment>/torch_extensions`` (``sys.prefix``), set before DeepSpeed builds anything.
  torch's default, ``~/.cache/torch_extensions``, is shared by every environment of a user,
  and its ``build.ninja`` names the DeepSpeed sources by absolute path, so two environments
  rebuilt the op on alternate starts. A ``TORCH_EXTENSIONS_DIR`` the user set is kept. The
  environment's ninja comes first on PATH for the same reason: a system ninja of another
  version reads the build log as out of date.
- Its build locks are watched by :mod:`bert_ds.base.build_locks`: a stale one (left by a
  killed start) is removed, a live one is waited on with a bound and a message. The wait is
  ours and comes before DeepSpeed starts: a process that DeepSpeed sends to ``FileBaton.wait``
  loads the op once the lock is gone, built or not.
"""


from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from bert_ds.base import build_locks
from bert_ds.base.build_locks import log
from bert_ds.base.errors import UserError, report

CACHE_ENV = "TORCH_EXTENSIONS_DIR"  # torch.utils.cpp_extension's build root


def cache_root() -> Path:
    """Where this environment's extensions are built: ``TORCH_EXTENSIONS_DIR`` if the user set it."""
    return Path(os.environ.get(CACHE_ENV) or Path(sys.prefix) / "torch_extensions")


def use_environment_cache() -> Path:
    """Point torch's extension builds at :func:`cache_root` (read when a build starts), built
    by the environment's own ninja (:func:`use_environment_ninja`)."""
    os.environ[CACHE_ENV] = str(cache_root())
    use_environment_ninja()
    return cache_root()


def use_environment_ninja() -> None:
    """Put the environment's ninja (the ``ninja`` wheel beside this interpreter) first on PATH,
    where torch looks for it. Two ninja versions (the wheel's 1.13, a system 1.11) each read the
    other's build log as out of date, so processes that found different ones, an activated
    environment and a plain ``.venv/bin/python``, rebuilt the op (~100 s of CPU) on alternate starts."""
    bin_dir = Path(sys.executable).parent
    ninja = bin_dir / "ninja"
    if ninja.is_file() and shutil.which("ninja") != str(ninja):
        os.environ["PATH"] = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])


@contextlib.contextmanager
def bounded_build_locks() -> Iterator[None]:
    """:func:`bert_ds.base.build_locks.bounded_build_locks` over this environment's DeepSpeed cache."""
    with build_locks.bounded_build_locks(use_environment_cache()):
        yield


def build() -> list[str]:
    """Build (or load from the cache) the DeepSpeed ops that ``init_distributed`` loads here."""
    use_environment_cache()
    from deepspeed.comm.torch import build_shm_op

    with bounded_build_locks():
        op = build_shm_op()
    return [] if op is None else [op.__name__]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m bert_ds.train.extensions",
                            description="Build DeepSpeed's JIT ops this machine's runs load (./run.sh setup does it), "
                                        "into the environment's cache.").parse_args(argv)
    try:
        built = build()
    except UserError as e:
        return report(e)
    except (ImportError, OSError, RuntimeError) as e:  # torch's build error follows the compiler's output
        return report(f"building DeepSpeed's extensions into {cache_root()} failed: {e} (the build needs a C++ "
                      "compiler and ninja; a training start would fail the same way)")
    log(f"DeepSpeed extensions ready in {os.environ[CACHE_ENV]}: {', '.join(built) or 'none needed here'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
