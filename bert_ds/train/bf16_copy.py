"""bf16 training on ZeRO-1/2 with the gradients summed in fp32 in one flat buffer per param group.

Where a config asks for bf16 with fp32 gradient accumulation on ZeRO-1/2 (every shipped bf16
ZeRO-1/2 config; :func:`bert_ds.config.runs_bf16_copy`), DeepSpeed is given the same engine in
fp32 (:func:`bert_ds.config.engine_json`): its module holds the fp32 weights, which its ZeRO
optimizer steps, saves and gathers as under ``zero1_fp32.json``. A bf16 copy of the model
computes, and :class:`Bf16Copy` runs the micro-batches on it:

- **Layout.** ZeRO-1/2 flatten each param group's weights into one tensor, of which the
  parameters are views (:func:`bert_ds.zero.flat_groups`). The copy's weights are views of one
  bf16 tensor of the same layout, its gradients of another, and the fp32 gradient sum is a
  third: an element has the same offset in all four.
- **A micro-batch**: the bf16 gradients are zeroed (one operation per group), the backward runs
  (autograd adds each parameter's gradient into its view, as it adds into any existing
  ``.grad``), and the bf16 gradients are added into the fp32 sum (one per group; the first
  micro-batch of a step copies instead). DeepSpeed's ``BF16_Optimizer``, which the engine uses
  for this layout otherwise, converts and adds each parameter's gradient on its own, two
  operations per parameter per micro-batch (812 per BERT-Base step of two micro-batches, 39 ms
  of host time on an H100), measures and clips the gradients with three device reads per step,
  and prints 17 lines of memory figures as it is built.
- **The step**: the fp32 sums are all-reduced and averaged over the ranks (one collective per
  group, in the config's ``communication_data_type``), and each rank's partition of them is
  handed to DeepSpeed's step as it is (:func:`bert_ds.zero.hand_partition_gradients`); the
  training step checks, measures and clips them there (:mod:`bert_ds.train.step`), with no
  device read. After the update (the engine all-gathers the fp32 weights), the copy's weights
  are rounded from them, one operation per group.

What the model computes is the same as under ``BF16_Optimizer``: the same bf16 weights (rounded
from the same fp32 masters), the same bf16 gradients, summed in fp32 in the same order. The
checkpoints hold the fp32 weights, as every other layout's do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from bert_ds import zero

# DeepSpeed's names for its communication dtypes
_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Bf16Copy:
    """Runs a step's micro-batches on a bf16 copy of ``engine``'s module (fp32, ZeRO-1/2).

    ``make_model`` builds a model of the same class and parameter names on the engine's device
    (its weights are replaced; the random numbers its initialisation draws are given back, so
    that dropout draws what it would have drawn, and a resumed run repeats an uninterrupted one);
    ``accumulation_steps``: micro-batches per step, each loss divided by it as
    ``engine.backward`` divides (:meth:`begin_step` changes it); ``comm_dtype``: the gradients'
    all-reduce dtype.

    The engine's own ``forward``/``backward`` are not called: DeepSpeed's micro-step count
    still moves with each ``engine.step()``, and at the boundary its step takes the gradients
    :meth:`reduce_gradients` handed over.
    """

    def __init__(self, engine, make_model: Callable[[], nn.Module], accumulation_steps: int,
                 comm_dtype: str | None = "fp32"):
        self.engine = engine
        self.accumulation_steps = accumulation_steps
        self.comm_dtype = _COMM_DTYPES[comm_dtype or "fp32"]
        self.groups = zero.flat_groups(engine)
        device = self.groups[0].flat.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.model = make_model().to(torch.bfloat16)
        self.model.train(engine.module.training)
        self.weights = [torch.empty_like(g.flat, dtype=torch.bfloat16) for g in self.groups]
        self.grads = [torch.zeros_like(w) for w in self.weights]
        self.sums = [torch.zeros_like(g.flat) for g in self.groups]
        self._place_parameters()
        self.refresh_weights()
        self._micro_batches = 0

    def _place_parameters(self) -> None:
        """Point each of the copy's parameters, and its gradient, at its place in the flat bf16
        tensors: the place of the engine's parameter of the same name in its group's flat weights."""
        names = {id(p): name for name, p in self.engine.module.named_parameters()}
        mine = dict(self.model.named_parameters())
        if sorted(mine) != sorted(names.values()):
            raise ValueError("the bf16 copy's parameters are not the engine module's: "
                             f"{sorted(set(mine) ^ set(names.values()))[:5]}")
        placed = set()
        for group, weights, grads in zip(self.groups, self.weights, self.grads):
            base = group.flat.data_ptr()
            for master in group.params:
                offset, numel = (master.data_ptr() - base) // master.element_size(), master.numel()
                if not 0 <= offset <= group.flat.numel() - numel:
                    raise RuntimeError(f"{names[id(master)]} is not a view of its group's flat weights")
                param = mine[names[id(master)]]
                param.data = weights.narrow(0, offset, numel).view(master.shape)
                param.grad = grads.narrow(0, offset, numel).view(master.shape)
                placed.add(names[id(master)])
        if placed != set(mine):
            raise RuntimeError(f"parameters in no ZeRO param group: {sorted(set(mine) - placed)[:5]}")

    # ------------------------------------------------------------------ what the step calls

    def begin_step(self, accumulation_steps: int) -> None:
        """A step of ``accumulation_steps`` micro-batches begins."""
        set_accumulation(self.engine, accumulation_steps)
        self.accumulation_steps = accumulation_steps

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward: its bf16 gradients, summed into fp32."""
        for grads in self.grads:
            grads.zero_()
        (loss / self.accumulation_steps).backward()
        first = self._micro_batches == 0
        for grads, sums in zip(self.grads, self.sums):
            sums.copy_(grads) if first else sums.add_(grads)
        self._micro_batches += 1

    def reduce_gradients(self) -> None:
        """At the step's end, before ``engine.step()``: the fp32 sums averaged over the ranks, and
        this rank's partition of each handed to the engine's step."""
        if self._micro_batches == 0:
            raise RuntimeError("reduce_gradients() before any backward of this step")
        for group, sums in zip(self.groups, self.sums):
            world = dist.get_world_size(group=group.group)
            if world > 1:
                _all_reduce_mean(sums, group.group, world, self.comm_dtype)
        zero.hand_partition_gradients(self.engine, [sums[group.partition] for group, sums in zip(self.groups, self.sums)])
        self._micro_batches = 0

    def refresh_weights(self) -> None:
        """The copy's weights rounded from the engine's fp32 weights: after every update, and
        after weights were loaded into the engine."""
        for group, weights in zip(self.groups, self.weights):
            weights.copy_(group.flat)

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()


def set_accumulation(engine, accumulation_steps: int) -> None:
    """The engine's accumulation steps for the step that begins (a batch-size warm-up changes
    them): ``engine.backward`` divides each loss by them."""
    if engine.gradient_accumulation_steps() != accumulation_steps:
        engine.set_train_batch_size(accumulation_steps * engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)


def _all_reduce_mean(t: torch.Tensor, group, world: int, comm_dtype: torch.dtype) -> None:
    """``t`` averaged over ``group`` in place, summed in ``comm_dtype`` (as DeepSpeed averages: the
    sum, then divided by the world size)."""
    sent = t if t.dtype == comm_dtype else t.to(comm_dtype)
    dist.all_reduce(sent, group=group)
    if sent is not t:
        t.copy_(sent)
    t.div_(world)


class EngineRunner:
    """The same calls on the engine itself, for every other layout: DeepSpeed runs the
    micro-batches, reduces the gradients in the boundary's backward, and updates its module."""

    def __init__(self, engine):
        self.engine = engine

    def begin_step(self, accumulation_steps: int) -> None:
        set_accumulation(self.engine, accumulation_steps)

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def reduce_gradients(self) -> None:
        pass  # the last micro-batch's engine.backward did

    def refresh_weights(self) -> None:
        pass  # the engine's module is what computes

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()
