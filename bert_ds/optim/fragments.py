"""Per-parameter statistics over flat tensors: what LAMB's trust ratios and StableAdamW's update
clipping share, also under DeepSpeed ZeRO-1/2.

Both optimizers take one number per model parameter from a reduction over the whole parameter
(LAMB: ``||w||`` and ``||u||``; StableAdamW: the mean of ``g^2 / v_hat``). A sharding wrapper
(DeepSpeed ZeRO-1/2) replaces each param group's ``params`` by ONE flat tensor: this rank's
slice of the group's concatenated parameters. A reduction over that tensor mixes parameters and
changes with the world size (DeepSpeed issues #88, #490, #4417).

Design choices, and why:

- **A layout per bound flat tensor** (:class:`FlatLayout`). The optimizer is shown where each
  parameter's fragment lies in the flat tensor (``segments``) and which process group holds the
  other fragments (:meth:`FragmentOptimizer.bind_flat_tensor`; ``bert_ds.optim.builders.bind_to_engine``
  reads them out of DeepSpeed through :mod:`bert_ds.zero`). The tensor is cut into chunks of at
  most 1,024 elements, each inside one fragment or one gap (DeepSpeed's alignment padding), so
  that per-chunk sums add up into per-parameter sums.
- **Two-level sums, one all-reduce.** Chunk sums in fp32 (1,024 terms: exact to ~1e-7), then
  per-parameter sums in fp64, then one all-reduce of a ``(2, num_params + 1)`` tensor over the
  group per flat tensor and step (apex's DistributedFusedLAMB does the same). A single fp32 sum
  over a 20M-element fragment is off by ~4% on a CPU; this stays within ~1e-8. A parameter
  split between ranks, or absent from a rank, gets the same figure on every rank.
- **A forgotten bind is an error.** ``step()`` refuses tensors that were neither passed to the
  constructor nor bound, instead of silently reducing over whole partitions.
- **A skip flag read on the device** (``skip_if``, :mod:`bert_ds.optim.device_skip`): where it is
  non-zero, ``step()`` leaves the weights and moments as they were without reading it to the host.
  Every rank still makes its all-reduces, so no rank waits on one the others skip.
- **Each beside its plain definition** (:class:`PerTensorOptimizer`: the rule on one tensor at a
  time, ``LambReference``, ``StableAdamWReference``), which the tests hold the fast paths to.
- **No DeepSpeed here.** Which DeepSpeed layouts these run under is :mod:`bert_ds.zero`'s business.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bert_ds.kernels.lamb import Chunks, LambScalars, SkipFactors


@dataclass(frozen=True)
class FlatLayout:
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

    def slot_sums(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """(K, 2) per-chunk sums -> (2, num_params + 1) per-parameter sums in fp64, this rank's;
        the last slot is padding."""
        sums = torch.zeros(2, self.num_params + 1, dtype=torch.float64, device=per_chunk.device)
        sums[0].index_add_(0, self.chunk_slots, per_chunk[:, 0].to(torch.float64))
        sums[1].index_add_(0, self.chunk_slots, per_chunk[:, 1].to(torch.float64))
        return sums

    def parameter_sums(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """:meth:`slot_sums` summed over every rank of ``group``: each parameter's whole figure.
        Collective: every rank of the group calls it for the same flat tensors in the same order."""
        sums = self.slot_sums(per_chunk)
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        return sums

    def per_element(self, per_slot: torch.Tensor) -> torch.Tensor:
        """(num_params + 1,) -> (numel,): each element gets its parameter's (or the padding's) value."""
        return self.chunks.expand(per_slot[self.chunk_slots])

    def chunk_lengths(self, dtype: torch.dtype) -> torch.Tensor:
        """(K,) the chunks' lengths: summed per parameter, its number of elements."""
        return self.chunks.lengths.to(dtype)


def flat_layout(flat: torch.Tensor, segments: Sequence[tuple[int, int, int]], num_params: int,
                group: object | None) -> FlatLayout:
    """The layout of ``flat`` given (offset, numel, param_index) of each fragment in it."""
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
    return FlatLayout(flat, chunks, chunk_slots, num_params, group)


def adam_state(state: dict, p: torch.Tensor) -> dict:
    """``p``'s optimizer ``state``: Adam's two moments (zeros at its first step), the step
    counter advanced (a host int, 1-based after this call)."""
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["step"] += 1
    return state


def closure_loss(closure) -> torch.Tensor | None:
    """What ``optimizer.step(closure)`` returns: the closure's loss, computed with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class PerTensorOptimizer(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """An Adam-family rule applied to each tensor on its own, one statistic per tensor: the
    plain definitions the fragment optimizers are tested against (handed to DeepSpeed ZeRO, the
    naive optimizer with one statistic per flat partition). Subclasses give ``_step_tensor``."""

    @abc.abstractmethod
    def _step_tensor(self, p: torch.Tensor, state: dict, group: dict) -> None:
        """One step of ``p`` by its gradient; ``state``: its Adam moments, the step counted."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_tensor(p, adam_state(self.state[p], p), group)
        return loss


class FragmentOptimizer(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """An optimizer with one statistic per model parameter, kept per parameter over bound flat
    tensors. Subclasses step separate tensors in ``_step_plain`` and a bound flat tensor in
    ``_step_flat``; ``STATISTIC`` names what a missing bind would compute per partition."""

    STATISTIC = "per-parameter statistics"

    def __init__(self, params: Iterable, defaults: dict):
        self._given: set[int] = set()              # ids of tensors stepped as they are, one statistic each
        self._layouts: dict[int, FlatLayout] = {}  # id of a bound flat tensor -> its layout
        # bert_ds.optim.device_skip: a one-element float32 device tensor; non-zero: step() leaves
        # the weights and moments as they are, without reading it (the step counts move on)
        self.skip_if: torch.Tensor | None = None
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._given.update(id(p) for p in self.param_groups[-1]["params"])

    def bind_flat_tensor(self, flat: torch.Tensor, segments: Sequence[tuple[int, int, int]], num_params: int,
                         group: object | None = None) -> None:
        """Step ``flat`` with one statistic per parameter instead of one for the whole tensor.

        ``segments``: (offset, numel, param_index) of each parameter fragment in ``flat``;
        elements outside every segment are padding. ``num_params``: parameters in the index
        space (also those with no fragment here). ``group``: the process group whose ranks
        hold the other fragments, to sum over; None when ``flat`` holds all of them. Every rank
        of ``group`` must bind, and step, the same param groups.
        """
        if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() == 0:
            raise ValueError(f"a flat tensor must be 1-D, contiguous and not empty, got shape {tuple(flat.shape)}")
        if not any(p is flat for g in self.param_groups for p in g["params"]):
            raise ValueError("the flat tensor is not in this optimizer's param groups")
        self._layouts[id(flat)] = flat_layout(flat, segments, num_params, group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            plain, flats = self._split(group)
            if plain:
                self._step_plain(group, plain)
            for flat in flats:
                self._step_flat(group, flat, self._layouts[id(flat)])
        return loss

    def _split(self, group: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The group's given tensors that have a gradient, and its bound flat tensors."""
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
                name = type(self).__name__
                raise RuntimeError(
                    f"{name}.step() got a tensor it was neither given nor bound to: a wrapper replaced the "
                    f"parameters. Under DeepSpeed ZeRO-1/2 call bert_ds.optim.builders.bind_to_engine({name.lower()}, "
                    f"engine) after deepspeed.initialize (for another layout, bind_flat_tensor), or the "
                    f"{self.STATISTIC} would cover whole partitions. Inside deepspeed.initialize this is ZeRO-0 "
                    "with bf16/fp16, whose wrapper steps once with zero gradients (weight decay alone would move "
                    "the weights); use ZeRO stage 1 or 2.")
        return plain, flats

    def _state(self, p: torch.Tensor) -> dict:
        if p.grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        return adam_state(self.state[p], p)

    def _adam_updates(self, group: dict, params: list[torch.Tensor], f: SkipFactors,
                      weight_decay: float) -> list[torch.Tensor]:
        """Advance the moments of ``params`` (as ``f`` says: not at all when skipped); returns
        Adam's bias-corrected directions plus ``weight_decay * w``, new tensors, in foreach ops."""
        states = [self._state(p) for p in params]
        grads = [f.grad(p.grad) for p in params]
        exp_avgs, exp_avg_sqs = [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states]
        scalars = [LambScalars.at_step(group["betas"], group["eps"], weight_decay, st["step"]) for st in states]

        # A device tensor goes in as one weight per tensor: passed alone it would be taken as a
        # Scalar, which torch reads to the host (a wait for the device's queue on a GPU).
        beta1_weights = f.beta1_weight if f.skipped is None else [f.beta1_weight] * len(grads)
        torch._foreach_lerp_(exp_avgs, grads, beta1_weights)  # m + (1 - b1)(g - m): one pass instead of two
        torch._foreach_mul_(exp_avg_sqs, f.beta2_keep)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - group["betas"][1])
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, [s.eps_hat for s in scalars])
        step_sizes = [s.step_size for s in scalars]
        if weight_decay != 0:
            updates = torch._foreach_mul(params, weight_decay)
            torch._foreach_addcdiv_(updates, exp_avgs, denom, step_sizes)
        else:
            updates = torch._foreach_div(exp_avgs, denom)
            torch._foreach_mul_(updates, step_sizes)
        return updates

    @abc.abstractmethod
    def _step_plain(self, group: dict, params: list[torch.Tensor]) -> None:
        """Step separate tensors (each with a gradient), one statistic per tensor."""

    @abc.abstractmethod
    def _step_flat(self, group: dict, flat: torch.Tensor, layout: FlatLayout) -> None:
        """Step a bound flat tensor, one statistic per parameter of ``layout``."""


__all__ = ["FlatLayout", "FragmentOptimizer", "PerTensorOptimizer", "adam_state", "closure_loss", "flat_layout"]
