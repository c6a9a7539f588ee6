"""Every entry point answers --help, and a wrong flag is a usage error, not a traceback; both
without importing torch or the other heavy libraries (a command's parser lives in modules that
import only the standard library and light parts of bert_ds; the run imports the rest)."""

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env

# The commands the docs name: each must be among the entry points the probe runs.
MODULES = ["bert_ds.train", "bert_ds.checkpoint.export", "bert_ds.tools.demo", "bert_ds.tools.plot",
           "bert_ds.tools.bench", "bert_ds.train.phases", "bert_ds.tools.bundle",
           "bert_ds.data_tools", "bert_ds.data_tools build", "bert_ds.data_tools verify", "bert_ds.data_tools inspect",
           "bert_ds.eval", "bert_ds.eval glue", "bert_ds.tools.parity", "bert_ds.tools.profile_step"]


def test_run_sh_help_and_unknown_mode():
    ok = subprocess.run([str(REPO / "run.sh"), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "./run.sh test" in ok.stdout
    bad = subprocess.run([str(REPO / "run.sh"), "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown mode" in bad.stderr


# --------------------------------------------------------------------------- light --help

# What --help and a usage error must not import: each takes seconds (torch alone ~2.5 s here).
HEAVY = ("torch", "transformers", "deepspeed", "tokenizers", "datasets", "matplotlib", "scipy", "sklearn",
         "safetensors", "accelerate")
SUBCOMMANDS = {"bert_ds.data_tools": ("build", "verify", "inspect"), "bert_ds.eval": ("glue",)}
# Runs one entry point in this fresh interpreter with --help, then with a wrong flag; prints the exit
# statuses and the heavy modules imported by then. ENTRY is "MODULE [SUBCOMMAND]" (python -m) or
# "MODULE:FUNCTION" (an installed script).
PROBE = """
import importlib, json, runpy, sys
entry, heavy = sys.argv[1].split(), sys.argv[2].split(",")
statuses = []
for flag in ("--help", "--no-such-flag"):
    sys.argv = [entry[0], *entry[1:], flag]
    try:
        if ":" in entry[0]:
            module, function = entry[0].split(":")
            statuses.append(getattr(importlib.import_module(module), function)(sys.argv[1:]))
        else:
            runpy.run_module(entry[0], run_name="__main__", alter_sys=True)
            statuses.append(None)
    except SystemExit as stop:
        statuses.append(stop.code)
loaded = sorted(name for name in heavy if name in sys.modules)
print("PROBE " + json.dumps({"statuses": statuses, "heavy": loaded}), file=sys.__stdout__)
"""


def entry_modules(root: Path = REPO / "bert_ds") -> list[str]:
    """Every module that runs as a command: ``__main__.py`` (as its package) and every module with
    an ``if __name__ == "__main__":`` block, the linked top-level folders included."""
    found = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        parts = ("bert_ds", *Path(folder).relative_to(root).parts)
        for name in files:
            path = Path(folder) / name
            if name == "__main__.py":
                found.add(".".join(parts))
            elif name.endswith(".py") and 'if __name__ == "__main__":' in path.read_text(encoding="utf-8"):
                found.add(".".join((*parts, name[:-3])))
    return sorted(found)


def scripts() -> list[str]:
    """The installed scripts of pyproject.toml, as MODULE:FUNCTION."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return sorted(tomllib.load(f)["project"]["scripts"].values())


ENTRIES = sorted({*entry_modules(), *(f"{m} {c}" for m, cs in SUBCOMMANDS.items() for c in cs), *scripts()})


def probe(entry: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, entry, ",".join(HEAVY)], capture_output=True, text=True,
                          env=env or cli_env(), cwd=REPO, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, f"{entry}: the probe failed\n{proc.stderr[-3000:]}"
    assert "usage:" in proc.stdout, f"{entry}: --help printed no usage"
    return json.loads(lines[-1][len("PROBE "):])


def test_every_entry_point_is_found():
    assert {"bert_ds.train", "bert_ds.train.phases", "bert_ds.checkpoint.export", "bert_ds.eval", "bert_ds.data_tools",
            "bert_ds.tools.bench", "bert_ds.kernels.build", "bert_ds.kernels.bench", "bert_ds.kernels.inspect",
            "bert_ds.kernels.compile_check", "bert_ds.train.cli:main"} <= set(ENTRIES)
    assert {m.split()[0] for m in MODULES} <= set(ENTRIES)


@pytest.mark.parametrize("entry", ENTRIES)
def test_help_and_a_usage_error_import_no_heavy_library(entry):
    found = probe(entry)
    assert found["statuses"] == [0, 2], f"{entry}: --help and a wrong flag exit {found['statuses']}, not [0, 2]"
    assert found["heavy"] == [], (f"{entry} imports {', '.join(found['heavy'])} to parse its command line: import "
                                  "them where the run needs them, after parse_args")


def test_the_probe_sees_a_heavy_import(tmp_path):
    """A command module that imports torch at its top is caught (a stand-in torch: no seconds spent)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "planted_cli.py").write_text("import argparse\n\nimport torch  # noqa: F401\n\n"
                                              "argparse.ArgumentParser().parse_args()\n")
    env = {**cli_env(), "PYTHONPATH": os.pathsep.join((str(tmp_path), str(REPO)))}
    assert probe("planted_cli", env) == {"statuses": [0, 2], "heavy": ["torch"]}


def test_error_lines_of_ranks_sharing_one_pipe_stay_whole():
    """The ranks of a run print their ``error:`` line into the launcher's one stderr pipe at
    the same moment; every line must arrive whole (print() writes text and newline apart, and
    three writers then splice their lines)."""
    writer = ("import sys, time\n"
              "from bert_ds.base.errors import report\n"
              "start = float(sys.argv[1])\n"
              "while time.time() < start: pass\n"
              "for _ in range(300): report('cannot resume: ' + 'x' * 300)\n")
    start = str(time.time() + 1.0)
    read_end, write_end = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", writer, start], cwd=REPO, stderr=write_end)
             for _ in range(3)]
    os.close(write_end)
    with open(read_end, encoding="utf-8") as pipe:
        lines = pipe.read().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert lines == ["error: cannot resume: " + "x" * 300] * 900
