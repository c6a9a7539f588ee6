"""Optimizers and the learning-rate schedule.

LAMB (``bert_ds.optim.lamb``) is the default: per-parameter trust ratios, correct under ZeRO-1/2
once bound to the engine's partitions (:func:`bind_to_engine`, which reads them through
:mod:`bert_ds.zero`), in NVIDIA's BERT variant
(no ratio where weight decay is 0) unless ``lamb_variant="paper"``. AdamW is torch's.

Weight decay is applied to matrices and embeddings only: biases and LayerNorm
parameters (every 1-D tensor in BERT) are excluded, as in the original recipe.
The schedule is BERT's: linear warm-up to the peak, then linear or polynomial decay
to zero at the last step (or constant). DeepSpeed steps the scheduler once per
optimizer step.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR

from bert_ds import zero
from bert_ds.config import OptimConfig
from bert_ds.kernels.ops import KernelSetting, OpShapes
from bert_ds.optim.lamb import Lamb


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, kernels: KernelSetting = "auto",
                    shapes: OpShapes | None = None) -> torch.optim.Optimizer:
    """``kernels`` and ``shapes``: the model's setting and shapes (``BertForPreTraining.op_shapes``),
    which LAMB's update of ZeRO's flat partitions follows too."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, variant=cfg.lamb_variant, kernels=kernels,
                    shapes=shapes)
    # Fused: one kernel over all the tensors on a GPU (DeepSpeed hands ZeRO partitions over as
    # flat fp32 tensors), and it skips a step on the device (bert_ds.optim.device_skip).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate at ``step`` (0-based count of completed steps) as a fraction of the peak."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    remaining = max(0.0, 1.0 - (step - cfg.warmup_steps) / span)
    return remaining if cfg.decay == "linear" else remaining ** cfg.poly_power


def build_schedule(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))


def bind_to_engine(optimizer: torch.optim.Optimizer, engine) -> int:
    """After ``deepspeed.initialize``, on every rank before the first step: show LAMB where each
    parameter's fragments lie in ZeRO-1/2's flat partitions, so that its trust ratios stay per
    parameter. Returns how many flat tensors were bound: 0 for another optimizer, and where the
    engine steps the model's own parameters (ZeRO-0 in fp32)."""
    if not isinstance(optimizer, Lamb) or zero.steps_directly(engine, optimizer):
        return 0
    if zero.client_optimizer(engine) is not optimizer:
        raise ValueError(f"DeepSpeed's {type(engine.optimizer).__name__} does not wrap this optimizer; "
                         "pass the engine built from it")
    partitions = zero.flat_partitions(engine)
    for part in partitions:
        optimizer.bind_flat_tensor(part.flat, part.segments, len(part.params), part.group)
    return len(partitions)
