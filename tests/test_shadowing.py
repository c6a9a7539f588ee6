"""No folder of the repository wins over an installed package of the same name.

Every documented command runs from the repository root, where Python puts the working
directory first on ``sys.path`` (``python -m``, ``python -c``; pytest puts the root there too).
A top-level folder with an ``__init__.py`` is then imported under its own name ahead of any
installed distribution of that name: our ``kernels/`` once hid Hugging Face's ``kernels``, which
transformers >= 5.25 imports, and every transformers model failed to import. The folders are
reached as ``bert_ds.kernels``, ``bert_ds.data_tools`` and ``bert_ds.ds_configs`` (links in
``bert_ds/``) and carry no ``__init__.py``, so from the root they are at most a namespace
portion, which loses to any installed package.

Two names are exempt: ``bert_ds`` is the project's import name, and ``tests`` is the suite's own
package (pytest imports it by that name from the root; nothing installed is imported as it).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

EXEMPT = {"bert_ds", "tests"}


def top_level_names(root: Path) -> list[str]:
    """Names ``import X`` could find at ``root``: its tracked folders and ``.py`` files."""
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    firsts = {line.split("/")[0] for line in tracked.splitlines()}
    names = {name.removesuffix(".py") for name in firsts if (root / name).is_dir() or name.endswith(".py")}
    return sorted(n for n in names if n.isidentifier() and n not in EXEMPT)


def make_stand_ins(site: Path, names: list[str]) -> None:
    """A regular package per name in ``site``, as an installed distribution of that name has."""
    for name in names:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("STAND_IN = True\n")
        info = site / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")


def shadowed(root: Path, names: list[str], site: Path, python: str = sys.executable) -> list[str]:
    """The names that ``import NAME``, run from ``root`` with ``site`` installed, takes from ``root``.

    ``site`` goes on PYTHONPATH: after the working directory, as site-packages is."""
    probe = ("import importlib, sys\n"
             "for name in sys.argv[1:]:\n"
             "    module = importlib.import_module(name)\n"
             "    if not getattr(module, 'STAND_IN', False): print(name)\n")
    proc = subprocess.run([python, "-c", probe, *names], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_the_repository_has_the_names_that_clash():
    names = top_level_names(REPO)
    assert {"kernels", "data_tools", "ds_configs"} <= set(names), names


def test_an_installed_package_wins_over_every_top_level_folder(tmp_path):
    names = top_level_names(REPO)
    make_stand_ins(tmp_path / "site", names)
    assert shadowed(REPO, names, tmp_path / "site") == []
    # and bert_ds, which reaches the folders through its own links, still works beside them
    probe = ("import bert_ds.kernels.ops, bert_ds.data_tools.build, bert_ds.config as c\n"
             "import kernels, data_tools\n"
             "assert kernels.STAND_IN and data_tools.STAND_IN and (c.DS_CONFIG_DIR / 'zero1_bf16.json').is_file()\n")
    proc = subprocess.run([sys.executable, "-c", probe],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_check_sees_a_folder_that_would_shadow(tmp_path):
    """The check itself fails where a top-level ``__init__.py`` or module would win."""
    root = tmp_path / "repo"
    for rel in ("kernels/__init__.py", "kernels/ops.py", "data_tools.py", "ds_configs/zero1.json", "docs/a.md"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "add", "."], cwd=root, check=True)
    names = top_level_names(root)
    assert names == ["data_tools", "docs", "ds_configs", "kernels"]
    make_stand_ins(tmp_path / "site", names)
    assert shadowed(root, names, tmp_path / "site") == ["data_tools", "kernels"]


@pytest.mark.lowest
def test_transformers_models_import_from_the_repository_root():
    """With the environment's transformers (and Hugging Face's ``kernels`` where it is installed:
    transformers >= 5.25 requires it), from the root as every command runs."""
    try:
        hf_kernels = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        hf_kernels = None
    probe = ("import kernels, transformers\n"
             "from transformers import BertForPreTraining, ModernBertForMaskedLM, pipeline\n"
             "print(getattr(kernels, '__file__', None))\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    if hf_kernels is None:
        # nothing installed under the name: the root's folder is a namespace portion, and empty of code
        assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr[-3000:]
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip()).resolve() == Path(hf_kernels.locate_file("kernels/__init__.py")).resolve()
