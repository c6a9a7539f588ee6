"""R13 (Ctrl-C in training, a stop signal during validation)
and R17 (one training run per output folder), on CPU: the trainer run as processes, as in
test_reliability.py (tiny BERT, sequence length 64, DeepSpeed with gloo, 1 or 2 ranks).

Ctrl-C is SIGINT to the process group of the command, the way a terminal sends it (torchrun
starts its ranks in sessions of their own: it alone gets the signal, and forwards it).
Each test prints the figure it measured (``pytest -s`` shows them) and asserts it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bert_ds.base.errors import EXIT_INTERRUPTED, guarded
from bert_ds.checkpoint import store as checkpoint
from tests.bert_ds.test_reliability import _args, _command, _losses, _steps_logged, _wait_for_step
from tests.conftest import REPO, cli_env, run_cli, stop_signals_at_default

STEPS = 8
EXTRA = ("--steps", str(STEPS), "--num-workers", "1")  # with a loader worker, which the signal reaches too


def _start_group(args: list[str], nproc: int, log: Path) -> subprocess.Popen:
    """The trainer in a process group of its own, which a Ctrl-C signals as a whole."""
    return subprocess.Popen(_command(args, nproc), stdout=open(log, "w"), stderr=subprocess.STDOUT, env=cli_env(),
                            cwd=REPO, start_new_session=True, preexec_fn=stop_signals_at_default)


def _ctrl_c(proc: subprocess.Popen) -> None:
    """SIGINT to the command's process group, as a terminal sends it."""
    os.killpg(proc.pid, signal.SIGINT)


@pytest.fixture
def group_cleanup():
    """Ends every process group a test started, whatever the test's outcome."""
    procs: list[subprocess.Popen] = []
    yield procs.append
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def reference(sample_data, tmp_path_factory):
    """reference(nproc): the folder of an uninterrupted run on nproc ranks (made once)."""
    made: dict[int, Path] = {}

    def get(nproc: int) -> Path:
        if nproc not in made:
            made[nproc] = tmp_path_factory.mktemp(f"reference-{nproc}") / "run"
            run_cli(*_args(sample_data, made[nproc], *EXTRA), nproc=nproc)
        return made[nproc]
    return get


def _rank_tracebacks(log: str) -> list[str]:
    """Tracebacks in a run's output, less torchrun's own: on a signal, torchrun re-raises it as a
    SignalException after its ranks have ended (its exit status is 1 whatever theirs were)."""
    blocks = log.split("Traceback (most recent call last):")[1:]
    return [b for b in blocks if "SignalException: Process" not in b]


def _ckpt(out: Path, step: int) -> Path:
    return (out / "checkpoints" / checkpoint.step_dir_name(step)).resolve()


# --------------------------------------------------------------------------- R13: Ctrl-C

@pytest.mark.parametrize("nproc, sig", [(1, signal.SIGINT), (2, signal.SIGINT), (1, signal.SIGTERM)],
                         ids=["ctrl-c-1rank", "ctrl-c-2ranks", "sigterm-to-group-1rank"])
def test_r13_ctrl_c_checkpoints_the_step_and_the_rerun_resumes_exactly(sample_data, tmp_path, nproc, sig, reference,
                                                                      group_cleanup):
    """One Ctrl-C mid-run (loader workers on): a checkpoint of the step in flight, exit 0 on every rank, no
    traceback; the rerun of the same command logs the losses of an uninterrupted run, bitwise. SIGTERM to
    the whole group (a scheduler, the deepspeed launcher) likewise: the loader worker must survive it."""
    out = tmp_path / "run"
    args = _args(sample_data, out, *EXTRA)
    log = tmp_path / "interrupted.log"
    proc = _start_group(args, nproc, log)
    group_cleanup(proc)
    logged = _wait_for_step(out, 3, proc)
    os.killpg(proc.pid, sig)
    sent = time.monotonic()
    rc = proc.wait(timeout=120)
    elapsed = time.monotonic() - sent
    text = log.read_text()
    stopped = _steps_logged(out)[-1]["step"]
    assert (out / "summary.json").is_file(), text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    print(f"R13: {sig.name} to the group of {nproc} rank(s) while step {logged + 1} ran: stopped after step {stopped}, "
          f"exit {rc} after {elapsed:.1f} s, checkpoint {checkpoint.find_latest(out / 'checkpoints')}")
    if nproc == 1:
        assert rc == 0, text[-3000:]
    else:  # torchrun reports the signal itself (exit 1); its ranks ended cleanly (pid files gone, summary written)
        assert not (out / "pids").exists(), text[-3000:]  # every rank's pid file gone, and the folder
        assert text.count("received SIGINT") == nproc
    assert not _rank_tracebacks(text), text[-3000:]
    assert summary["stopped_by"] == sig.name and summary["steps"] == stopped < STEPS
    assert checkpoint.find_latest(out / "checkpoints") == _ckpt(out, stopped)

    run_cli(*args, nproc=nproc)
    assert _losses(out) == _losses(reference(nproc))


@pytest.mark.parametrize("nproc", [1, 2])
def test_r13_a_second_ctrl_c_exits_at_once(sample_data, tmp_path, nproc, group_cleanup):
    """The first Ctrl-C cannot finish the step (rank 0 hangs in it; under torchrun rank 1 waits for it
    inside a collective); a second one ends every rank at once, no traceback from a rank or its
    loader worker. torchrun answers the second Ctrl-C with SIGTERM to its ranks."""
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = _start_group(_args(sample_data, out, "--steps", "20", "--num-workers", "1", "--debug-hang-at", "0:3"),
                        nproc, log)
    group_cleanup(proc)
    _wait_for_step(out, 1, proc)  # logged once step 2 is queued (steps are read one late); 3 never starts
    ranks = [int((out / "pids" / f"rank_{r}.pid").read_text()) for r in range(nproc)]
    _ctrl_c(proc)
    time.sleep(1.5)  # past the window in which a second signal is the same key press
    assert proc.poll() is None, log.read_text()[-3000:]
    _ctrl_c(proc)
    sent = time.monotonic()
    rc = proc.wait(timeout=60)
    elapsed = time.monotonic() - sent
    time.sleep(1)  # the loader workers notice their parent is gone
    text = log.read_text()
    alive = [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    print(f"R13: second Ctrl-C to {nproc} rank(s): exit {rc} after {elapsed:.2f} s, ranks left {alive}")
    if nproc == 1:
        assert rc == 128 + signal.SIGINT
    assert elapsed < 5 and not alive
    assert text.count("a second stop signal") == nproc and not _rank_tracebacks(text), text[-3000:]


def test_r13_ctrl_c_while_the_trainer_starts_is_one_line(sample_data, tmp_path, group_cleanup):
    """Ctrl-C a second after the command, while torch is imported and the run is checked (before
    the stop handlers, which come with the folder lock): one line and 130, no traceback."""
    log = tmp_path / "log.txt"
    proc = _start_group(_args(sample_data, tmp_path / "run", *EXTRA), 1, log)
    group_cleanup(proc)
    time.sleep(1.0)
    _ctrl_c(proc)
    assert proc.wait(timeout=60) == 128 + signal.SIGINT
    text = log.read_text()
    assert "Traceback" not in text, text
    assert text.strip().splitlines()[-1] == ("[bert_ds] rank 0: received SIGINT before the first step; "
                                             "nothing to save, exiting"), text


def _python(script: str) -> subprocess.CompletedProcess:
    """``python -c script`` in the project, as the CLI tests run it; the scripts Ctrl-C themselves."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), cwd=REPO,
                          timeout=60, preexec_fn=stop_signals_at_default)


def test_a_ctrl_c_inside_deferred_interrupt_comes_after_the_block():
    """The block runs to its end; the signal reaches Python's handler (KeyboardInterrupt) right
    after it, and that handler is back in place."""
    script = ("import os, signal, time\n"
              "from bert_ds.base.interrupts import deferred_interrupt\n"
              "reached = []\n"
              "try:\n"
              "    with deferred_interrupt():\n"
              "        os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)\n"
              "        reached.append('end of block')\n"
              "    reached.append('after the block')\n"
              "except KeyboardInterrupt:\n"
              "    print(reached, signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    proc = _python(script)
    assert proc.stdout.strip() == "['end of block'] True", proc.stdout + proc.stderr


def test_a_ctrl_c_during_an_exec_inside_deferred_interrupt_exits_with_the_status_returned():
    """Python 3.11 kills itself with SIGINT at exit (status -2) after a KeyboardInterrupt left an
    ``exec`` of source text, as every ``@dataclass`` runs one, even when it was caught; deferred,
    the interrupt is raised outside the exec, and a program that caught it ends with status 0."""
    script = ("from bert_ds.base.interrupts import deferred_interrupt\n"
              "try:\n"
              "    with deferred_interrupt():\n"
              "        exec('import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)')\n"
              "except KeyboardInterrupt:\n"
              "    print('caught')\n")  # and the program ends normally: status 0
    proc = _python(script)
    assert (proc.returncode, proc.stdout.strip()) == (0, "caught"), proc.stdout + proc.stderr


def test_a_ctrl_c_during_import_whole_comes_after_the_module_is_initialised(tmp_path):
    """The tools' and export's heavy imports (torch, transformers, matplotlib): the module
    initialises to its end, and the KeyboardInterrupt comes at the caller's line."""
    (tmp_path / "slow_module.py").write_text("import os, signal, time\n"
                                             "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)\n"
                                             "WHOLE = True\n")
    script = ("import sys\n"
              f"sys.path.insert(0, {str(tmp_path)!r})\n"
              "from bert_ds.base.interrupts import import_whole\n"
              "try:\n"
              "    import_whole('slow_module')\n"
              "except KeyboardInterrupt:\n"
              "    print(sys.modules['slow_module'].WHOLE)\n")
    proc = _python(script)
    assert (proc.returncode, proc.stdout.strip()) == (0, "True"), proc.stdout + proc.stderr


@pytest.mark.parametrize("interrupted", ["nothing written", lambda: "found out at the end"])
def test_an_entry_point_given_what_a_ctrl_c_leaves_ends_with_that_line_and_130(interrupted, capsys):
    """Commands without stop handlers of their own (export, the tools, evaluation) run through
    ``guarded(..., interrupted=...)``: the cleanup runs, then one line, no traceback."""
    cleaned = []

    def ctrl_c():
        raise KeyboardInterrupt

    assert guarded(ctrl_c, cleanup=lambda: cleaned.append(True), interrupted=interrupted) == EXIT_INTERRUPTED == 130
    said = interrupted() if callable(interrupted) else interrupted
    assert capsys.readouterr().err == f"\ninterrupted: {said}\n" and cleaned == [True]
    with pytest.raises(KeyboardInterrupt):  # not given: the entry point's own handlers say more
        guarded(ctrl_c)


def test_r13_sigint_twice_within_the_window_is_one_request(tmp_path):
    """The same key press reaching a rank twice (from the terminal and from a launcher) is one stop request;
    a SIGINT after the window ends the process at once."""
    script = ("import os, signal, sys, time\n"
              "from bert_ds.train.signals import StopRequest, REPEAT_AFTER_S\n"
              "stop = StopRequest(deadline_s=0); stop.install(); stop.begin_steps()\n"
              "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(0.2); print('recorded', stop.signal_name, flush=True)\n"
              "time.sleep(REPEAT_AFTER_S)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(30); print('still running', flush=True)\n")
    t = time.monotonic()
    proc = _python(script)
    elapsed = time.monotonic() - t
    assert proc.stdout.splitlines() == ["recorded SIGINT"], proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGINT and elapsed < 10


# --------------------------------------------------------------------------- item 12: a stop during validation

@pytest.mark.parametrize("nproc", [1, 2])
def test_r13_sigterm_during_validation_abandons_the_pass(sample_data, tmp_path, nproc, group_cleanup):
    """SIGTERM to the last rank during a validation pass (8,192 samples, many seconds on this
    preset): exit within seconds, the pass abandoned, the finished step saved, no step more."""
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    args = _args(sample_data, out, "--steps", "6", "--val-data", str(sample_data["heldout"]), "--val-every", "3",
                 "--val-samples", "8192")
    proc = _start_group(args, nproc, log)
    group_cleanup(proc)
    _wait_for_step(out, 3, proc)
    time.sleep(0.5)  # into step 3's validation pass
    os.kill(int((out / "pids" / f"rank_{nproc - 1}.pid").read_text()), signal.SIGTERM)
    sent = time.monotonic()
    rc = proc.wait(timeout=120)
    elapsed = time.monotonic() - sent
    text = log.read_text()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    bound = 5 + summary["last_save_s"]
    print(f"R13: SIGTERM to rank {nproc - 1} of {nproc} during validation at step 3: exit {rc} after "
          f"{elapsed:.1f} s (bound {bound:.1f} s), last step {records[-1]['step']}, "
          f"{sum(r.get('split') == 'val' for r in records)} validation records")
    assert rc == 0, text[-3000:]
    assert "during validation, pass abandoned" in text
    assert [r["step"] for r in records] == [1, 2, 3]  # no validation record, no step 4
    assert checkpoint.find_latest(out / "checkpoints") == _ckpt(out, 3)
    assert summary["stopped_by"] == ("SIGTERM" if nproc == 1 else "a signal to another rank")  # rank 0 writes it
    assert elapsed <= bound


# --------------------------------------------------------------------------- R17: one run per folder

def test_r17_a_second_run_into_the_folder_is_refused_and_a_killed_holder_blocks_nothing(sample_data, tmp_path,
                                                                                         group_cleanup):
    out = tmp_path / "run"
    # With a loader worker: forked while the trainer holds the folder, it outlives a kill -9
    # of the trainer by seconds, and must not hold the folder meanwhile.
    first = _start_group(_args(sample_data, out, "--steps", "500", "--num-workers", "1"), 1, tmp_path / "first.log")
    group_cleanup(first)
    _wait_for_step(out, 1, first)
    t = time.monotonic()
    second = run_cli(*_args(sample_data, out, "--steps", "500"), check=False)
    refused_s = time.monotonic() - t
    err = second.stderr.strip().splitlines()
    print(f"R17: second run into a busy folder: exit {second.returncode} after {refused_s:.1f} s: {err}")
    assert second.returncode == 2 and len(err) == 1, second.stderr[-3000:]
    assert err[0].startswith("error: ") and f"bert_ds.train (pid {first.pid} " in err[0]
    assert first.poll() is None

    # Two ranks refused: rank 0 says why, rank 1 learns it from rank 0 instead of waiting
    # at the rendezvous for torchrun to stop it.
    t = time.monotonic()
    second = run_cli(*_args(sample_data, out, "--steps", "500"), nproc=2, check=False, timeout=120)
    refused_s = time.monotonic() - t
    print(f"R17: 2 ranks into a busy folder: exit {second.returncode} after {refused_s:.1f} s")
    assert second.returncode != 0 and refused_s < 90, second.stderr[-3000:]  # a bound on a hang, not a speed
    assert f"bert_ds.train (pid {first.pid} " in second.stderr and "rank 0 refused the run" in second.stderr
    assert first.poll() is None

    workers = [pid for pid in _children(first.pid)]
    assert workers, "the trainer runs a loader worker"
    os.kill(first.pid, signal.SIGKILL)  # the trainer alone: its worker lives on for a while
    first.wait()
    third = run_cli(*_args(sample_data, out, "--steps", "2"), check=False)
    assert third.returncode == 0, third.stderr[-3000:]
    assert not (out / ".bert-ds.lock").exists()  # released and removed by its holder


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []
