"""Shared fixtures: a small real dataset built from the bundled sample corpus,
and helpers that run the entry points the way a user does (as processes).

Every process a test starts is ended when the test ends, whether it passed, failed or
timed out, the ranks under a launcher included: :func:`spawn` starts the command in its
own session and marks it (and so everything it starts) with ``TEST_TAG_ENV`` in its
environment. The session's process group is killed first; the tag then finds the
processes that left the group (``torchrun`` starts each rank in a session of its own)
or outlived their parent.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

# One thread per process: the suite runs one worker per core (run.sh test), and each worker's
# torch, and every process a test starts, would otherwise start a thread per core too, which
# on a 2-core machine spin-wait against each other. Before torch is imported here; a test or
# process that sets its own count keeps it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from bert_ds.train.extensions import use_environment_cache

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "data_tools" / "sample"

# DeepSpeed's communication op, built by set-up into the environment's cache: the test
# processes that start DeepSpeed themselves (probes, workers, this one) load it from there,
# with the same ninja, as the entry points do, instead of rebuilding it (~100 s of CPU).
use_environment_cache()


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed must not probe for CUDA in CPU tests
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


TEST_TAG_ENV = "BERT_DS_TEST_PROCESS"
_tags = itertools.count()
_tag_of: dict[int, str] = {}  # pid of a spawn()ed process -> the tag of everything it starts
_started: list[subprocess.Popen] = []  # by spawn(), ended after each test


def spawn(cmd: list[str], env: dict[str, str] | None = None, **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` in a session of its own, ended with all it started after the test."""
    tag = f"{os.getpid()}-{next(_tags)}"
    env = {**(env if env is not None else cli_env()), TEST_TAG_ENV: tag}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, **popen_kwargs)
    _tag_of[proc.pid] = tag
    _started.append(proc)
    return proc


def stop_signals_at_default() -> None:
    """``preexec_fn`` of a child that a test will Ctrl-C or send a stop signal: SIGINT, SIGTERM
    and SIGUSR1 at their default, as a terminal's foreground command has them.

    A child inherits the signals its parent ignores, and a shell starts a background job
    (``nohup ./run.sh test &``, some CI runners) with SIGINT ignored: a Ctrl-C the test sends
    would then do nothing, as the commands mean it to for a user who asked for that. Only the
    children a test signals get it, not every :func:`spawn`: with a ``preexec_fn`` subprocess
    forks the whole test process instead of using vfork, and runs Python before the exec."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_DFL)


def started_by(proc: subprocess.Popen) -> list[int]:
    """The live processes of :func:`spawn`'s ``proc``: it and everything it started."""
    marker = f"{TEST_TAG_ENV}={_tag_of[proc.pid]}".encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path("/proc", pid, "environ").read_bytes()
        except OSError:  # ended meanwhile, or not ours
            continue
        if marker in environ.split(b"\0"):
            pids.append(int(pid))
    return pids


def end(proc: subprocess.Popen) -> None:
    """SIGKILL :func:`spawn`'s ``proc``, its process group and every process it started; reap it."""
    if proc in _started:
        _started.remove(proc)
    if proc.poll() is None:  # while the leader lives its group id cannot name another group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in started_by(proc):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


@pytest.fixture(autouse=True)
def _end_started_processes():
    yield
    while _started:
        end(_started[-1])


def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run`` with output captured; whatever the command started is ended on
    return, on a timeout and on any error."""
    child = spawn(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    finally:
        end(child)
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def run_cli(*args: str, timeout: float = 600, check: bool = True, nproc: int = 1,
            launcher: str = "torchrun", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m ARGS`` (``nproc`` > 1: under torchrun or the deepspeed launcher), in
    ``env`` (default :func:`cli_env`)."""
    cmd = [sys.executable, "-m"]
    if nproc > 1 and launcher == "torchrun":
        cmd += ["torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"]
    elif nproc > 1:
        port = str(20000 + os.getpid() % 20000)
        cmd += ["deepspeed.launcher.runner", f"--num_gpus={nproc}", f"--master_port={port}", "--module"]
    proc = run_command(cmd + list(args), timeout, env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory) -> dict[str, Path]:
    """Train and held-out shards from the sample corpus, with a 2,048-token vocabulary."""
    root = tmp_path_factory.mktemp("sample-data")
    run_cli("bert_ds.data_tools", "build", "--input", str(SAMPLE / "valid.txt"), "--output", str(root / "train"),
            "--train-vocab", "2048", "--split-sentences", "--workers", "1")
    run_cli("bert_ds.data_tools", "build", "--input", str(SAMPLE / "test.txt"), "--output", str(root / "heldout"),
            "--vocab", str(root / "train" / "vocab.txt"), "--split-sentences", "--workers", "1")
    return {"train": root / "train", "heldout": root / "heldout"}


BPE_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                "mask_token": "[MASK]"}
# Their ids: [UNK] 0, [CLS] 1, [SEP] 2, [PAD] 3, [MASK] 4. The pad is not 0, as in ModernBERT's own
# vocabulary (50,283) and most BPE ones: a run that took 0 for it would freeze an ordinary token's row.
BPE_SPECIAL_ORDER = ("unk_token", "cls_token", "sep_token", "pad_token", "mask_token")


def bpe_tokenizer(lines: list[str], vocab_size: int, *, prefix_space: bool = True, **settings):
    """A byte-level BPE tokenizer trained on ``lines``, ModernBERT's kind: its special tokens named,
    ``[CLS] A [SEP]`` and ``[CLS] A [SEP] B [SEP]`` on encoding; transformers' generic fast tokenizer
    with ``settings`` (a special token's name, ``padding_side``...). ModernBERT's own adds no prefix
    space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BPE_SPECIALS[k] for k in BPE_SPECIAL_ORDER], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **{**BPE_SPECIALS, **settings})


def make_bpe_tokenizer(folder: Path, lines: list[str], vocab_size: int, **options) -> Path:
    """``bpe_tokenizer`` saved in ``folder`` as transformers saves one."""
    bpe_tokenizer(lines, vocab_size, **options).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def sample_bpe_data(tmp_path_factory) -> dict[str, Path]:
    """Train and held-out shards from the sample corpus through a 4,096-entry byte-level BPE
    (``build --tokenizer``), for ModernBERT-class runs."""
    root = tmp_path_factory.mktemp("sample-bpe-data")
    tokenizer = make_bpe_tokenizer(root / "tokenizer", (SAMPLE / "valid.txt").read_text().splitlines(), 4096)
    for split, text in (("train", "valid.txt"), ("heldout", "test.txt")):
        run_cli("bert_ds.data_tools", "build", "--input", str(SAMPLE / text), "--output", str(root / split),
                "--tokenizer", str(tokenizer), "--workers", "1")
    return {"train": root / "train", "heldout": root / "heldout", "tokenizer": tokenizer}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``long`` first: pytest-xdist's workers take the collected order in turn
    and steal from each other's tails, so a long test collected late would run alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: the rest keep their order
