"""An installed package that does not import: told as one line, not as a traceback.

An environment can break an import that bert-ds needs without any change to bert-ds: a
release that imports a name another folder shadows (transformers 5.25 imports Hugging Face's
``kernels``), a wheel built against another numpy or torch, a package missing altogether. The
traceback of such a failure runs through the installed package's import, forty lines deep;
what the user needs is which package, at which version, what it said, and what to do.

:func:`import_failure` recognises it from the traceback alone: past bert-ds's own frames and the
standard library's (importlib), the failure is

- in an installed package, on its way through module-level code (``<module>`` frames: the
  package, or a module it imports, was being imported when it failed), whatever the exception
  (a RuntimeError of a mismatched extension counts as much as an ImportError); or
- a ``ModuleNotFoundError`` for a package that is not bert-ds's own, raised before any installed
  package's code ran (it is not installed at all).

Anything else (an error inside a package's function, an import error of bert-ds's own modules)
is not the environment's, and keeps its traceback.
"""

from __future__ import annotations

import sysconfig
from importlib import metadata
from pathlib import Path
from types import FrameType, TracebackType

_OURS = "bert_ds"
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
ADVICE = ("bert-ds is tested with the versions of requirements.lock: ./run.sh setup installs them "
          "(into an environment of your own: pip install --no-deps -r requirements.lock)")


def import_failure(err: BaseException) -> str | None:
    """The message for ``err`` where it is an installed package failing to import, else ``None``
    (:func:`bert_ds.base.errors.report` prints it as one line)."""
    frames = [f for f in _frames(err.__traceback__) if not _ours_or_stdlib(f)]
    if frames:
        if not any(f.f_code.co_name == "<module>" for f in frames):
            return None  # raised while a package's code ran, not while it was being imported
        entry = _package(frames[0])
        where = _in_package(frames[-1])
        return f"{_named(entry)} does not import here: {type(err).__name__}: {err} (in {where}); {ADVICE}"
    if isinstance(err, ModuleNotFoundError) and err.name and err.name.split(".")[0] != _OURS:
        return f"{err.name.split('.')[0]} is not installed here ({err}); {ADVICE}"
    return None


def _frames(tb: TracebackType | None) -> list[FrameType]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _module_name(frame: FrameType) -> str:
    """The frame's module by its import name (a ``python -m`` entry's ``__main__`` by its spec's)."""
    spec = frame.f_globals.get("__spec__")
    return getattr(spec, "name", None) or frame.f_globals.get("__name__") or ""


def _ours_or_stdlib(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return True
    name = _module_name(frame)
    if name == _OURS or name.startswith(_OURS + "."):
        return True
    path = Path(filename).resolve()
    installed = {"site-packages", "dist-packages"} & set(path.parts)
    return not installed and path.is_relative_to(_STDLIB)


def _package(frame: FrameType) -> str:
    return _module_name(frame).split(".")[0]


def _named(package: str) -> str:
    """``transformers 5.25.0``: the import name with its distribution's version where one is installed."""
    dists = metadata.packages_distributions().get(package, [])
    for dist in dists:
        try:
            return f"{package} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return package


def _in_package(frame: FrameType) -> str:
    """The frame's file from its package's folder on (``transformers/integrations/hub_kernels.py``):
    as many folders as its module name has parts."""
    parts = Path(frame.f_code.co_filename).parts
    keep = _module_name(frame).count(".") + 1 + (parts[-1] == "__init__.py")
    return str(Path(*parts[-keep:]))
