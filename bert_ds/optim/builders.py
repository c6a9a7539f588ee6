"""Optimizers and the learning-rate schedule, built from a recipe (:class:`~bert_ds.config.OptimConfig`).

- ``lamb`` (``bert_ds.optim.lamb``), the default: per-parameter trust ratios, in NVIDIA's BERT
  variant (no ratio where weight decay is 0) unless ``lamb_variant="paper"``.
- ``stable_adamw`` (``bert_ds.optim.stable_adamw``): AdamW with per-parameter update clipping,
  ModernBERT's optimizer (torch-optimi's numbers).
- ``adamw``: torch's fused AdamW.

LAMB and StableAdamW keep their per-parameter figures correct under ZeRO-1/2 once bound to the
engine's partitions (:func:`bind_to_engine`, which reads them through :mod:`bert_ds.zero`).

Weight decay is applied to matrices and embeddings only: biases and LayerNorm parameters
(every 1-D tensor in BERT) are excluded, as in the original recipe. It is decoupled from the
gradient in all three; scaled by the step's learning rate (``w *= 1 - lr_t * wd``: torch's
AdamW, LAMB's ``wd * w`` inside its update), or with ``decouple_lr`` by the step's fraction of the
peak (``w *= 1 - lr_t / lr * wd``: ModernBERT's ``decoupled_stableadamw``, optimi's
``decouple_lr``, Composer's ``DecoupledAdamW``). torch's AdamW has no such switch; it gets the
same product as a weight decay of ``wd / lr``.

The schedule (:mod:`bert_ds.optim.schedule`) is BERT's or warmup-stable-decay, a pure function
of the step; DeepSpeed steps it once per optimizer step.
"""

from __future__ import annotations

import torch

from bert_ds import zero
from bert_ds.config import OptimConfig
from bert_ds.kernels.ops import KernelSetting, OpShapes
from bert_ds.optim.fragments import FragmentOptimizer
from bert_ds.optim.lamb import Lamb
from bert_ds.optim.schedule import StepSchedule, keep_recipe_on_load
from bert_ds.optim.stable_adamw import StableAdamW


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
    if cfg.name == "lamb":
        return Lamb(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                    variant=cfg.lamb_variant, kernels=kernels, shapes=shapes)
    if cfg.name == "stable_adamw":
        return StableAdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                           decouple_lr=cfg.decouple_lr, max_lr=cfg.lr)
    # Fused: one kernel over all the tensors on a GPU (DeepSpeed hands ZeRO partitions over as
    # flat fp32 tensors), and it skips a step on the device (bert_ds.optim.device_skip).
    weight_decay = cfg.weight_decay / cfg.lr if cfg.decouple_lr else cfg.weight_decay
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)


def build_schedule(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> StepSchedule:
    """The schedule of ``cfg`` over ``total_steps``, on ``optimizer`` as built from ``cfg``; from now
    on a load of either keeps the recipe's settings and rates (:mod:`bert_ds.optim.schedule`)."""
    schedule = StepSchedule(optimizer, cfg, total_steps)
    keep_recipe_on_load(optimizer, schedule)
    return schedule


def bind_to_engine(optimizer: torch.optim.Optimizer, engine) -> int:
    """After ``deepspeed.initialize``, on every rank before the first step: show LAMB or
    StableAdamW where each parameter's fragments lie in ZeRO-1/2's flat partitions, so that
    their per-parameter figures stay per parameter. Returns how many flat tensors were bound: 0
    for another optimizer, and where the engine steps the model's own parameters (ZeRO-0 in fp32)."""
    if not isinstance(optimizer, FragmentOptimizer) or zero.steps_directly(engine, optimizer):
        return 0
    if zero.client_optimizer(engine) is not optimizer:
        raise ValueError(f"DeepSpeed's {type(engine.optimizer).__name__} does not wrap this optimizer; "
                         "pass the engine built from it")
    partitions = zero.flat_partitions(engine)
    for part in partitions:
        optimizer.bind_flat_tensor(part.flat, part.segments, len(part.params), part.group)
    return len(partitions)
