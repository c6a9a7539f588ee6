"""StableAdamW (Wortsman et al., 2023): AdamW with update clipping per parameter, as torch-optimi's
``StableAdamW`` and ModernBERT's recipe run it, also under DeepSpeed ZeRO-1/2.

The math, t counting the parameter's steps from 1::

    m = b1 m + (1 - b1) g                  v = b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t)                 v_hat = v / (1 - b2^t)
    rms  = sqrt(mean over the parameter of g^2 / max(v_hat, eps^2))
    lr_t = lr / max(1, rms)                                   (the update clipping)
    w = w * (1 - lr_t * wd')     wd' = wd / max_lr with decouple_lr, else wd
    w = w - lr_t * m_hat / (sqrt(v_hat) + eps)

Design choices, and why:

- **optimi's numbers, torch's moments.** optimi folds the bias corrections into "debiased"
  betas, so the moments it keeps are ``m_hat`` and ``v_hat`` themselves. Here ``m`` and ``v`` are
  Adam's plain moments, as LAMB and torch's AdamW keep them (and ``optimizer.safetensors``
  holds them), and the corrections ride on two scalars (:meth:`~bert_ds.kernels.lamb.LambScalars.at_step`).
  The two are equal in exact arithmetic; ``tests/bert_ds/test_stable_adamw.py`` holds this one
  to torch-optimi where it is installed.
- **Weight decay as optimi applies it**: decoupled from the gradient and scaled by the clipped
  ``lr_t``. With ``decouple_lr`` (optimi's name; Composer's ``DecoupledAdamW``; ModernBERT's
  ``decoupled_stableadamw``) it is scaled by ``lr_t / max_lr`` instead, ``max_lr`` the schedule's
  peak: ``wd`` is then the fraction a weight loses per step at the peak (ModernBERT: 1e-5), and
  retuning the learning rate leaves it alone.
- **The clipping is per model parameter.** Under ZeRO-1/2 the optimizer steps flat partitions
  holding fragments of many parameters; bound to them (:mod:`bert_ds.optim.fragments`), it sums
  ``g^2 / max(v_hat, eps^2)`` and the element count per fragment and all-reduces both per
  parameter in one call per flat tensor, as LAMB does its norms. Every parameter gets the same
  ``rms`` on every rank and every world size; one ``rms`` per partition would be another
  optimizer (the ZeRO tests show it failing the comparison).
- **What it clips is the step's gradient**: after DeepSpeed's or the training step's global-norm
  clipping where ``grad_clip`` is on. ModernBERT's recipe turns gradient clipping off and lets the
  update clipping stand in for it.
- **PyTorch ops, no host reads.** ``rms`` and ``lr_t`` stay on the device (optimi reads each
  tensor's ``rms`` to the host); a skip flag (:mod:`bert_ds.optim.device_skip`) zeroes the step on
  the device. There is no fused kernel: a flat tensor's update is about 15 passes over it, where
  LAMB's fused kernel makes 10.
- **fp32 weights only** (no Kahan summation): every layout bert-ds steps has them (ZeRO's flat
  master partitions, ZeRO-0 in fp32).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from bert_ds.kernels.lamb import LambScalars, SkipFactors
from bert_ds.optim.fragments import FlatLayout, FragmentOptimizer, PerTensorOptimizer


def _check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                           max_lr: float) -> None:
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {betas}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if not max_lr > 0.0:
        raise ValueError(f"max_lr must be > 0, got {max_lr}")


def _defaults(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, decouple_lr: bool,
              max_lr: float | None) -> dict:
    """The param groups' defaults, checked; ``max_lr`` None: ``lr``."""
    max_lr = lr if max_lr is None else max_lr
    _check_hyperparameters(lr, betas, eps, weight_decay, max_lr)
    return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decouple_lr=decouple_lr, max_lr=max_lr)


def _decay(group: dict) -> float:
    """wd' of the module docstring: what multiplies lr_t * w."""
    return group["weight_decay"] / group["max_lr"] if group["decouple_lr"] else group["weight_decay"]


# --------------------------------------------------------------------------- reference


@torch.no_grad()
def stable_adamw_reference_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                                exp_avg_sq: torch.Tensor, step: int, *, lr: float, betas: tuple[float, float],
                                eps: float, weight_decay: float, decouple_lr: bool = False,
                                max_lr: float | None = None) -> None:
    """One StableAdamW step on one tensor, in place, the formulas of the module docstring as they
    read. ``step`` counts steps including this one (1-based); the rms is taken in fp64."""
    beta1, beta2 = betas
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    m_hat = exp_avg / (1 - beta1 ** step)
    v_hat = exp_avg_sq / (1 - beta2 ** step)
    rms = (grad.double().square() / v_hat.double().clamp_min(eps ** 2)).mean().sqrt().item()
    lr_t = lr / max(1.0, rms)
    if weight_decay != 0:
        param.mul_(1 - lr_t * (weight_decay / (max_lr or lr) if decouple_lr else weight_decay))
    param.sub_(lr_t * m_hat / (v_hat.sqrt() + eps))


class StableAdamWReference(PerTensorOptimizer):
    """StableAdamW one tensor at a time: the definition :class:`StableAdamW` is tested against.

    Each tensor in ``params`` gets its own rms. Handed to DeepSpeed ZeRO it is therefore the
    naive StableAdamW with one rms per flat partition.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),
                 eps: float = 1e-6, weight_decay: float = 0.0, decouple_lr: bool = False,
                 max_lr: float | None = None):
        super().__init__(params, _defaults(lr, betas, eps, weight_decay, decouple_lr, max_lr))

    def _step_tensor(self, p: torch.Tensor, state: dict, group: dict) -> None:
        stable_adamw_reference_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=group["lr"],
                                    betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                                    decouple_lr=group["decouple_lr"], max_lr=group["max_lr"])


class StableAdamW(FragmentOptimizer):
    """StableAdamW in ``torch._foreach_*`` ops, one update clipping per model parameter.

    Param groups carry their own ``weight_decay`` (0 for biases and LayerNorm weights).
    Ordinary parameters get one rms per tensor; flat tensors holding fragments of several
    parameters get one per parameter once bound
    (:meth:`~bert_ds.optim.fragments.FragmentOptimizer.bind_flat_tensor`; under DeepSpeed ZeRO-1/2,
    ``bert_ds.optim.builders.bind_to_engine``). ``max_lr``: the schedule's peak, which
    ``decouple_lr`` divides by (default ``lr``); the defaults are optimi's.
    """

    STATISTIC = "update clipping"

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),
                 eps: float = 1e-6, weight_decay: float = 0.0, decouple_lr: bool = False,
                 max_lr: float | None = None):
        super().__init__(params, _defaults(lr, betas, eps, weight_decay, decouple_lr, max_lr))

    def _step_plain(self, group: dict, params: list[torch.Tensor]) -> None:
        """Separate tensors, one rms each, in foreach ops."""
        f = SkipFactors.of(self.skip_if, *group["betas"])
        updates = self._adam_updates(group, params, f, _decay(group))
        # g^2 / max(v_hat, eps^2) = c2 g^2 / max(v, c2 eps^2), c2 = 1 - b2^t: so each tensor's rms
        # is the norm of g / sqrt(max(v, c2 eps^2)), times sqrt(c2 / numel).
        grads = [f.grad(p.grad) for p in params]
        corrections = [1 - group["betas"][1] ** self.state[p]["step"] for p in params]
        floors = torch._foreach_clamp_min([self.state[p]["exp_avg_sq"] for p in params],
                                          [c2 * group["eps"] ** 2 for c2 in corrections])
        torch._foreach_sqrt_(floors)
        ratios = torch._foreach_div(grads, floors)
        torch._foreach_mul_(ratios, [math.sqrt(c2 / p.numel()) for c2, p in zip(corrections, params)])
        rms = torch.stack(torch._foreach_norm(ratios))
        lr_t = group["lr"] / rms.clamp_min(1.0) * f.apply
        torch._foreach_mul_(updates, list(lr_t.unbind(0)))
        torch._foreach_sub_(params, updates)

    def _step_flat(self, group: dict, flat: torch.Tensor, layout: FlatLayout) -> None:
        """A bound flat tensor, one rms per parameter: its sums all-reduced over the layout's group."""
        state = self._state(flat)
        decay = _decay(group)
        s = LambScalars.at_step(group["betas"], group["eps"], decay, state["step"])
        f = SkipFactors.of(self.skip_if, s.beta1, s.beta2)
        grad, exp_avg, exp_avg_sq = f.grad(flat.grad), state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, f.beta1_weight)
        exp_avg_sq.mul_(f.beta2_keep).addcmul_(grad, grad, value=1 - s.beta2)

        # per chunk: the sum of g^2 / max(v, c2 eps^2) and the element count; per parameter,
        # summed over every rank: rms^2 = c2 * sum / count (eps_hat = eps sqrt(c2))
        ratio = grad.square().div_(exp_avg_sq.clamp_min(s.eps_hat ** 2))
        sums = layout.parameter_sums(torch.stack([layout.chunks.sums(ratio), layout.chunk_lengths(ratio.dtype)], 1))
        del ratio
        rms = (sums[0] * (1 - s.beta2 ** state["step"]) / sums[1].clamp_min(1.0)).sqrt()
        lr_t = (group["lr"] / rms.clamp_min(1.0)).to(torch.float32)

        denom = exp_avg_sq.sqrt().add_(s.eps_hat)
        if decay != 0:
            update = flat.mul(decay).addcdiv_(exp_avg, denom, value=s.step_size)
        else:
            update = exp_avg.div(denom).mul_(s.step_size)
        del denom
        flat.sub_(update.mul_(layout.per_element(lr_t * f.apply)))


__all__ = ["StableAdamW", "StableAdamWReference", "stable_adamw_reference_step"]
