"""Multi-node launch modes of run.sh, as two "nodes" on one machine (CPU, gloo).

Each test starts run.sh twice, once per node, the way a user starts it on each host:
``pretrain`` with NNODES=2 (torchrun, static ranks or the c10d rendezvous that the SLURM
recipe uses) and ``multinode`` (the deepspeed launcher, --no_ssh with NODE_RANK). One
process per node, tiny model; both must exit 0 and rank 0's metrics.jsonl must hold
every step.
"""

import json
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env, end, spawn

pytestmark = pytest.mark.distributed

STEPS = 4
TRAIN_ARGS = ["--preset", "tiny", "--seq-len", "64", "--global-batch-size", "16", "--micro-batch-size", "8",
              "--lr", "3e-2", "--warmup-steps", "2", "--val-samples", "32", "--no-progress", "--no-tensorboard",
              "--num-workers", "0", "--steps", str(STEPS)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def this_python(tmp_path):
    """A VENV for run.sh whose python is the interpreter running the tests (SETUP=none: no install)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return venv


def _launch_two_nodes(mode, env_per_node, venv, sample_data, out):
    args = ["--data", str(sample_data["train"]), "--val-data", str(sample_data["heldout"]),
            "--output", str(out), *TRAIN_ARGS]
    procs = []
    for node_env in env_per_node:
        env = {**cli_env(), "VENV": str(venv), "SETUP": "none", "NGPU": "1", **node_env}
        procs.append(spawn([str(REPO / "run.sh"), mode, *args], cwd=REPO, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            end(proc)
    for node, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}\n{output[-6000:]}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "split" not in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert sum(r.get("split") == "val" for r in records) == 1
    assert (out / "checkpoints" / "latest" / "COMPLETE").is_file()
    return outputs


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_pretrain_on_two_nodes_with_torchrun(sample_data, tmp_path, this_python, rendezvous):
    port = str(_free_port())
    common = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RDZV_ID": f"test-{port}"}
    nodes = [{**common, "NODE_RANK": str(rank)} if rendezvous == "static" else common for rank in (0, 1)]
    outputs = _launch_two_nodes("pretrain", nodes, this_python, sample_data, tmp_path / "run")
    # rank 0 states the world: 2 ranks of 1 process each
    assert any("x 2 ranks" in output for output in outputs), outputs[0][-3000:]


def test_multinode_with_the_deepspeed_launcher_without_ssh(sample_data, tmp_path, this_python):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    common = {"HOSTFILE": str(hostfile), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    outputs = _launch_two_nodes("multinode", [{**common, "NODE_RANK": "0"}, {**common, "NODE_RANK": "1"}],
                                this_python, sample_data, tmp_path / "run")
    assert any("x 2 ranks" in output for output in outputs), outputs[0][-3000:]


def test_multinode_without_a_hostfile_is_a_one_line_error(tmp_path, this_python):
    env = {**cli_env(), "VENV": str(this_python), "SETUP": "none", "HOSTFILE": str(tmp_path / "nope")}
    proc = subprocess.run([str(REPO / "run.sh"), "multinode"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "hostfile" in err[0] and "nope" in err[0]


def test_pretrain_on_several_nodes_needs_master_addr(tmp_path, this_python):
    env = {k: v for k, v in cli_env().items() if k != "MASTER_ADDR"}
    env.update(VENV=str(this_python), SETUP="none", NNODES="2", RUN_DIR=str(tmp_path / "run"))
    proc = subprocess.run([str(REPO / "run.sh"), "pretrain", "--data", str(tmp_path / "data")], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "MASTER_ADDR must name node 0" in proc.stderr
    assert not (tmp_path / "run").exists()  # stopped before anything started


@pytest.mark.parametrize("env, line", [
    ({"NGPU": "abc"}, "run.sh: NGPU must be a whole number >= 1, got 'abc'"),
    ({"NGPU": "0"}, "run.sh: NGPU must be a whole number >= 1, got '0'"),
    ({"NNODES": "two"}, "run.sh: NNODES must be a whole number >= 1, got 'two'"),
    ({"NGPU": "1"}, "run.sh: no shards in {run}/data/train: make them with ./run.sh prepare (RUN_DIR={run}), or give "
                    "--data"),
])
def test_pretrain_refuses_a_bad_count_or_missing_shards_in_one_line(tmp_path, this_python, env, line):
    run = tmp_path / "run"
    env = {**cli_env(), "VENV": str(this_python), "SETUP": "none", "RUN_DIR": str(run), **env}
    proc = subprocess.run([str(REPO / "run.sh"), "pretrain"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line.format(run=run)], proc.stderr
    assert not run.exists()


@pytest.mark.parametrize("given, sample", [
    (["--data", "mine"], False),
    (["--data=mine", "--val-data", "my-heldout"], False),
    ([], True),
], ids=["data", "data-and-val-data", "the-sample"])
def test_pretrain_adds_the_samples_folders_only_without_the_users_data(tmp_path, given, sample):
    """``./run.sh pretrain --data D`` trains on D with no held-out set of the sample corpus's (one of
    another tokenizer, or never made); without --data, on the sample's shards and held-out set."""
    run = tmp_path / "run"
    (run / "data" / "train").mkdir(parents=True)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"  # answers the CUDA probe (-c) and prints the trainer's arguments
    python.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then exec "{sys.executable}" "$@"; fi\necho "$@"\n')
    python.chmod(0o755)
    env = {**cli_env(), "VENV": str(venv), "SETUP": "none", "NGPU": "1", "RUN_DIR": str(run)}
    proc = subprocess.run([str(REPO / "run.sh"), "pretrain", *given], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.split()
    assert argv[:2] == ["-m", "bert_ds.train"], argv
    assert argv[len(argv) - len(given):] == given, argv  # the user's arguments last, as given
    samples = [a for a in argv if a.startswith(str(run / "data"))]
    assert samples == ([str(run / "data" / "train"), str(run / "data" / "heldout")] if sample else []), argv
