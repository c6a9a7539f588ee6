"""An installed package that does not import ends a command with one ``error:`` line naming it,
its version and what to do (bert_ds.base.environment), never a traceback; other errors keep theirs."""

from __future__ import annotations

import functools
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.base.environment import ADVICE
from bert_ds.base.errors import BrokenEnvironment, guarded
from tests.conftest import REPO, cli_env


def _installed(site: Path, name: str, version: str, init: str, **modules: str) -> None:
    """A distribution ``name`` at ``version`` in ``site``: its package's __init__ and other modules."""
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(init)
    for module, source in modules.items():
        (site / name / f"{module}.py").write_text(source)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    (info / "RECORD").write_text(f"{name}/__init__.py,,\n")


def _demo(tmp_path: Path, site: Path, *python_flags: str) -> subprocess.CompletedProcess:
    """The main job's last step (it imports torch and transformers) with ``site`` ahead of the environment's."""
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text(json.dumps({"architectures": ["BertForPreTraining"]}))
    env = {**cli_env(), "PYTHONPATH": f"{site}:{REPO}"}
    return subprocess.run([sys.executable, *python_flags, "-m", "bert_ds.tools.demo", str(run)], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=300)


def test_a_release_that_imports_a_shadowed_name_is_one_line(tmp_path):
    """transformers 5.25 against a `kernels` that is not Hugging Face's: what a fresh install met."""
    site = tmp_path / "site"
    _installed(site, "kernels", "0.0.1", "")  # has no CUDAProperties
    _installed(site, "transformers", "99.1.0", "from .integrations import hub_kernels\n",
               integrations="from . import hub_kernels\n")
    (site / "transformers" / "integrations").mkdir()
    (site / "transformers" / "integrations.py").unlink()
    (site / "transformers" / "integrations" / "__init__.py").write_text("")
    (site / "transformers" / "integrations" / "hub_kernels.py").write_text("from kernels import CUDAProperties\n")
    proc = _demo(tmp_path, site)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: transformers 99.1.0 does not import here: ImportError: cannot import "
                                  "name 'CUDAProperties' from 'kernels'"), proc.stderr
    assert "(in transformers/integrations/hub_kernels.py)" in proc.stderr and ADVICE in proc.stderr


def test_an_extension_built_for_another_version_is_one_line(tmp_path):
    """Not only ImportError: a compiled extension that fails its own check as it loads (torchvision's
    'operator torchvision::nms does not exist' is a RuntimeError)."""
    site = tmp_path / "site"
    _installed(site, "transformers", "99.2.0", "from . import _ext\n",
               _ext="raise RuntimeError('operator ext::op does not exist')\n")
    proc = _demo(tmp_path, site)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr == (f"error: transformers 99.2.0 does not import here: RuntimeError: operator ext::op does "
                           f"not exist (in transformers/_ext.py); {ADVICE}\n")


def test_a_package_that_is_not_installed_is_one_line(tmp_path):
    # -S: no site-packages at all, so torch is missing; the command's own modules import without it
    proc = _demo(tmp_path, tmp_path / "empty", "-S")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr == f"error: torch is not installed here (No module named 'torch'); {ADVICE}\n"


def test_errors_that_are_not_the_environment_keep_their_traceback(capsys):
    import torch

    # raised inside an installed package's function, not its import
    with pytest.raises(RuntimeError):
        guarded(functools.partial(torch.matmul, torch.zeros(2, 3), torch.zeros(2, 3)))
    # bert-ds's own module that is not there: a bug, not the environment
    with pytest.raises(ModuleNotFoundError):
        guarded(functools.partial(importlib.import_module, "bert_ds.no_such_module"))
    assert capsys.readouterr().err == ""
    # the environment: one line through guarded, with the status of bad input
    assert guarded(functools.partial(importlib.import_module, "no_such_package_anywhere")) == 2
    assert BrokenEnvironment.exit_status == 2
    assert capsys.readouterr().err == ("error: no_such_package_anywhere is not installed here (No module named "
                                       f"'no_such_package_anywhere'); {ADVICE}\n")
