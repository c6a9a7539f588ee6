"""Checkpoints that are committed last and never loaded half-written.

Layout of ``OUTPUT/checkpoints/``::

    step_00000100/
        ds/state/...          DeepSpeed engine, optimizer and scheduler state (every rank)
        model.safetensors     full fp32 weights (master copy), Hugging Face parameter names
        model_config.json     bert_ds.model.ModelConfig
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
``model.safetensors`` lets `bert_ds.export` work without DeepSpeed or the world size
the run had.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from data_tools.atomic import file_crc32, fsync_path
from data_tools.errors import UserError
from data_tools.tokenizer import HF_FILES

MARKER = "COMPLETE"
LATEST = "latest"
_PREFIX = "step_"


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or damaged."""


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
    from deepspeed.utils import safe_get_full_fp32_param

    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        full = safe_get_full_fp32_param(param)
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
         train_state: dict, tokenizer_dir: Path | None, keep_last: int) -> Path:
    """Commit a checkpoint of ``step`` under ``root`` (collective: every rank calls it)."""
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        tmp.mkdir()
        (tmp / "rng").mkdir()
    _barrier()
    engine.save_checkpoint(str(tmp / "ds"), tag="state", save_latest=False)
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    weights = full_fp32_state_dict(engine.module)
    if rank == 0:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "model_config.json", model_config)
        _write_json(tmp / "train_config.json", train_config)
        _write_json(tmp / "train_state.json", train_state)
        if tokenizer_dir is not None:  # the tokenizer files only, not the dataset beside them
            (tmp / "tokenizer").mkdir()
            for name in HF_FILES:
                shutil.copy2(tokenizer_dir / name, tmp / "tokenizer" / name)
    _barrier()
    if rank == 0:
        _commit(tmp, final)
        _point_latest(root, final.name)
        _prune(root, keep_last)
    _barrier()
    return final


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
    if final.exists():  # a save of the same step from an earlier, interrupted attempt
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(final.parent)


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


def _prune(root: Path, keep_last: int) -> None:
    latest = (root / LATEST).resolve()
    for old in _complete_steps(root)[:-keep_last]:
        if old.resolve() != latest:
            shutil.rmtree(old)


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


def resolve(path: Path) -> Path:
    """A checkpoint folder from a path that is the folder, ``checkpoints/latest`` or ``checkpoints/``."""
    path = Path(path)
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


def load(engine, ckpt: Path, *, rank: int, world_size: int) -> dict[str, Any]:
    """Restore engine, optimizer, scheduler and this rank's RNG; returns train_state."""
    verify(ckpt)
    load_path, _ = engine.load_checkpoint(str(ckpt / "ds"), tag="state", load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise CheckpointError(f"{ckpt / 'ds'}: DeepSpeed could not load the engine state")
    state = json.loads((ckpt / "train_state.json").read_text())
    rng_file = ckpt / "rng" / f"rank_{rank:05d}.pt"
    if state.get("world_size") == world_size and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
