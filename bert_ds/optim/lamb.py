"""LAMB (You et al., 2019) with one trust ratio per model parameter, also under DeepSpeed ZeRO-1/2.

The math, shared by both implementations here::

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w     (wd term only when wd != 0)
    r = ||w|| / ||u||  (1 when either norm is 0)
    w = w - lr * r * u

Two variants, by name (``variant=``):

- ``"nvidia"`` (the default): NVIDIA's BERT LAMB, as apex ``FusedLAMB`` and the MLPerf BERT
  submissions run it (``use_nvlamb=False``): the trust ratio only where weight decay is
  non-zero; biases and LayerNorm parameters (weight decay 0) take the plain Adam step
  ``w = w - lr * u``. Why it matters: a bias starts at 0, so its first step (r = 1)
  moves it by about lr per element, and from then on r = ||w|| / ||u|| is about lr, each
  step about lr^2: under the ratio, biases stay essentially untrained.
- ``"paper"``: the LAMB paper's rule, every tensor adapted by its own ratio.

Design choices, and why:

- **No clipping or gradient pre-normalisation inside.** DeepSpeed unscales (fp16) and
  clips by the global norm (``gradient_clipping``) before it calls ``step()``, and skips
  the call on an overflow; doing either again here would change the recipe.
- **A reference and a fast path.** :class:`LambReference` loops over tensors and is the
  definition; :class:`Lamb` does the same with ``torch._foreach_*`` ops and, for flat tensors, the chunked
  update op. Tests pin them.
- **Per-parameter ratios over flat tensors.** A sharding wrapper (DeepSpeed ZeRO-1/2) may
  replace each param group's ``params`` by ONE flat tensor holding fragments of many parameters;
  a ratio over it would mix them and change with the world size. Bound with
  :meth:`~bert_ds.optim.fragments.FragmentOptimizer.bind_flat_tensor`, ``step()`` reduces squared
  norms of the weights and of the update per fragment, all-reduces them per parameter in one call
  per param group, and scales every fragment by its own parameter's ratio: the machinery
  :mod:`bert_ds.optim.fragments` shares with StableAdamW's update clipping, which also refuses a
  tensor that was neither given nor bound.
- **Chunked, fused where it pays.** A bound flat tensor is cut into chunks of at most
  1,024 elements, each inside one fragment (:class:`bert_ds.kernels.lamb.Chunks`); the
  elementwise update and the chunks' squared norms are one op,
  :func:`bert_ds.kernels.lamb.lamb_update`, which calls back here between its two passes for
  the per-chunk multipliers (chunk sums into parameters in fp64, the all-reduce, the ratios).
  On a GPU the op runs its fused kernel (10 passes over the fp32 state instead of ~31) where
  the ``kernels`` setting allows it: ``auto`` when it passed its self-check on the device and
  won the race against the native ops, as the model's ops do.
- **No DeepSpeed here.** This module is the optimizer math and the flat-tensor layout only;
  which DeepSpeed layouts it runs under (ZeRO-0 in fp32, ZeRO-1/2) is said in :mod:`bert_ds.zero`.
"""

from __future__ import annotations

from typing import Literal
from collections.abc import Iterable

import torch

from bert_ds.kernels.ops import Backend, KernelSetting, OpShapes, resolve_backend
from bert_ds.kernels.lamb import ChunkScales, LambScalars, SkipFactors, lamb_update
from bert_ds.optim.fragments import FlatLayout, FragmentOptimizer, PerTensorOptimizer


LambVariant = Literal["nvidia", "paper"]
VARIANTS: tuple[str, ...] = ("nvidia", "paper")


def _check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                           variant: str) -> None:
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {betas}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")


def _adapts(weight_decay: float, variant: str) -> bool:
    """Whether a tensor stepped with this weight decay gets a trust ratio (see the variants above)."""
    return variant == "paper" or weight_decay != 0


def _trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    """||w|| / ||u|| elementwise, 1 where either norm is 0."""
    return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))


# --------------------------------------------------------------------------- reference


@torch.no_grad()
def lamb_reference_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        step: int, *, lr: float, betas: tuple[float, float], eps: float,
                        weight_decay: float, variant: LambVariant = "nvidia") -> None:
    """One LAMB step on one tensor, in place. ``step`` counts steps including this one (1-based).

    Where the variant adapts it, the whole tensor gets one trust ratio; norms are taken in fp64.
    """
    beta1, beta2 = betas
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    m_hat = exp_avg / (1 - beta1 ** step)
    v_hat = exp_avg_sq / (1 - beta2 ** step)
    update = m_hat / (v_hat.sqrt() + eps)
    if weight_decay != 0:
        update = update + weight_decay * param
    if not _adapts(weight_decay, variant):
        param.sub_(update * lr)
        return
    ratio = _trust_ratio(torch.linalg.vector_norm(param, dtype=torch.float64),
                         torch.linalg.vector_norm(update, dtype=torch.float64))
    param.sub_(update * (lr * ratio).to(param.dtype))


class LambReference(PerTensorOptimizer):
    """Textbook LAMB, one tensor at a time: the definition :class:`Lamb` is tested against.

    Each tensor in ``params`` that the variant adapts gets its own trust ratio. Handed to
    DeepSpeed ZeRO it is therefore the naive LAMB with one ratio per flat partition.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, variant: LambVariant = "nvidia"):
        _check_hyperparameters(lr, betas, eps, weight_decay, variant)
        self.variant = variant
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _step_tensor(self, p: torch.Tensor, state: dict, group: dict) -> None:
        lamb_reference_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=group["lr"],
                            betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                            variant=self.variant)


def _chunk_scales(layout: FlatLayout, lr: float) -> ChunkScales:
    """The callback of :func:`~bert_ds.kernels.lamb.lamb_update`: per-chunk squared norms of w
    and u -> per-chunk lr * the trust ratio of the chunk's parameter, its sums all-reduced over
    the layout's group in one call."""
    def scales(squares: torch.Tensor) -> torch.Tensor:  # (K, 2) fp32 -> (K,) fp32
        sums = layout.parameter_sums(squares)
        ratio = _trust_ratio(sums[0].sqrt(), sums[1].sqrt())
        return (ratio * lr)[layout.chunk_slots].to(torch.float32)
    return scales


# --------------------------------------------------------------------------- LAMB


class Lamb(FragmentOptimizer):
    """LAMB with ``torch._foreach_*`` ops and one trust ratio per model parameter.

    Param groups carry their own ``weight_decay``; put biases and LayerNorm weights in a
    group with 0 (under the default ``variant="nvidia"`` that group takes plain Adam steps).
    Ordinary parameters get one ratio per tensor. Flat tensors that hold fragments of several
    parameters get per-parameter ratios once bound with
    :meth:`~bert_ds.optim.fragments.FragmentOptimizer.bind_flat_tensor`.

    Under DeepSpeed ZeRO-1/2 (``"zero_allow_untested_optimizer": true`` in its config)::

        lamb = Lamb(param_groups, lr=..., weight_decay=...)
        engine, *_ = deepspeed.initialize(model=model, optimizer=lamb, config=cfg)
        bind_to_engine(lamb, engine)   # bert_ds.optim.builders; every rank, before the first step
    """

    STATISTIC = "trust ratios"

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, variant: LambVariant = "nvidia",
                 kernels: KernelSetting = "auto", shapes: OpShapes | None = None):
        _check_hyperparameters(lr, betas, eps, weight_decay, variant)
        self.variant = variant
        self.kernels = kernels  # the flat tensors' update: fused where it runs and is faster (auto), or not
        self.shapes = shapes  # the model's (BertForPreTraining.op_shapes): auto reads the race the model ran
        self._resolved: Backend | None = None
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _step_plain(self, group: dict, params: list[torch.Tensor]) -> None:
        """Separate tensors, one trust ratio each, in foreach ops."""
        f = SkipFactors.of(self.skip_if, *group["betas"])
        updates = self._adam_updates(group, params, f, group["weight_decay"])
        lr = group["lr"]
        if _adapts(group["weight_decay"], self.variant):
            ratio = _trust_ratio(torch.stack(torch._foreach_norm(params)), torch.stack(torch._foreach_norm(updates)))
            torch._foreach_mul_(updates, list((ratio * lr * f.apply).unbind(0)))
        else:
            torch._foreach_mul_(updates, lr * f.apply)
        torch._foreach_sub_(params, updates)

    def _step_flat(self, group: dict, flat: torch.Tensor, layout: FlatLayout) -> None:
        """A bound flat tensor, one trust ratio per parameter, by the chunked update op."""
        state = self._state(flat)
        scalars = LambScalars.at_step(group["betas"], group["eps"], group["weight_decay"], state["step"])
        # Same decision on every rank (the group's settings are), so no rank waits on a norm
        # all-reduce the others skip.
        scales = _chunk_scales(layout, group["lr"]) if _adapts(group["weight_decay"], self.variant) else group["lr"]
        lamb_update(flat, flat.grad, state["exp_avg"], state["exp_avg_sq"], layout.chunks, scalars, scales,
                    backend=self._backend(flat), skip=self.skip_if)

    def _backend(self, flat: torch.Tensor) -> Backend:
        """The kernels setting, resolved at the first step of a flat tensor at the model's shapes
        (in a training process the model resolved them first, and this is the same plan)."""
        if self._resolved is None:
            self._resolved = resolve_backend(self.kernels, self.shapes)
        return self._resolved


__all__ = ["VARIANTS", "Lamb", "LambReference", "LambVariant", "lamb_reference_step"]
