"""The DeepSpeed internals that the training loop relies on, each behind one named function.

DeepSpeed has no public API for these; every use in ``bert_ds/train`` goes through here, so
that a DeepSpeed upgrade (pinned below 0.20) means re-reading this file only. These join
``bert_ds/zero.py``, the one module for DeepSpeed's internals, with the optimizer's
partition binding and the checkpoint's state relinking.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def world_group_with_timeout(timeout: timedelta) -> None:
    """Make DeepSpeed run ZeRO's collectives on a world group with ``timeout``.

    DeepSpeed clones the world group for ZeRO with torch's default timeout (30 min), not the
    one the process group was made with; creating the clone first (``groups._WORLD_GROUP``)
    makes it use ours. Call once, right after ``deepspeed.init_distributed``."""
    from deepspeed.utils import groups

    if groups._WORLD_GROUP is None:
        groups._WORLD_GROUP = dist.new_group(ranks=range(dist.get_world_size()), timeout=timeout)


def report_overflow(optimizer: torch.optim.Optimizer, overflowed: bool) -> None:
    """Tell the engine, for the coming ``engine.step()``, whether this step overflowed.

    DeepSpeed's own optimizer wrappers set ``overflow``; the engine reads it to hold the LR
    schedule and count a skipped step. Under ZeRO-0 in fp32 the engine steps our optimizer
    directly, which must then report it the same way."""
    optimizer.overflow = overflowed


def skipped_steps(engine) -> int:
    """How many updates the engine has skipped (overflow), counted by DeepSpeed since start-up."""
    return engine.skipped_steps


def loss_scale(engine) -> float:
    """fp16's dynamic loss scale; bf16 and fp32 have none (1.0). DeepSpeed has no public getter:
    the ZeRO optimizers keep it in ``cur_scale``, the stage-0 fp16 one in ``loss_scaler``."""
    opt = engine.optimizer
    scale = getattr(opt, "cur_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else 1.0
