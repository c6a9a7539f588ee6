"""The locked set: every dependency at the version CI tested, which ``./run.sh`` installs.

    ./run.sh lock                                    # what a developer runs (uv in a throwaway environment)
    python -m bert_ds.tools.lock [--torch SPEC] [--output requirements.lock]
    python -m bert_ds.tools.lock --check             # is the lock made from pyproject.toml as it is?

``./run.sh setup`` installs the file with ``pip install --require-hashes --no-deps -r
requirements.lock``, so a fresh machine next month gets what CI tested today, whatever has been
released since. pyproject.toml keeps its ranges for people who install bert-ds into an
environment of their own; ``./run.sh test-lowest`` and ``test-newest`` try both ends of them.

Design choices, and why:

- ``uv pip compile --universal``: one file for every platform and every Python that
  pyproject.toml's ``requires-python`` admits; a pin that differs by platform or Python carries
  its marker, and pip skips the lines whose marker is false. ``--generate-hashes``: every file of
  each pinned version, so pip checks whatever it downloads for its platform.
- torch is resolved at the version ``run.sh`` installs (``--torch``, its ``TORCH_SPEC``), so
  every other pin is the one tested with that torch, and then left out, with the packages only
  torch needs on some platforms (the CUDA libraries and triton of its PyPI build, which that
  build pins exactly): the environment's torch (a GPU container's, the CPU build) brings its own.
  What torch needs everywhere (sympy, networkx, ...) stays locked.
- The project's build backend (``[build-system]``'s setuptools) is locked too: the project
  installs with ``--no-build-isolation``, so nothing unlocked is fetched to build it.
- The file names what it was made from by a digest (``# inputs:``) of pyproject.toml's
  dependencies, extras, build requirements and ``requires-python``: ``--check`` compares it
  without the network, and ``./run.sh setup`` refuses a lock made from other ranges (a new
  dependency in pyproject.toml would otherwise be missing from the environment).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import UserError, guarded

ROOT = Path(__file__).resolve().parents[2]
LOCK = "requirements.lock"
EXTRAS = ("test",)  # the environment run.sh makes has the test tools
INPUTS_PREFIX = "# inputs: "
TORCH_PREFIX = "# torch: "
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(?: ; (.+?))?(?: \\)?$")
_VIA = re.compile(r"^ {4}#(?: via |   )(\S.*)$")  # "# via X", or "#   X" under a bare "# via"
_PLATFORM_MARKER = re.compile(r"\b(sys_platform|platform_machine|platform_system|os_name)\b")


@dataclass
class Pin:
    """One pinned package of uv's output: its lines (the pin, its hashes, its ``# via``)."""

    name: str
    version: str
    marker: str | None
    lines: list[str]
    via: set[str] = field(default_factory=set)  # the packages that require it ("" for the roots)


def inputs_digest(pyproject: dict) -> str:
    """What the lock is made from: pyproject.toml's requirements, by content, in a fixed order."""
    project = pyproject["project"]
    made_from = {"dependencies": project.get("dependencies", []),
                 "extras": {e: project.get("optional-dependencies", {}).get(e, []) for e in EXTRAS},
                 "build": pyproject.get("build-system", {}).get("requires", []),
                 "requires-python": project.get("requires-python", "")}
    return hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]


def parse(text: str) -> list[Pin]:
    """uv's ``--annotation-style split`` output as pins (a name pinned per marker may come twice)."""
    pins: list[Pin] = []
    for line in text.splitlines():
        if (m := _PIN.match(line)) is not None:
            pins.append(Pin(m.group(1).lower(), m.group(2), m.group(3), [line]))
        elif pins and line.startswith(" "):
            pins[-1].lines.append(line)
            if (v := _VIA.match(line)) is not None:
                source = v.group(1)
                # "-r FILE", "-c FILE", "bert-ds (pyproject.toml)": asked for by the inputs
                pins[-1].via.add("" if source.startswith(("-r ", "-c ")) or "(" in source else source.lower())
        elif line.strip() and not line.startswith("#"):
            raise UserError(f"uv pip compile printed a line this reader does not know: {line!r}")
    return pins


def left_out(pins: list[Pin], torch: str = "torch") -> set[str]:
    """torch, and what only torch needs on some platforms: the packages the inputs reach only
    through torch whose pins carry a platform marker (its CUDA build's libraries and triton)."""
    required_by: dict[str, set[str]] = {}
    for pin in pins:
        for parent in pin.via:
            required_by.setdefault(parent, set()).add(pin.name)
    reached, todo = set(), [""]
    while todo:  # from the inputs, never through torch
        for child in required_by.get(todo.pop(), ()):
            if child != torch and child not in reached:
                reached.add(child)
                todo.append(child)
    only_torch = {pin.name for pin in pins if pin.name not in reached}
    return {torch} | {p.name for p in pins if p.name in only_torch and p.marker and _PLATFORM_MARKER.search(p.marker)}


def torch_version(spec: str) -> str:
    """``torch==X`` -> X: the lock is resolved at one torch, the one run.sh installs."""
    m = re.fullmatch(r"\s*torch\s*==\s*([0-9][\w.]*)(\+\w+)?\s*", spec)
    if m is None:
        raise UserError(f"--torch {spec!r}: expected an exact pin, torch==VERSION (run.sh's TORCH_SPEC)")
    return m.group(1)


def find_uv() -> list[str]:
    """uv as a module of this interpreter, else on PATH."""
    probe = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "uv"]
    if (found := shutil.which("uv")) is not None:
        return [found]
    raise UserError("uv is not installed here: ./run.sh lock installs it, or pip install uv")


def compile_universal(uv: list[str], root: Path, torch: str, python: str) -> str:
    """``uv pip compile`` of pyproject.toml with its extras and build requirements, torch pinned."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        build, constraints = Path(tmp) / "build.txt", Path(tmp) / "torch.txt"
        build.write_text("\n".join(pyproject.get("build-system", {}).get("requires", [])) + "\n")
        constraints.write_text(f"torch=={torch}\n")
        cmd = [*uv, "pip", "compile", "pyproject.toml", str(build), *(a for e in EXTRAS for a in ("--extra", e)),
               "--constraints", str(constraints), "--universal", "--python-version", python, "--generate-hashes",
               "--annotation-style", "split", "--no-header", "--quiet"]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        said = [line for line in proc.stderr.splitlines() if line.strip()]
        raise UserError("uv pip compile failed: " + " ".join(" ".join(said[-6:]).split()))
    # the "# via -r FILE" lines name the input files: by what they hold, not by a temporary path,
    # so that the same inputs on the same day make the same lock
    return proc.stdout.replace(str(build), "build-system.requires").replace(str(constraints), "TORCH_SPEC")


def render(pins: list[Pin], leave_out: set[str], torch_spec: str, digest: str) -> str:
    kept = [pin for pin in pins if pin.name not in leave_out]
    about = ("The versions ./run.sh installs (pip install --require-hashes --no-deps -r requirements.lock): "
             "what CI tested. Made by `./run.sh lock` (python -m bert_ds.tools.lock) from pyproject.toml's "
             "dependencies, its test extra and its build requirements, resolved for every platform with torch at "
             "the version run.sh installs. Not here: torch and the packages only its build needs on some platforms "
             f"({', '.join(sorted(leave_out))}): they come with the environment's torch.")
    header = [*textwrap.wrap(about, 96, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False),
              f"{TORCH_PREFIX}{torch_spec}", f"{INPUTS_PREFIX}{digest}"]
    return "\n".join(header + [line for pin in kept for line in pin.lines]) + "\n"


def recorded(lock: Path, prefix: str) -> str | None:
    """A header field of an existing lock (``None`` where the file or the field is missing)."""
    if not lock.is_file():
        return None
    for line in lock.read_text().splitlines():
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    return None


def check(root: Path, lock: Path) -> None:
    digest = inputs_digest(tomllib.loads((root / "pyproject.toml").read_text()))
    found = recorded(lock, INPUTS_PREFIX)
    if found is None:
        raise UserError(f"{lock}: no lock file here (make it with ./run.sh lock)")
    if found != digest:
        raise UserError(f"{lock} was made from other requirements than pyproject.toml's (inputs {found}, "
                        f"pyproject.toml {digest}): update it with ./run.sh lock")


def make(root: Path, lock: Path, torch_spec: str | None) -> str:
    torch_spec = torch_spec or recorded(lock, TORCH_PREFIX)
    if torch_spec is None:
        raise UserError(f"{lock}: no lock to take the torch from: give --torch torch==VERSION")
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    python = re.search(r">=\s*(\d+\.\d+)", pyproject["project"]["requires-python"]).group(1)
    pins = parse(compile_universal(find_uv(), root, torch_version(torch_spec), python))
    leave_out = left_out(pins)
    text = render(pins, leave_out, torch_spec, inputs_digest(pyproject))
    atomic_write(lock, text)
    return f"{lock.name}: {sum(p.name not in leave_out for p in pins)} pins ({torch_spec} left out with " \
           f"{len(leave_out) - 1} packages of its build)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bert_ds.tools.lock", description=__doc__.split("\n\n")[0])
    p.add_argument("--torch", metavar="SPEC",
                   help="the torch the lock is resolved with, an exact pin (run.sh passes its TORCH_SPEC; "
                        "default: the lock's own)")
    p.add_argument("--output", type=Path, default=ROOT / LOCK, help="the lock file (default: %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="only check that the lock was made from pyproject.toml as it is (no network)")
    args = p.parse_args(argv)

    def body() -> None:
        if args.check:
            check(ROOT, args.output)
        else:
            print(make(ROOT, args.output, args.torch))

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main())
