"""Every entry point answers --help, and a wrong flag is a usage error, not a traceback."""

import os
import subprocess
import sys
import time

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
