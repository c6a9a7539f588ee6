"""Checkpoints that are committed last and never loaded half-written.

Layout of ``OUTPUT/checkpoints/``::

    step_00000100/
        ds/state/...          DeepSpeed engine, optimizer and scheduler state (every rank)
        model.safetensors     full fp32 weights (master copy), Hugging Face parameter names
        optimizer.safetensors full (unpartitioned) optimizer state per parameter, LR schedule
        model_config.json     the model family's config (with its arch)
        train_config.json     the TrainConfig of the run
        train_state.json      step, data cursor, tokens seen, skipped steps
        rng/rank_00000.pt     Python, NumPy and torch generator states of each rank
        tokenizer/            the dataset's Hugging Face tokenizer files
        COMPLETE              written last: size and CRC32 of every file above
    latest -> step_00000100   a symlink, moved with os.replace after the folder is committed

Why: a crash at any point leaves either the previous checkpoint or the new one,
never a mix. Everything is written into ``.tmp-step_...``, fsynced, marked
``COMPLETE``, then renamed; only then is ``latest`` moved. A folder without its
marker is never loaded, and a file whose CRC no longer matches is reported by name.
A write that fails (disk full, a read-only folder) on any rank is agreed by every rank
where a barrier stood: the temporary folder is removed, every rank raises
:class:`CheckpointSaveError`, and the previous checkpoint stays ``latest``.
``model.safetensors`` lets `bert_ds.checkpoint.export` work without DeepSpeed or the world size
the run had.

Resuming on another world size (R8 in the README's reliability promises): DeepSpeed's ZeRO-1/2 files hold one
optimizer partition per rank, laid out for that world size. Rather than re-cutting
DeepSpeed's flat partitions offline (its universal-checkpoint converter), every
checkpoint also carries the world-size-free state: the fp32 master weights
(``model.safetensors``) and each parameter's full optimizer state (``exp_avg``,
``exp_avg_sq``, gathered the same way the weights are, with DeepSpeed's public
``safe_get_full_optimizer_state``), plus the step counts and the LR schedule. Resuming
on the world size of the save loads DeepSpeed's own files (bitwise exact, loss scaler
and RNG included); on any other world size the engine is built fresh and given those
tensors (``safe_set_full_*``; both directions go through :mod:`bert_ds.zero`, which owns
every use of DeepSpeed's internals), which is exact too, except that an fp16 loss scale
starts over and dropout's RNG streams are per rank. The price is one more copy of the
optimizer state per checkpoint (2 x fp32 model size for LAMB/AdamW).

Fault injection: a save passes the points in :data:`SAVE_POINTS`; tests set
:data:`fault_hook` to stop (or kill) the process at one of them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from bert_ds import zero
from bert_ds.base.atomic import as_umask_allows, file_crc32, fsync_path
from bert_ds.base.errors import UserError, describe
from bert_ds.data_tools.tokenizer import HF_FILES

MARKER = "COMPLETE"
LATEST = "latest"
CHECKPOINTS = "checkpoints"  # a run folder's (bert_ds.train --output) folder of checkpoints
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
_PREFIX = "step_"
_TRASH = ".trash-"  # a pruned folder is renamed to this prefix first, so a crash mid-delete leaves no marked remains

# The points a save passes, in order. "marked": COMPLETE written and synced, not yet
# renamed; "renamed": the folder has its final name, `latest` still points at the old one.
SAVE_POINTS = ("started", "engine_saved", "files_written", "marked", "renamed", "latest_moved", "pruned")

# Test seam, not a setting: when set, called as fault_hook(point, final_folder) at every
# point of SAVE_POINTS on every rank. Fault-injection tests make it raise or SIGKILL.
fault_hook: Callable[[str, Path], None] | None = None


def _reach(point: str, final: Path) -> None:
    if fault_hook is not None:
        fault_hook(point, final)


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or damaged."""


class NonFiniteWeightsError(Exception):
    """The weights to save hold inf or NaN: nothing is committed, the newest checkpoint stays (R16)."""


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with the permissions the umask allows (it writes 0600)."""
    save_file(tensors, str(path), metadata=metadata)
    as_umask_allows(path)


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def full_fp32_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full-precision weights, gathered from DeepSpeed's master copy where there is one.

    Collective under ZeRO (every rank must call it, in the same order). Tied
    parameters appear once, under their first name.
    """
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        full = zero.full_fp32_param(param)
        tensor = param.detach() if full is None else full
        out[name] = tensor.float().cpu().clone()
    return out


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, root: Path, step: int, *, rank: int, model_config: dict, train_config: dict,
         train_state: dict, tokenizer_dir: Path | None, keep_last: int,
         optimizer: OptimizerSnapshot | None = None) -> Path:
    """Commit a checkpoint of ``step`` under ``root`` (collective: every rank calls it).

    ``optimizer``: the world-size-free optimizer state (:func:`optimizer_snapshot`, also
    collective), written to ``optimizer.safetensors`` by rank 0.
    """
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}"
    # Gathered (collectively) before anything is written: every rank holds the same full
    # weights, so every rank reaches the same verdict and none waits at a barrier alone.
    weights = full_fp32_state_dict(engine.module)
    poisoned = next((name for name, w in weights.items() if not torch.isfinite(w).all()), None)
    if poisoned is not None:
        newest = find_latest(root)
        raise NonFiniteWeightsError(f"step {step}: the weights hold inf or NaN (first in {poisoned}); nothing was "
                                    f"saved; newest checkpoint: {newest if newest else 'none'}")

    def make_tmp() -> None:
        root.mkdir(parents=True, exist_ok=True)
        for debris in [*root.glob(".tmp-*"), *root.glob(f"{_TRASH}*")]:  # left by a crash in an earlier save
            shutil.rmtree(debris, ignore_errors=True)
        tmp.mkdir()
        (tmp / "rng").mkdir()

    def write_files() -> None:
        engine.save_checkpoint(str(tmp / "ds"), tag="state", save_latest=False)
        _reach("engine_saved", final)
        torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
        if rank == 0:
            save_safetensors(weights, tmp / WEIGHTS, metadata={"format": "pt"})
            if optimizer is not None:
                optimizer.write(tmp / OPTIMIZER)
            _write_json(tmp / "model_config.json", model_config)
            _write_json(tmp / "train_config.json", train_config)
            _write_json(tmp / "train_state.json", train_state)
            if tokenizer_dir is not None:  # the tokenizer files only, not the dataset beside them
                (tmp / "tokenizer").mkdir()
                for name in HF_FILES:  # a --tokenizer dataset has no vocab.txt
                    if name != "vocab.txt" or (tokenizer_dir / name).exists():
                        shutil.copyfile(tokenizer_dir / name, tmp / "tokenizer" / name)

    def commit() -> None:
        try:
            _commit(tmp, final)
            _point_latest(root, final.name)
        except OSError:
            if final.is_dir() and (root / LATEST).resolve() != final.resolve():
                _discard(final)  # renamed but not `latest`: the previous checkpoint stays the newest
            raise

    # Each step's verdict is agreed by every rank where a barrier would be: a write that fails
    # on one rank (disk full, a read-only folder) stops every rank at the same point.
    _agree(_write_failure(make_tmp) if rank == 0 else None, step, root, tmp, rank)
    _reach("started", final)
    failure = _write_failure(write_files)
    _reach("files_written", final)
    _agree(failure, step, root, tmp, rank)
    if rank == 0:
        failure = _write_failure(commit)
        if failure is None:
            _reach("latest_moved", final)
            _prune(root, keep_last)
    _reach("pruned", final)
    _agree(failure if rank == 0 else None, step, root, tmp, rank)
    return final


class CheckpointSaveError(UserError):
    """A checkpoint could not be written (disk full, a read-only folder): nothing was committed."""


def _write_failure(action: Callable[[], None]) -> Exception | None:
    """Run ``action``; return the failure of a write (disk full, no permission), raise anything else."""
    try:
        action()
    except (OSError, SafetensorError) as e:
        return e
    except RuntimeError as e:
        if "inline_container" not in str(e):
            raise
        return e  # torch.save's zip writer reports a short write (ENOSPC) as "unexpected pos"
    return None


def _any_rank(flag: bool) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _agree(failure: Exception | None, step: int, root: Path, tmp: Path, rank: int) -> None:
    """A barrier that also tells every rank whether any rank's writes failed; if one did, rank 0
    removes the temporary folder and every rank raises :class:`CheckpointSaveError`."""
    if not _any_rank(failure is not None):
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    cause = describe(failure) if failure is not None else "another rank could not write its files"
    newest = find_latest(root)
    raise CheckpointSaveError(f"step {step}: checkpoint not saved ({cause}; {_free_mib(root)} MiB free there); "
                              f"newest checkpoint: {newest if newest else 'none'}")


def _free_mib(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free >> 20


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True))


def _commit(tmp: Path, final: Path) -> None:
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    listing = {}
    for p in files:
        fsync_path(p)
        listing[str(p.relative_to(tmp))] = {"bytes": p.stat().st_size, "crc32": file_crc32(p)}
    marker = tmp / MARKER
    marker.write_text(json.dumps({"files": listing}, indent=1, sort_keys=True))
    fsync_path(marker)
    for d in sorted({p.parent for p in files} | {tmp}, key=lambda d: -len(d.parts)):
        fsync_path(d)
    _reach("marked", final)
    if final.exists():  # a save of the same step from an earlier attempt: out of the way first
        _discard(final)
    os.rename(tmp, final)
    fsync_path(final.parent)
    _reach("renamed", final)


def _discard(folder: Path) -> None:
    """Delete a checkpoint folder so that no crash leaves a marked, half-deleted folder behind."""
    trash = folder.with_name(f"{_TRASH}{folder.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(folder, trash)
    fsync_path(folder.parent)
    shutil.rmtree(trash)


def _point_latest(root: Path, name: str) -> None:
    link_tmp = root / f".{LATEST}.tmp"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    link_tmp.symlink_to(name)
    os.replace(link_tmp, root / LATEST)
    fsync_path(root)


def _complete_steps(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def incomplete_steps(root: Path) -> list[Path]:
    """Checkpoint folders without their marker: never loaded (a save commits the marker before
    the folder gets its final name, so these were damaged or copied in by hand)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and not (p / MARKER).is_file())


def previous_complete(ckpt: Path) -> Path | None:
    """The newest complete checkpoint older than ``ckpt``, or None."""
    older = [p for p in _complete_steps(ckpt.parent) if p.name < ckpt.name]
    return older[-1] if older else None


def _prune(root: Path, keep_last: int) -> None:
    latest = (root / LATEST).resolve()
    for old in _complete_steps(root)[:-keep_last]:
        if old.resolve() != latest:
            _discard(old)


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None if there is none.

    ``latest`` is trusted only when its target carries the marker; otherwise the
    newest marked folder wins (a crash between the rename and the pointer move).
    """
    link = root / LATEST
    complete = _complete_steps(root)
    newest = complete[-1] if complete else None
    if link.exists() and (link.resolve() / MARKER).is_file():
        target = link.resolve()
        return newest if newest is not None and newest.name > target.name else target
    return newest


def run_checkpoints(output: str | Path) -> Path:
    """The checkpoints folder of the run folder ``output``."""
    return Path(output) / CHECKPOINTS


def resolve(path: Path) -> Path:
    """A checkpoint folder from a path that is the folder, ``checkpoints/latest``, ``checkpoints/``
    or the run folder that holds ``checkpoints/``."""
    path = Path(path)
    if run_checkpoints(path).is_dir() and not (path / MARKER).is_file():
        path = run_checkpoints(path)
    root = path.parent if path.name == LATEST else path
    if path.name != LATEST and (path / MARKER).is_file():
        return path.resolve()
    found = find_latest(root) if root.is_dir() else None
    if found is not None:
        return found
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"{path}: no such checkpoint")
    raise CheckpointError(f"{path}: no complete checkpoint (no {MARKER} marker); it may be a partial save")


def verify(ckpt: Path) -> None:
    """Check every file against the sizes and CRCs recorded in the marker."""
    try:
        listing = json.loads((ckpt / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{ckpt / MARKER}: unreadable completion marker ({e})") from None
    for rel, want in listing.items():
        p = ckpt / rel
        if not p.is_file():
            raise CheckpointError(f"{p}: missing from the checkpoint")
        if p.stat().st_size != want["bytes"]:
            raise CheckpointError(f"{p}: size {p.stat().st_size} bytes, the checkpoint recorded {want['bytes']}")
        if file_crc32(p) != want["crc32"]:
            raise CheckpointError(f"{p}: checksum mismatch (the file changed after it was saved)")


def read_train_state(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / "train_state.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt / 'train_state.json'}: unreadable ({e})") from None


def load(engine, ckpt: Path, *, rank: int, world_size: int, verified: bool = False) -> dict[str, Any]:
    """Restore weights, optimizer, LR schedule (and this rank's RNG on the same world size);
    returns train_state. Collective: every rank calls it. ``verified``: the caller has just
    run :func:`verify` (to fail before building an engine), so the files are not read twice."""
    if not verified:
        verify(ckpt)
    state = read_train_state(ckpt)
    saved_world = state.get("world_size")
    if saved_world != world_size:
        _load_portable(engine, ckpt, saved_world, world_size)
        return state
    if zero.own_checkpoint_missing(engine, str(ckpt / "ds"), "state"):
        # saved by an engine of another precision (a bf16 engine, before bert-ds ran bf16 on an
        # fp32 one): its DeepSpeed files are not this engine's, its full state is
        _load_portable(engine, ckpt, saved_world, world_size)
    else:
        load_path, _ = engine.load_checkpoint(str(ckpt / "ds"), tag="state", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if load_path is None:
            raise CheckpointError(f"{ckpt / 'ds'}: DeepSpeed could not load the engine state")
    rng_file = ckpt / "rng" / f"rank_{rank:05d}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def _load_portable(engine, ckpt: Path, saved_world: int | None, world_size: int) -> None:
    if not (ckpt / OPTIMIZER).is_file():
        raise CheckpointError(f"{ckpt}: saved on {saved_world} rank(s) without {OPTIMIZER}, so it can only be "
                              f"resumed on {saved_world} rank(s), not {world_size}")
    install_weights(engine, read_weights(ckpt / WEIGHTS), source=ckpt / WEIGHTS)
    OptimizerSnapshot.read(ckpt / OPTIMIZER).install(engine, source=ckpt / OPTIMIZER)


def weights_file(path: Path) -> Path:
    """The weights file of a checkpoint folder (or its ``latest``, or a folder of checkpoints) or
    a ``.safetensors`` file, checked without loading it: a folder against its marker's CRCs, a
    file by its safetensors header (which also catches truncation; a bare file has no checksum)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        file = path
    else:
        folder = resolve(path)
        verify(folder)
        file = folder / WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"{file}: no such weights file")
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({describe(e)})") from None
    return file


def read_weights(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({describe(e)})") from None


# --------------------------------------------------------------------------- world-size-free state

def _check_portable_engine(engine, source: Path) -> None:
    reason = zero.full_state_unsupported(engine)
    if reason is not None:
        raise CheckpointError(f"{source}: {reason}")


def install_weights(engine, weights: dict[str, torch.Tensor], *, source: Path,
                    fresh: frozenset[str] = frozenset()) -> None:
    """Set every parameter and, under ZeRO-1/2, its fp32 master fragment, from full fp32 tensors;
    the parameters named in ``fresh`` may be absent and keep their initial values."""
    _check_portable_engine(engine, source)
    params = {name: p for name, p in engine.module.named_parameters() if name in weights or name not in fresh}
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise CheckpointError(f"{source}: does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    with torch.no_grad():
        for name, p in params.items():
            w = weights[name]
            if w.shape != p.shape:
                raise CheckpointError(f"{source}: {name} has shape {tuple(w.shape)}, the model {tuple(p.shape)}")
            p.copy_(w.to(device=p.device, dtype=p.dtype))
            zero.set_full_fp32_param(p, w.to(device=p.device, dtype=torch.float32))


@dataclass
class OptimizerSnapshot:
    """The optimizer state of every parameter, whole, in fp32: independent of the world size."""

    tensors: dict[str, torch.Tensor]  # "<state key>/<parameter name>" -> tensor of the parameter's shape
    scalars: list[dict[str, Any]]  # per param group: the non-tensor state (step counts), encoded
    lr_scheduler: dict[str, Any]  # the scheduler's state_dict

    def write(self, path: Path) -> None:
        meta = {"scalars": self.scalars, "lr_scheduler": self.lr_scheduler}
        save_safetensors(self.tensors, path, metadata={"format": "pt", "bert_ds": json.dumps(meta)})

    @classmethod
    def read(cls, path: Path) -> OptimizerSnapshot:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["bert_ds"])
        return cls(load_file(str(path)), meta["scalars"], meta["lr_scheduler"])

    def install(self, engine, *, source: Path) -> None:
        """Give a freshly built engine this state (every rank, before the first step)."""
        opt = zero.client_optimizer(engine)
        if len(self.scalars) != len(opt.param_groups):
            raise CheckpointError(f"{source}: {len(self.scalars)} param groups, the optimizer has {len(opt.param_groups)}")
        keys = sorted({k.split("/", 1)[0] for k in self.tensors})
        params = dict(engine.module.named_parameters())
        full = {(key, name): self.tensors.get(f"{key}/{name}") for key in keys for name in params}
        absent = [f"{key}/{name}" for (key, name), t in full.items() if t is None]
        if absent:
            raise CheckpointError(f"{source}: no optimizer state for {', '.join(absent[:3])}")
        if zero.is_partitioned(engine):
            zero.install_partitioned_state(engine, full, [_decode(s) for s in self.scalars])
        else:
            names = {id(p): n for n, p in params.items()}
            for i, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    opt.state[p] = {**{key: full[key, names[id(p)]].to(p.device).clone() for key in keys},
                                    **_decode(self.scalars[i])}
        sched = engine.lr_scheduler
        sched.load_state_dict(self.lr_scheduler)
        for group, lr in zip(opt.param_groups, sched.get_last_lr()):
            group["lr"] = lr  # the scheduler sets it at its next step; this step needs it now


def optimizer_snapshot(engine) -> OptimizerSnapshot | None:
    """Gather the full optimizer state of every parameter (collective under ZeRO: every rank
    calls it, in the same order). None before the optimizer's first step (it has no state)."""
    if zero.full_state_unsupported(engine) is not None:
        return None  # no full-weight path for these layouts (see _check_portable_engine)
    tensors: dict[str, torch.Tensor] = {}
    scalars: list[dict[str, Any]] = []
    if zero.is_partitioned(engine):
        gathered = zero.gather_partitioned_state(engine)
        if gathered is None:
            return None
        full, group_scalars = gathered
        tensors = {f"{key}/{name}": t for (key, name), t in full.items()}
        scalars = [_encode(values) for values in group_scalars]
    else:
        opt = zero.client_optimizer(engine)
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for group in opt.param_groups:
            held = [p for p in group["params"] if p in opt.state]
            if not held:
                return None
            first = opt.state[held[0]]
            keys = [k for k, v in first.items() if torch.is_tensor(v) and v.shape == held[0].shape]
            for p in held:
                for key in keys:
                    tensors[f"{key}/{names[id(p)]}"] = opt.state[p][key].float().cpu().clone()
            scalars.append(_encode({k: v for k, v in first.items() if k not in keys}))
    return OptimizerSnapshot(tensors, scalars, engine.lr_scheduler.state_dict())


def _encode(values: dict[str, Any]) -> dict[str, Any]:
    """Scalar optimizer state as JSON: 0-d tensors keep their dtype (AdamW's step), numbers stay numbers."""
    out = {}
    for k, v in values.items():
        if torch.is_tensor(v):
            out[k] = {"tensor": str(v.dtype).removeprefix("torch."), "value": v.item()}
        else:
            out[k] = {"value": v}
    return out


def _decode(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        if "tensor" in v:
            out[k] = torch.tensor(v["value"], dtype=getattr(torch, v["tensor"]))  # step counts stay on the host
        else:
            out[k] = v["value"]
    return out
