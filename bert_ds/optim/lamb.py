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
  replace each param group's ``params`` by ONE flat tensor: this rank's slice of the group's
  concatenated parameters. A ratio over that tensor mixes parameters and changes with the
  world size (DeepSpeed issues #88, #490, #4417). :meth:`Lamb.bind_flat_tensor` takes where
  each parameter's fragment lies in it (``segments``) and the process group whose ranks hold
  the other fragments; ``step()`` then reduces squared norms of the weights and of the update
  per fragment, all-reduces the ``(2, num_params)`` sums over that group in one call per param
  group (apex's DistributedFusedLAMB does the same), and scales every fragment by its own
  parameter's ratio. A parameter split between ranks, or absent from a rank, gets the same
  ratio everywhere. Reading the segments out of DeepSpeed is :mod:`bert_ds.zero`'s business;
  ``bert_ds.optim.builders.bind_to_engine`` passes them on.
- **Chunked, fused where it pays.** A bound flat tensor is cut into chunks of at most
  1,024 elements, each inside one fragment (:class:`bert_ds.kernels.lamb.Chunks`); the
  elementwise update and the chunks' squared norms are one op,
  :func:`bert_ds.kernels.lamb.lamb_update`, which calls back here between its two passes for
  the per-chunk multipliers (chunk sums into parameters in fp64, the all-reduce, the ratios).
  A single fp32 reduction over a 20M-element fragment is off by ~4% on CPU; the two-level
  sum stays within ~1e-8. On a GPU the op runs its fused kernel (10 passes over the fp32
  state instead of ~31) where the ``kernels`` setting allows it: ``auto`` when it passed its
  self-check on the device and won the race against the native ops, as the model's ops do.
- **A forgotten bind is an error.** ``step()`` refuses tensors that were neither passed
  to the constructor nor bound, instead of silently running a per-partition LAMB.
- **No DeepSpeed here.** This module is the optimizer math and the flat-tensor layout only;
  which DeepSpeed layouts it runs under (ZeRO-0 in fp32, ZeRO-1/2) is said in :mod:`bert_ds.zero`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from bert_ds.kernels.ops import Backend, KernelSetting, OpShapes, resolve_backend
from bert_ds.kernels.lamb import ChunkScales, Chunks, LambScalars, SkipFactors, lamb_update


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


def _advanced_state(state: dict, p: torch.Tensor) -> dict:
    """``p``'s optimizer ``state``: the moments (zeros at its first step), the step counter advanced."""
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["step"] += 1
    return state


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


class LambReference(torch.optim.Optimizer):
    """Textbook LAMB, one tensor at a time: the definition :class:`Lamb` is tested against.

    Each tensor in ``params`` that the variant adapts gets its own trust ratio. Handed to
    DeepSpeed ZeRO it is therefore the naive LAMB with one ratio per flat partition.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, variant: LambVariant = "nvidia"):
        _check_hyperparameters(lr, betas, eps, weight_decay, variant)
        self.variant = variant
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = _advanced_state(self.state[p], p)
                lamb_reference_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                                    lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                    weight_decay=group["weight_decay"], variant=self.variant)
        return loss


# --------------------------------------------------------------------------- flat tensors


@dataclass(frozen=True)
class _FlatLayout:
    """Where each parameter's fragment lies in one flat 1-D tensor, cut into chunks.

    A chunk lies inside one fragment, or inside a gap (DeepSpeed's alignment padding), whose
    slot is ``num_params``. Slot order is the parameter order of the group, the same on every
    rank, so slot vectors add up across ranks.
    """
    tensor: torch.Tensor          # the bound flat tensor, kept to make the id key safe
    chunks: Chunks                # on the tensor's device
    chunk_slots: torch.Tensor     # (K,) int64 on the tensor's device, values in [0, num_params]
    num_params: int
    group: object | None          # process group to all-reduce over; None: nothing to reduce

    def slot_sums(self, squares: torch.Tensor) -> torch.Tensor:
        """(K, 2) per-chunk sums -> (2, num_params + 1) per-parameter sums in fp64, this rank's;
        the last slot is padding. A single fp32 sum over a 20M-element fragment is off by ~4%
        on a CPU; chunk sums of at most 1,024 elements, then fp64, stay within ~1e-8."""
        sums = torch.zeros(2, self.num_params + 1, dtype=torch.float64, device=squares.device)
        sums[0].index_add_(0, self.chunk_slots, squares[:, 0].to(torch.float64))
        sums[1].index_add_(0, self.chunk_slots, squares[:, 1].to(torch.float64))
        return sums

    def chunk_scales(self, lr: float) -> ChunkScales:
        """The callback of :func:`~bert_ds.kernels.lamb.lamb_update`: per-chunk squared norms of
        w and u -> per-chunk lr * the trust ratio of the chunk's parameter, its sums all-reduced
        over ``group`` in one call."""
        def scales(squares: torch.Tensor) -> torch.Tensor:  # (K, 2) fp32 -> (K,) fp32
            sums = self.slot_sums(squares)
            if self.group is not None:
                dist.all_reduce(sums, group=self.group)
            ratio = _trust_ratio(sums[0].sqrt(), sums[1].sqrt())
            return (ratio * lr)[self.chunk_slots].to(torch.float32)
        return scales


def _flat_layout(flat: torch.Tensor, segments: Sequence[tuple[int, int, int]], num_params: int,
                 group: object | None) -> _FlatLayout:
    numel = flat.numel()
    pieces: list[tuple[int, int]] = []  # (length, slot) tiling [0, numel) in order
    cursor = 0
    for start, length, index in sorted(segments):
        if length <= 0 or start < cursor or start + length > numel or not 0 <= index < num_params:
            raise ValueError(f"segment (offset={start}, numel={length}, param={index}) is empty, overlaps "
                             f"another or lies outside a flat tensor of {numel} elements and {num_params} params")
        if start > cursor:  # a gap: padding, which belongs to no parameter
            pieces.append((start - cursor, num_params))
        pieces.append((length, index))
        cursor = start + length
    if cursor < numel:
        pieces.append((numel - cursor, num_params))

    lengths, slots = zip(*pieces)
    chunks, piece_of_chunk = Chunks.tile(lengths, flat.device)
    chunk_slots = torch.tensor(slots, dtype=torch.int64, device=flat.device)[piece_of_chunk]
    return _FlatLayout(flat, chunks, chunk_slots, num_params, group)


# --------------------------------------------------------------------------- LAMB


class Lamb(torch.optim.Optimizer):
    """LAMB with ``torch._foreach_*`` ops and one trust ratio per model parameter.

    Param groups carry their own ``weight_decay``; put biases and LayerNorm weights in a
    group with 0 (under the default ``variant="nvidia"`` that group takes plain Adam steps).
    Ordinary parameters get one ratio per tensor. Flat tensors that hold fragments of several
    parameters get per-parameter ratios once bound with :meth:`bind_flat_tensor`.

    Under DeepSpeed ZeRO-1/2 (``"zero_allow_untested_optimizer": true`` in its config)::

        lamb = Lamb(param_groups, lr=..., weight_decay=...)
        engine, *_ = deepspeed.initialize(model=model, optimizer=lamb, config=cfg)
        bind_to_engine(lamb, engine)   # bert_ds.optim.builders; every rank, before the first step
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, variant: LambVariant = "nvidia",
                 kernels: KernelSetting = "auto", shapes: OpShapes | None = None):
        _check_hyperparameters(lr, betas, eps, weight_decay, variant)
        self.variant = variant
        self.kernels = kernels  # the flat tensors' update: fused where it runs and is faster (auto), or not
        self.shapes = shapes  # the model's (BertForPreTraining.op_shapes): auto reads the race the model ran
        self._resolved: Backend | None = None
        self._given: set[int] = set()               # ids of tensors stepped with one ratio each
        self._layouts: dict[int, _FlatLayout] = {}  # id of a bound flat tensor -> its layout
        # bert_ds.optim.device_skip: a one-element float32 device tensor; non-zero: step() leaves
        # the weights and moments as they are, without reading it (the step counts move on)
        self.skip_if: torch.Tensor | None = None
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._given.update(id(p) for p in self.param_groups[-1]["params"])

    # -- binding

    def bind_flat_tensor(self, flat: torch.Tensor, segments: Sequence[tuple[int, int, int]], num_params: int,
                         group: object | None = None) -> None:
        """Step ``flat`` with one trust ratio per parameter instead of one for the whole tensor.

        ``segments``: (offset, numel, param_index) of each parameter fragment in ``flat``;
        elements outside every segment are padding. ``num_params``: parameters in the index
        space (also those with no fragment here). ``group``: the process group whose ranks
        hold the other fragments, to sum squared norms over; None when ``flat`` holds all of
        them. Every rank of ``group`` must bind, and step, the same param groups.
        """
        if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() == 0:
            raise ValueError(f"a flat tensor must be 1-D, contiguous and not empty, got shape {tuple(flat.shape)}")
        if not any(p is flat for g in self.param_groups for p in g["params"]):
            raise ValueError("the flat tensor is not in this optimizer's param groups")
        self._layouts[id(flat)] = _flat_layout(flat, segments, num_params, group)

    # -- step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        plain, flats = [], []
        for p in group["params"]:
            if id(p) in self._layouts:
                if p.grad is None:  # the other ranks would wait for this rank's all-reduce forever
                    raise RuntimeError("a bound flat tensor has no gradient")
                flats.append(p)
            elif id(p) in self._given:
                if p.grad is not None:
                    plain.append(p)
            else:
                raise RuntimeError(
                    "Lamb.step() got a tensor it was neither given nor bound to: a wrapper replaced the "
                    "parameters. Under DeepSpeed ZeRO-1/2 call bert_ds.optim.builders.bind_to_engine(lamb, "
                    "engine) after deepspeed.initialize (for another layout, bind_flat_tensor), or the trust "
                    "ratios would cover whole partitions. Inside deepspeed.initialize this is ZeRO-0 with "
                    "bf16/fp16, whose wrapper steps once with zero gradients (weight decay alone would move "
                    "the weights); use ZeRO stage 1 or 2.")
        if plain:
            self._step_plain(group, plain)
        for flat in flats:
            self._step_flat(group, flat)

    def _step_plain(self, group: dict, params: list[torch.Tensor]) -> None:
        """Separate tensors, one trust ratio each, in foreach ops."""
        f = SkipFactors.of(self.skip_if, *group["betas"])
        updates = self._adam_updates(group, params, f)
        lr = group["lr"]
        if _adapts(group["weight_decay"], self.variant):
            ratio = _trust_ratio(torch.stack(torch._foreach_norm(params)), torch.stack(torch._foreach_norm(updates)))
            torch._foreach_mul_(updates, list((ratio * lr * f.apply).unbind(0)))
        else:
            torch._foreach_mul_(updates, lr * f.apply)
        torch._foreach_sub_(params, updates)

    def _step_flat(self, group: dict, flat: torch.Tensor) -> None:
        """A bound flat tensor, one trust ratio per parameter, by the chunked update op."""
        state = self._state(flat)
        layout = self._layouts[id(flat)]
        scalars = LambScalars.at_step(group["betas"], group["eps"], group["weight_decay"], state["step"])
        # Same decision on every rank (the group's settings are), so no rank waits on a norm
        # all-reduce the others skip.
        scales = layout.chunk_scales(group["lr"]) if _adapts(group["weight_decay"], self.variant) else group["lr"]
        lamb_update(flat, flat.grad, state["exp_avg"], state["exp_avg_sq"], layout.chunks, scalars, scales,
                    backend=self._backend(flat), skip=self.skip_if)

    def _backend(self, flat: torch.Tensor) -> Backend:
        """The kernels setting, resolved at the first step of a flat tensor at the model's shapes
        (in a training process the model resolved them first, and this is the same plan)."""
        if self._resolved is None:
            self._resolved = resolve_backend(self.kernels, self.shapes)
        return self._resolved

    def _state(self, p: torch.Tensor) -> dict:
        if p.grad.is_sparse:
            raise RuntimeError("Lamb does not support sparse gradients")
        return _advanced_state(self.state[p], p)

    def _adam_updates(self, group: dict, params: list[torch.Tensor], f: SkipFactors) -> list[torch.Tensor]:
        """Advance the moments of ``params`` (as ``f`` says: not at all when skipped); returns the
        updates (weight decay included), new tensors."""
        states = [self._state(p) for p in params]
        grads = [f.grad(p.grad) for p in params]
        exp_avgs, exp_avg_sqs = [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states]
        scalars = [LambScalars.at_step(group["betas"], group["eps"], group["weight_decay"], st["step"])
                   for st in states]

        # A device tensor goes in as one weight per tensor: passed alone it would be taken as a
        # Scalar, which torch reads to the host (a wait for the device's queue on a GPU).
        beta1_weights = f.beta1_weight if f.skipped is None else [f.beta1_weight] * len(grads)
        torch._foreach_lerp_(exp_avgs, grads, beta1_weights)  # m + (1 - b1)(g - m): one pass instead of two
        torch._foreach_mul_(exp_avg_sqs, f.beta2_keep)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - group["betas"][1])
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, [s.eps_hat for s in scalars])
        step_sizes = [s.step_size for s in scalars]
        if group["weight_decay"] != 0:
            updates = torch._foreach_mul(params, group["weight_decay"])
            torch._foreach_addcdiv_(updates, exp_avgs, denom, step_sizes)
        else:
            updates = torch._foreach_div(exp_avgs, denom)
            torch._foreach_mul_(updates, step_sizes)
        return updates


__all__ = ["VARIANTS", "Lamb", "LambReference", "LambVariant", "lamb_reference_step"]
