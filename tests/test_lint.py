"""ruff passes on the whole repository, under the rules ``[tool.ruff]`` in pyproject.toml names."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                                reason="ruff is not installed (it is in the test extra: pip install -e '.[test]')")


def _ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    # --no-cache: a test leaves no .ruff_cache in the checkout
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args],
                          cwd=REPO, input=stdin, capture_output=True, text=True, timeout=300)


def test_ruff_passes_on_the_repository():
    proc = _ruff(str(REPO))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_configuration_is_in_force():
    """The repository's rules catch what they are chosen for (pyflakes, bugbear, pyupgrade)."""
    planted = ("from typing import Callable\n"
               "import os\n\n\n"
               "def f(x=[]) -> Callable:\n"
               "    return x\n")
    proc = _ruff("--stdin-filename", "bert_ds/planted.py", "-", stdin=planted)
    assert proc.returncode == 1
    for code in ("F401", "B006", "UP035"):
        assert code in proc.stdout, proc.stdout
