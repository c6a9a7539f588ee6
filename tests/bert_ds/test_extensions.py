"""R14: a start-up never blocks forever on DeepSpeed's extension build lock, and a stop
signal before the first step ends the process at once.

The trainings here use a copy of this environment's built extension cache (what
``./run.sh setup`` builds), so no test compiles the op (35-50 s)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bert_ds.base import build_locks
from bert_ds.train import extensions
from bert_ds.train.signals import STARTUP_EXIT_GRACE_S
from bert_ds.base.errors import EXIT_USER_ERROR, UserError
from tests.conftest import REPO, cli_env, run_cli, spawn, stop_signals_at_default

OP = "deepspeed_shm_comm"  # the op DeepSpeed's init_distributed loads on CPU
HOLD = "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(300)"


@pytest.fixture(scope="module")
def built_cache() -> Path:
    """This environment's extension cache, built by the set-up step."""
    run_cli("bert_ds.train.extensions", timeout=300)
    root = extensions.cache_root()
    assert (root / OP / f"{OP}.so").is_file()
    return root


@pytest.fixture
def cache(built_cache, tmp_path) -> Path:
    """A private copy of the built cache: the tests put locks into it."""
    root = tmp_path / "torch_extensions"
    shutil.copytree(built_cache, root, ignore=shutil.ignore_patterns(build_locks.LOCK_NAME))
    return root


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not seen within {timeout} s"
        time.sleep(0.05)


def _hold(lock: Path) -> subprocess.Popen:
    """A live process holding ``lock`` the way torch's FileBaton does (the file open)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = spawn([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _train(data: dict[str, Path], out: Path, cache: Path, preexec_fn=None, **env: str) -> subprocess.Popen:
    args = ["--data", str(data["train"]), "--output", str(out), "--preset", "tiny", "--seq-len", "64",
            "--global-batch-size", "8", "--micro-batch-size", "8", "--steps", "1", "--no-progress",
            "--no-tensorboard", "--num-workers", "0"]
    return spawn([sys.executable, "-m", "bert_ds.train", *args], env={**cli_env(), extensions.CACHE_ENV: str(cache), **env},
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, preexec_fn=preexec_fn)


def _polls(watch: build_locks.LockWatch, n: int) -> list[bool]:
    return [watch.poll(time.monotonic()) for _ in range(n)]


def test_r14_the_build_cache_belongs_to_the_environment_unless_the_user_chose_one(tmp_path, monkeypatch):
    monkeypatch.delenv(extensions.CACHE_ENV, raising=False)
    # two environments (two checkouts, a symlinked venv) no longer share ~/.cache/torch_extensions
    assert extensions.use_environment_cache() == Path(sys.prefix) / "torch_extensions"
    assert os.environ[extensions.CACHE_ENV] == str(Path(sys.prefix) / "torch_extensions")
    monkeypatch.setenv(extensions.CACHE_ENV, str(tmp_path))
    assert extensions.use_environment_cache() == tmp_path


def test_r14_the_build_runs_the_environments_ninja_before_another_on_path(tmp_path, monkeypatch):
    """A ninja of another version earlier on PATH (a system one) would read the build log as
    out of date and rebuild the op; the interpreter's own (the ninja wheel) comes first."""
    env_bin, other = tmp_path / "venv" / "bin", tmp_path / "usr" / "bin"
    for folder in (env_bin, other):
        folder.mkdir(parents=True)
        (folder / "ninja").write_text("#!/bin/sh\n")
        (folder / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(env_bin / "python"))
    monkeypatch.setenv("PATH", str(other))
    extensions.use_environment_ninja()
    assert shutil.which("ninja") == str(env_bin / "ninja")
    extensions.use_environment_ninja()  # once is enough: PATH does not grow
    assert os.environ["PATH"] == os.pathsep.join([str(env_bin), str(other)])
    (env_bin / "ninja").unlink()  # an environment without the wheel leaves PATH as it is
    monkeypatch.setenv("PATH", str(other))
    extensions.use_environment_ninja()
    assert os.environ["PATH"] == str(other)


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf", "nan"])
def test_r14_a_bad_lock_timeout_is_one_line(monkeypatch, value):
    monkeypatch.setenv(build_locks.LOCK_TIMEOUT_ENV, value)
    with pytest.raises(UserError, match=build_locks.LOCK_TIMEOUT_ENV):
        build_locks.lock_timeout_s()


def test_r14_a_stale_lock_is_removed_with_a_note(tmp_path, capfd):
    lock = tmp_path / OP / build_locks.LOCK_NAME
    lock.parent.mkdir()
    lock.touch()
    watch = build_locks.LockWatch(tmp_path, timeout_s=60)
    assert _polls(watch, 2) == [True, False]  # removed on the second look, not the first (FileBaton closes, then removes)
    assert not lock.exists()
    assert f"removed a stale build lock {lock}" in capfd.readouterr().err


def test_r14_a_lock_is_live_while_its_holder_runs_and_stale_once_it_is_killed(tmp_path, capfd):
    lock = tmp_path / OP / build_locks.LOCK_NAME
    holder = _hold(lock)
    assert build_locks.lock_holders(lock) == [holder.pid]
    watch = build_locks.LockWatch(tmp_path, timeout_s=60)
    assert _polls(watch, 3) == [True, True, True]
    assert lock.exists()
    holder.kill()
    holder.wait()
    assert build_locks.lock_holders(lock) == []
    assert _polls(watch, 2) == [True, False]
    assert not lock.exists()
    assert "removed a stale build lock" in capfd.readouterr().err


def test_r14_a_start_killed_during_the_build_is_followed_by_a_normal_start(sample_data, tmp_path, built_cache):
    cache = tmp_path / "torch_extensions"
    lock = cache / OP / build_locks.LOCK_NAME
    build = spawn([sys.executable, "-m", "bert_ds.train.extensions"], env={**cli_env(), extensions.CACHE_ENV: str(cache)},
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    _wait_for(lock.exists, 120, "the build's lock")
    os.killpg(build.pid, signal.SIGKILL)  # the build and its compiler processes, mid-build
    build.wait()
    assert lock.exists()
    # The objects as a finished compile leaves them, so that the start below loads the op
    # instead of compiling it for 35-50 s; the lock stays the one the killed build left.
    for f in (built_cache / OP).iterdir():
        if f.name != build_locks.LOCK_NAME:
            shutil.copy2(f, cache / OP / f.name)
    train = _train(sample_data, tmp_path / "run", cache)
    out, err = train.communicate(timeout=300)
    assert train.returncode == 0, err[-4000:]
    assert f"removed a stale build lock {lock}" in err
    assert not lock.exists()
    assert "steps            1" in out


def test_r14_a_live_lock_is_waited_on_for_the_bound_then_one_line(sample_data, tmp_path, cache):
    lock = cache / OP / build_locks.LOCK_NAME
    holder = _hold(lock)
    bound = 4
    train = _train(sample_data, tmp_path / "run", cache, **{build_locks.LOCK_TIMEOUT_ENV: str(bound)})
    _, err = train.communicate(timeout=120)
    assert train.returncode == EXIT_USER_ERROR, err[-4000:]
    assert f"waiting for DeepSpeed's extension build lock {lock}, held by pid {holder.pid}" in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"still held by pid {holder.pid}" in errors[0] and f"after {bound} s" in errors[0]
    assert "Traceback" not in err
    assert holder.poll() is None and lock.exists()  # a live holder's lock is never taken from it


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_r14_a_stop_signal_before_the_first_step_exits_promptly(sample_data, tmp_path, cache, sig):
    lock = cache / OP / build_locks.LOCK_NAME
    _hold(lock)  # keeps the start waiting where SIGTERM used to be put off "until the next step"
    train = _train(sample_data, tmp_path / "run", cache, preexec_fn=stop_signals_at_default,
                   **{build_locks.LOCK_TIMEOUT_ENV: "60"})
    err_lines: list[str] = []
    _wait_for(lambda: "waiting for DeepSpeed's extension build lock" in _read_line(train, err_lines), 120,
              "the waiting message")
    sent = time.monotonic()
    train.send_signal(sig)
    _, rest = train.communicate(timeout=60)
    took = time.monotonic() - sent
    err = "".join(err_lines) + rest
    assert train.returncode == 128 + sig, err[-4000:]
    assert took < STARTUP_EXIT_GRACE_S, f"exited {took:.1f} s after {sig.name}"
    assert f"received {sig.name} before the first step; nothing to save, exiting" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def _read_line(proc: subprocess.Popen, lines: list[str]) -> str:
    """The next line of ``proc``'s stderr (kept in ``lines``)."""
    line = proc.stderr.readline()
    lines.append(line)
    assert line or proc.poll() is None, f"exited {proc.returncode} before the line: {''.join(lines)[-4000:]}"
    return line
