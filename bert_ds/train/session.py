"""The process around a run: distributed start-up, stop signals, peer failures, the run
folder's lock, and the entry point's exit status.

- :func:`entry` runs an entry point's body through :func:`bert_ds.base.errors.guarded` (one
  ``error:`` line and the exit status of :mod:`bert_ds.base.errors`, where every status is
  defined) and destroys the process group on every path.
- :func:`training_session` installs the stop-signal handlers (:mod:`.signals`) before the
  process group exists, so that a signal during start-up ends the process at once;
  :func:`locked_session` holds the run folder's lock around it, and a refusal ends every rank.
- :func:`peer_failures` turns a collective that failed on a hung or dead peer into a
  :class:`~bert_ds.base.errors.RankFailure` naming the ranks that did not report back.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bert_ds import zero
from bert_ds.base.dynamo import import_dynamo_when_compiling
from bert_ds.base.errors import RankFailure, guarded
from bert_ds.base.locking import FolderBusy, FolderLock
from bert_ds.train.signals import StopRequest


def entry(body: Callable[[], object]) -> int:
    """Run an entry point's body; the failures users act on become one line and an exit status.

    A rank of a run of several ends without interpreter finalization: DeepSpeed keeps its gloo
    groups alive past ``destroy_process_group``, and a gloo thread that drops the last reference
    to a finished collective's tensor while Python finalizes aborts the process inside C++
    (SIGABRT, exit -6, after a run that finished and saved; seen with torch 2.11 about once in
    15 two-rank runs). So the exit handlers run (logging, the loader workers' end), the streams
    are flushed, and the process exits with its status there."""
    import_dynamo_when_compiling()  # a rank compiles only with --compile-layers: 2-2.5 s of CPU less to start
    zero.name_cpu_accelerator()  # before anything imports DeepSpeed (checking the engine's JSON does)
    status = guarded(body, cleanup=_end_process)
    if _had_peers:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


_had_peers = False  # this process was a rank of a run of several


def _end_process() -> None:
    global _had_peers
    if dist.is_available() and dist.is_initialized():
        _had_peers = dist.get_world_size() > 1
        dist.destroy_process_group()
    # The interpreter's last garbage collection would walk every torch/DeepSpeed object
    # (2 s and more on a busy machine, after a stop signal too); everything is closed by now.
    gc.freeze()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Join the launcher's process group, or form a group of one. Every collective, the
    start-up rendezvous included, fails after ``timeout_s`` instead of waiting forever."""
    from bert_ds.train import extensions

    extensions.use_environment_cache()  # before DeepSpeed builds its communication op
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    cuda = torch.cuda.is_available()
    timeout = timedelta(seconds=timeout_s)
    with extensions.bounded_build_locks():  # the JIT build's lock: stale removed, live waited on (bounded)
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", timeout=timeout)
    zero.world_group_with_timeout(timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


@contextlib.contextmanager
def training_session(collective_timeout: float) -> Iterator[tuple[int, int, torch.device, StopRequest]]:
    """Stop-signal handlers and the process group, for one or more runs in this process."""
    stop = StopRequest(deadline_s=collective_timeout, rank=int(os.environ.get("RANK", "0")))
    stop.install()  # before the process group: a signal during start-up ends the process at once
    try:
        rank, world, device = init_distributed(collective_timeout)
        stop.rank = rank
        yield rank, world, device, stop
    finally:
        stop.uninstall()


@contextlib.contextmanager
def locked_session(output: str | os.PathLike, command: str,
                   collective_timeout: float) -> Iterator[tuple[int, int, torch.device, StopRequest]]:
    """OUTPUT's folder lock (``bert_ds.base.locking``) for the run's whole life, around
    :func:`training_session`: a second run into the same folder is refused (R17) before it
    reads or builds anything, on every rank at once.

    Only global rank 0 (the launcher's ``RANK``, read before the process group exists) takes
    the lock: the ranks of one run share the folder, on one node or, through a shared
    filesystem, on several, and must not lock each other out. A refused rank 0 of a run of
    several ranks still joins the process group, and every rank learns of the refusal from
    one all-reduce right after the rendezvous and ends with the same line; a rank 0 that
    simply exited would leave the others waiting at the rendezvous until their launcher
    stopped them (torchrun: about 40 s). A run of one rank is refused before any start-up.
    """
    refused: FolderBusy | None = None
    with contextlib.ExitStack() as stack:
        if int(os.environ.get("RANK", "0")) == 0:
            try:
                stack.enter_context(FolderLock(output, command))
            except FolderBusy as busy:
                if int(os.environ.get("WORLD_SIZE", "1")) == 1:
                    raise
                refused = busy
        rank, world, device, stop = stack.enter_context(training_session(collective_timeout))
        if world > 1:
            flag = torch.tensor([float(refused is not None)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                raise refused or FolderBusy(f"{output} is in use: rank 0 refused the run (its own line names "
                                            "the holder)")
        yield rank, world, device, stop


@contextlib.contextmanager
def pid_file(output: Path, rank: int) -> Iterator[None]:
    """OUTPUT/pids/rank_N.pid while the rank trains: whom to signal for a graceful stop. The
    last rank out removes the folder."""
    path = output / "pids" / f"rank_{rank}.pid"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # another rank's file is still there
            path.parent.rmdir()


@contextlib.contextmanager
def peer_failures(rank: int, world: int, timeout_s: float, step: Callable[[], int]) -> Iterator[None]:
    """Turn a collective that failed because a peer hung or died into a RankFailure naming the
    ranks that did not report back; other errors pass through unchanged."""
    try:
        yield
    except RuntimeError as e:
        if world == 1:
            raise
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        missing = _ranks_not_reporting(rank, world, wait_s=min(2.0, timeout_s))
        timed_out = "timed out" in first.lower() or "timeout" in first.lower()
        if not missing and not timed_out:
            raise
        who = ("could not reach the rendezvous store to tell which rank" if missing is None else
               f"rank(s) {', '.join(map(str, missing))} did not report back (hung or dead)" if missing else
               "every rank reported back")
        raise RankFailure(f"rank {rank}: a collective failed during step {step()} "
                          f"(--collective-timeout {timeout_s:g} s): {first.strip()}; {who}") from e


def _ranks_not_reporting(rank: int, world: int, wait_s: float) -> list[int] | None:
    """Check in at the launcher's store and list the ranks that do not within ``wait_s``
    (every surviving rank checks in as its collective fails); None if the store is unreachable."""
    prefix = f"bert_ds/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=wait_s))
        store.set(f"{prefix}{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world) if not store.check([f"{prefix}{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except (KeyError, ValueError, RuntimeError, OSError):
        return None
