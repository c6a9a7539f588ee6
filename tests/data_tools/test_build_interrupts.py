"""R13 and R17 for builds: Ctrl-C or SIGTERM to a build's process group stops it within
seconds, in one line and without a traceback, leaving only finished shards, which a rerun
resumes to the bytes of an uninterrupted build; a second build into a folder in use is
refused in one line naming the holder."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bert_ds.data_tools.build import JOURNAL_NAME, BuildOptions, build
from bert_ds.base.locking import LOCK_NAME, FolderBusy, FolderLock
from bert_ds.data_tools.manifest import MANIFEST_NAME
from bert_ds.data_tools.shard_format import ShardReader
from tests.conftest import REPO, cli_env, stop_signals_at_default

SAMPLE = Path(__file__).resolve().parents[2] / "data_tools" / "sample" / "valid.txt"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The sample eight times over (~9 MB: several seconds of tokenizing) and a vocabulary."""
    root = tmp_path_factory.mktemp("interrupts")
    text = SAMPLE.read_text(encoding="utf-8")
    big = root / "big.txt"
    big.write_text(text * 8, encoding="utf-8")
    vocab_dir = root / "vocab"
    build(BuildOptions(inputs=[str(SAMPLE)], output=str(vocab_dir), train_vocab=2048, progress=False, workers=1))
    return big, vocab_dir / "vocab.txt"


def _build_args(corpus, out):
    big, vocab = corpus
    return ["build", "--input", str(big), "--output", str(out), "--vocab", str(vocab), "--split-sentences",
            "--shard-tokens", "100000", "--workers", "2", "--no-progress"]


def _finished_shards(out: Path) -> int:
    try:
        return len(json.loads((out / JOURNAL_NAME).read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_to_the_process_group_ends_the_build_cleanly(corpus, tmp_path, signum):
    out = tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-m", "bert_ds.data_tools", *_build_args(corpus, out)], cwd=REPO, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=stop_signals_at_default)
    deadline = time.monotonic() + 120
    while _finished_shards(out) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the build finished before it could be interrupted: make the corpus larger"
    os.killpg(proc.pid, signum)  # as a terminal's Ctrl-C does: every process of the group
    t0 = time.monotonic()
    stdout, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 128 + signum
    assert stderr.strip().splitlines() == [
        f"stopped by {signal.Signals(signum).name}: finished shards are kept in {out}; rerun the same command "
        "to resume"], stderr
    with pytest.raises(ProcessLookupError):  # no worker outlived the build
        for _ in range(50):
            os.killpg(proc.pid, 0)
            time.sleep(0.1)
    names = sorted(p.name for p in out.iterdir())
    assert MANIFEST_NAME not in names and LOCK_NAME not in names
    assert not [n for n in names if n.endswith(".tmp")]
    shards = sorted(n[:-4] for n in names if n.startswith("shard_") and n.endswith(".bin"))
    assert len(shards) == _finished_shards(out) >= 2
    for name in shards:
        with ShardReader(out / name) as reader:
            reader.verify()


_WORKER_LEFT_WITH_A_RESULT = """
import multiprocessing, sys, time
from bert_ds.data_tools import build

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")  # as the build starts its workers
    mine, theirs = ctx.Pipe()
    worker = ctx.Process(target=build._worker_main, args=(theirs,))
    worker.start()
    theirs.close()
    mine.send((sys.argv[1], False))  # tokenizer.json, and whether lines are encoded as text
    mine.send(([["Some text here.", "And more."]], [True]))
    while not mine.poll():
        time.sleep(0.01)
    mine.close()  # as a stopped build does: the worker's result unread, so its next recv() is reset
    worker.join()
    print("worker exit", worker.exitcode)
"""


def test_a_worker_whose_result_is_left_unread_ends_without_a_traceback(corpus, tmp_path):
    """The race behind a traceback after Ctrl-C on a loaded machine: the main process is stopped
    between a worker's result and reading it, closes its end, and the worker's next recv() is a
    ConnectionResetError, printed unless the worker takes it as the end."""
    _, vocab = corpus
    script = tmp_path / "left.py"
    script.write_text(_WORKER_LEFT_WITH_A_RESULT)
    proc = subprocess.run([sys.executable, str(script), str(vocab.parent / "tokenizer.json")], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "worker exit 0", proc.stdout + proc.stderr
    assert proc.stderr == ""


def test_the_rerun_after_ctrl_c_resumes_to_the_uninterrupted_bytes(corpus, tmp_path):
    out = tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-m", "bert_ds.data_tools", *_build_args(corpus, out)], cwd=REPO, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=stop_signals_at_default)
    while _finished_shards(out) < 2 and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=30)
    kept = _finished_shards(out)
    assert proc.returncode == 130 and kept >= 2

    big, vocab = corpus
    opts = dict(vocab=str(vocab), split_sentences=True, shard_tokens=100_000, progress=False, workers=2)
    resumed = build(BuildOptions(inputs=[str(big)], output=str(out), **opts))
    assert resumed.shards_reused == kept
    whole = build(BuildOptions(inputs=[str(big)], output=str(tmp_path / "whole"), **opts))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in whole.directory.iterdir()}


def test_a_second_build_into_a_folder_in_use_is_refused_naming_the_holder(corpus, tmp_path, capsys):
    from bert_ds.data_tools.__main__ import main

    out = tmp_path / "data"
    with FolderLock(out, "another build"):
        rc = main(_build_args(corpus, out))
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1
        assert err[0].startswith(f"error: {out} is in use by another build (pid {os.getpid()} on ")
        assert err[0].endswith("; wait for it to end or stop it, or choose another folder")
    assert not out.joinpath(LOCK_NAME).exists()
    assert main(_build_args(corpus, out)) == 0  # free again


def test_a_lock_left_by_a_killed_holder_does_not_block(tmp_path):
    out = tmp_path / "data"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from bert_ds.base.locking import FolderLock\n"
                               f"FolderLock({str(out)!r}, 'a doomed holder').__enter__(); print('held', flush=True); "
                               "time.sleep(60)"], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    assert (out / LOCK_NAME).exists()  # left behind, but no longer locked
    with FolderLock(out, "the next run"):
        assert "the next run" in (out / LOCK_NAME).read_text()


def test_a_child_forked_by_a_killed_holder_does_not_keep_the_lock(tmp_path):
    # A trainer's loader workers are forked while it holds its folder; they outlive a
    # kill -9 of it by seconds and must not hold the folder meanwhile.
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; from bert_ds.base.locking import FolderLock\n"
                               f"FolderLock({str(out)!r}, 'a trainer').__enter__()\n"
                               "child = os.fork()\n"
                               "if child == 0:\n    os.write(1, b'child runs\\n'); time.sleep(60); os._exit(0)\n"
                               "os.write(1, f'{child}\\n'.encode()); time.sleep(60)"],
                              cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, text=True)
    # Both lines, in either order, each one write (two processes share the pipe): the child has run (its at-fork handler runs before its first
    # line), so what is tested is its state once it runs, whatever the scheduler's order.
    lines = {holder.stdout.readline().strip() for _ in range(2)}
    assert "child runs" in lines, lines
    child = int(next(line for line in lines if line != "child runs"))
    try:
        with pytest.raises(FolderBusy, match="in use by a trainer"):  # the parent still holds it
            FolderLock(out, "too early").__enter__()
        holder.kill()
        holder.wait()
        os.kill(child, 0)  # the forked child is still alive ...
        with FolderLock(out, "the next run"):  # ... and the folder is free
            assert "the next run" in (out / LOCK_NAME).read_text()
    finally:
        os.kill(child, signal.SIGKILL)
