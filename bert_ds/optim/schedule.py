"""The learning-rate schedule: a pure function of the step and the recipe.

Two shapes (``OptimConfig.schedule``), both with ``warmup_steps`` of linear warm-up from lr / warmup to the peak:

- ``bert``: the decay runs over every step after the warm-up, to ``final_lr_fraction`` (0:
  BERT's, NVIDIA's and Google's recipes) at the last step;
- ``wsd`` (warmup-stable-decay, ModernBERT's): the peak holds until the last ``decay_share`` of
  the run's steps, which decay to ``final_lr_fraction`` (a decay never reaches into the warm-up).
  A share of 0 never decays (ModernBERT's first phase); 1 decays over every step after the
  warm-up, as ``bert`` does (its last phase, with no warm-up).

The decay's shape (``decay``), ``x`` the progress through the decay in [0, 1) and f the final
fraction: ``linear`` f + (1 - f)(1 - x); ``poly`` f + (1 - f)(1 - x)^poly_power;
``one_minus_sqrt`` f + (1 - f)(1 - sqrt(x)); ``constant`` none. The last step runs at
``x = (D - 1) / D`` of a D-step decay, so no step is spent at the final rate.

Design choices, and why:

- **A pure function of (step, recipe)** (:func:`lr_multiplier`), the step counting completed
  optimizer steps. A checkpoint needs only the step count for a resumed run's rates to be those of
  an uninterrupted run, on any number of ranks.
- **The recipe's figures, not the checkpoint's** (:class:`StepSchedule`). torch's schedulers
  save their base rates, and optimizers their param groups' settings, and put them back on a
  load: a resume that changed ``--lr`` (a change :mod:`bert_ds.checkpoint.resume` records as
  safe) kept training at the saved rate. Here a load takes only the step count, and
  :func:`keep_recipe_on_load` puts the recipe's settings back into the optimizer after its own
  load (whichever of the two DeepSpeed loads first), so a recorded change applies from the next
  step, as the resume log says.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from bert_ds.config import OptimConfig


def decay_steps(cfg: OptimConfig, total_steps: int) -> int:
    """How many of the ``total_steps`` decay, the last ones: all after the warm-up for ``bert``;
    for ``wsd`` ``decay_share`` of them (rounded half up), at most all after the warm-up; 0 for
    a ``constant`` decay."""
    if cfg.decay == "constant":
        return 0
    after_warmup = max(0, total_steps - cfg.warmup_steps)
    if cfg.schedule == "bert":
        return after_warmup
    return min(after_warmup, int(cfg.decay_share * total_steps + 0.5))


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate at ``step`` (0-based count of completed steps) as a fraction of the peak."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    length = decay_steps(cfg, total_steps)
    start = max(cfg.warmup_steps, total_steps - length)
    if length == 0 or step < start:
        return 1.0
    x = min(1.0, (step - start) / length)
    if cfg.decay == "linear":
        shape = 1.0 - x
    elif cfg.decay == "poly":
        shape = (1.0 - x) ** cfg.poly_power
    else:  # one_minus_sqrt
        shape = 1.0 - math.sqrt(x)
    final = cfg.final_lr_fraction
    return final + (1.0 - final) * shape


class StepSchedule(LambdaLR):
    """:func:`lr_multiplier` times ``cfg.lr`` in every param group, stepped once per optimizer
    step. Its ``state_dict`` is torch's; ``load_state_dict`` takes the step count from it and
    nothing else, and sets the groups' rates for that step."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
        self.cfg, self.total_steps = cfg, total_steps
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr
            group.pop("initial_lr", None)  # LambdaLR takes its base rates from here: the recipe's peak
        super().__init__(optimizer, self.multiplier)

    def multiplier(self, step: int) -> float:
        return lr_multiplier(step, self.cfg, self.total_steps)

    def state_dict(self) -> dict[str, Any]:
        """torch's, without the recipe (which a checkpoint keeps in train_config.json): JSON-safe."""
        return {k: v for k, v in super().state_dict().items() if k not in ("cfg", "total_steps")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch = state_dict["last_epoch"]
        self._step_count = state_dict.get("_step_count", self.last_epoch + 1)
        self.apply_rates()

    def apply_rates(self) -> None:
        """Give every param group its rate at the current step (after a load of either object)."""
        self._last_lr = [self.cfg.lr * self.multiplier(self.last_epoch) for _ in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


RECIPE_SETTINGS = ("betas", "eps", "weight_decay", "decouple_lr", "max_lr")  # what OptimConfig sets in a group


def keep_recipe_on_load(optimizer: torch.optim.Optimizer, schedule: StepSchedule | None = None) -> None:
    """From now on, a ``load_state_dict`` of ``optimizer`` keeps its param groups' current
    :data:`RECIPE_SETTINGS` (the recipe's, as built) instead of the saved ones, and gives them the
    rates ``schedule`` gives at its step. Call it once the groups hold the recipe."""
    settings = [{k: group[k] for k in RECIPE_SETTINGS if k in group} for group in optimizer.param_groups]

    def keep(opt: torch.optim.Optimizer) -> None:
        for group, kept in zip(opt.param_groups, settings, strict=True):
            group.update(kept)
        if schedule is not None:
            schedule.apply_rates()

    optimizer.register_load_state_dict_post_hook(keep)


__all__ = ["RECIPE_SETTINGS", "StepSchedule", "decay_steps", "keep_recipe_on_load", "lr_multiplier"]
