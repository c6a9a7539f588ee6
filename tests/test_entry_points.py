"""Every entry point answers --help, and a wrong flag is a usage error, not a traceback."""

import subprocess

import pytest

from tests.conftest import REPO, run_cli

MODULES = ["bert_ds.train", "bert_ds.checkpoint.export", "bert_ds.tools.demo", "bert_ds.tools.plot",
           "bert_ds.tools.bench", "bert_ds.train.phases", "bert_ds.tools.bundle",
           "bert_ds.data_tools", "bert_ds.data_tools build", "bert_ds.data_tools verify", "bert_ds.data_tools inspect",
           "bert_ds.eval", "bert_ds.eval glue", "bert_ds.tools.parity", "bert_ds.tools.profile_step"]


@pytest.mark.parametrize("module", MODULES)
def test_help(module):
    proc = run_cli(*module.split(), "--help")
    assert "usage:" in proc.stdout


@pytest.mark.parametrize("module", ["bert_ds.train", "bert_ds.checkpoint.export", "bert_ds.data_tools build",
                                    "bert_ds.eval glue", "bert_ds.tools.parity"])
def test_wrong_flag_is_a_usage_error(module):
    proc = run_cli(*module.split(), "--no-such-flag", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_run_sh_help_and_unknown_mode():
    ok = subprocess.run([str(REPO / "run.sh"), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "./run.sh test" in ok.stdout
    bad = subprocess.run([str(REPO / "run.sh"), "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown mode" in bad.stderr
