"""One optimizer step and its statistics.

:class:`TrainStep` runs a step on the DeepSpeed engine: forward and backward over the
step's micro-batches, one all-reduce of the step's statistics (the step's one host sync),
then the update or its skip. :func:`account` decides what the step counts as, from the
all-reduced statistics alone, so every rank decides alike; it is plain Python, tested
without an engine or a process group:

- a non-finite loss (any micro-batch, any rank) or gradient skips the update and counts in
  ``skipped_steps``; so does an fp16 loss-scale overflow, which is the loss scaler's
  business, not a bad step;
- bad steps in a row are the bad streak; :func:`check_bad_streak` stops the run at
  ``--max-bad-steps`` of them (:class:`~bert_ds.base.errors.BadStepsError`, exit 3);
- a stop signal on any rank is a vote in the same all-reduce: every rank stops after this step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from bert_ds import zero
from bert_ds.base.errors import BadStepsError
from bert_ds.loader.pretraining import Batch, PretrainingLoader, to_device
from bert_ds.model.bert import pretraining_inputs
from bert_ds.train.faults import Faults
from bert_ds.train.profiling import stage
from bert_ds.train.signals import StopRequest


@dataclass
class RunState:
    """What a checkpoint must carry besides the engine state."""

    step: int = 0
    tokens: int = 0  # real (non-pad) tokens consumed, all ranks
    skipped_steps: int = 0  # steps whose update was skipped (non-finite, or an fp16 overflow)
    bad_streak: int = 0  # non-finite steps in a row, up to the last one
    loader: dict[str, int] = field(default_factory=dict)
    world_size: int = 1


# Per-step statistics summed over micro-batches and ranks in one all-reduce. The last
# three decide the step for every rank alike: a non-finite loss (any micro-batch) or
# gradient (ZeRO-0: checked here; ZeRO-1/2: DeepSpeed checks) skips the update, and a
# stop signal on any rank stops the run after this step.
STATS = ("loss_sum", "micro_batches", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "tokens",
         "sum_sq_len", "grad_sq", "nonfinite_loss", "nonfinite_grad", "stop")
AT = {name: i for i, name in enumerate(STATS)}


def batch_stats(out, batch: Batch, loss: torch.Tensor) -> torch.Tensor:
    """The STATS of one micro-batch, on the batch's device, made of device values only: a
    Python number turned into a device tensor is a copy from host memory, which on a GPU
    waits for everything queued before it. The step-wide entries (``grad_sq``,
    ``nonfinite_grad``, ``stop``) are zero here; :class:`TrainStep` fills them."""
    lengths = batch["attention_mask"].sum(dim=1, dtype=torch.float64)
    loss = loss.detach().double()
    zero = torch.zeros((), dtype=torch.float64, device=loss.device)  # filled on the device: no copy
    nsp = (out.nsp_correct, out.nsp_count) if out.nsp_count is not None else (zero, zero)  # --pair-task none
    parts = [loss, zero + 1, out.mlm_correct, out.mlm_count, *nsp, lengths.sum(), (lengths ** 2).sum(), zero,
             (~torch.isfinite(loss)).double(), zero, zero]
    return torch.stack([x.double() for x in parts])


def all_reduce(t: torch.Tensor) -> list[float]:
    """Sum across ranks (gloo reduces CPU tensors, NCCL device tensors) and bring to the host."""
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.cpu().tolist()


def forward(engine, batch: Batch):
    return engine(**pretraining_inputs(batch))


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


@dataclass(frozen=True)
class StepOutcome:
    """What one step counted as, the same on every rank."""

    step: int
    sums: dict[str, float]  # the STATS, summed over micro-batches and ranks
    bad: bool  # non-finite: counts toward the bad streak and is not checkpointed on schedule
    stop_votes: int  # ranks that hold a stop request: non-zero stops the run after this step

    @property
    def loss(self) -> float:
        return ratio(self.sums["loss_sum"], self.sums["micro_batches"])


def account(state: RunState, sums: dict[str, float], engine_skipped: bool, *, fp16: bool) -> StepOutcome:
    """Count the step that just ran into ``state`` (step, tokens, skips, bad streak).

    ``engine_skipped``: the engine skipped the update (DeepSpeed's overflow check, or ours
    under ZeRO-0). A non-finite step that the engine applied anyway is refused."""
    step = state.step + 1
    nonfinite = sums["nonfinite_loss"] > 0 or sums["nonfinite_grad"] > 0
    if nonfinite and not engine_skipped:
        raise BadStepsError(f"step {step} had a non-finite loss but DeepSpeed applied the update "
                            "(a config with its gradient-overflow check off?); stopping without a checkpoint")
    state.step = step
    state.tokens += int(sums["tokens"])
    state.skipped_steps += int(nonfinite or engine_skipped)
    # fp16's loss scaler overflows routinely while it finds its scale: skipped, but not "bad"
    bad = nonfinite or (engine_skipped and not fp16)
    state.bad_streak = state.bad_streak + 1 if bad else 0
    return StepOutcome(step, sums, bad, int(sums["stop"]))


def check_bad_streak(state: RunState, max_bad_steps: int, newest: Callable[[], Path | None]) -> None:
    """Stop the run (BadStepsError) once ``max_bad_steps`` steps in a row were bad (0: never);
    ``newest`` names the newest checkpoint, which holds none of them."""
    if max_bad_steps and state.bad_streak >= max_bad_steps:
        last = newest()
        raise BadStepsError(
            f"{state.bad_streak} non-finite steps in a row ({state.step - state.bad_streak + 1}-{state.step}, "
            f"--max-bad-steps {max_bad_steps}); stopping without a checkpoint of them; newest "
            f"checkpoint: {last if last else 'none'}")


@dataclass(frozen=True)
class StepResult:
    outcome: StepOutcome
    lr: float  # the step's learning rate
    grad_norm: float | None  # the gradients' global L2 norm before clipping; None: ask the engine
    first_position: int  # the loader's stream position at the start of the step
    step_s: float  # the whole step
    data_s: float  # of which waiting for the loader


class TrainStep:
    """Runs one optimizer step on the engine; ``optimizer`` is the one handed to DeepSpeed."""

    def __init__(self, engine, optimizer: torch.optim.Optimizer, loader: PretrainingLoader, device: torch.device,
                 rank: int, stop: StopRequest, *, fp16: bool, faults: Faults, grad_clip: float = 0.0,
                 owns_gradients: bool = False):
        self.engine, self.optimizer, self.loader = engine, optimizer, loader
        self.device, self.rank, self.stop, self.fp16, self.faults = device, rank, stop, fp16, faults
        # ZeRO-0 in fp32 steps our optimizer directly and DeepSpeed never checks the gradients (we
        # do, and skip). ZeRO-1/2 in bf16 or fp32 (bert_ds.config.step_owns_gradients): we check,
        # measure and clip the partition's gradients, and ask for DeepSpeed's check on a
        # non-finite step. Elsewhere (fp16, bf16 with fp32 accumulation) DeepSpeed does all three.
        self.plain_optimizer = zero.steps_directly(engine, optimizer)
        self.owns_gradients = owns_gradients
        self.grad_clip = grad_clip
        if owns_gradients != zero.step_owns_gradients(engine):
            raise RuntimeError(f"the engine config {'gives' if owns_gradients else 'does not give'} the step the "
                               f"gradients' checks, but the engine's optimizer ({type(engine.optimizer).__name__}) "
                               f"{'still does them' if owns_gradients else 'leaves them undone'}")

    def __call__(self, state: RunState) -> StepResult:
        step = state.step + 1
        self.faults.before_step(self.rank, step)
        t0 = time.perf_counter()
        first_position = self.loader.consumed_samples
        with stage("data"):
            batches = self.loader.next_step()
        data_s = time.perf_counter() - t0
        stats = self._forward_backward(batches, step)
        with stage("gradient_checks"):
            grads = ([p.grad for p in self.engine.module.parameters()] if self.plain_optimizer else
                     zero.partition_gradients(self.engine) if self.owns_gradients else None)
            if grads is not None:  # the flag that decides a skip, and the norm, in the same all-reduce
                stats[AT["grad_sq"]] = grad_square_sum(grads, self.device)
                stats[AT["nonfinite_grad"]] = (~torch.isfinite(stats[AT["grad_sq"]])).double()
            stats[AT["stop"]] = float(self.stop.requested)  # a host number assigned is a fill: no copy
        with stage("all_reduce"):
            sums = dict(zip(STATS, all_reduce(stats)))  # the step's one host sync, before the update
        lr = self.engine.get_lr()[0]  # this step's; the scheduler moves on inside engine.step()
        skip = sums["nonfinite_loss"] > 0 or sums["nonfinite_grad"] > 0
        grad_norm = None
        if grads is not None:  # ZeRO-0: every rank holds all the gradients, the sum counts them world times
            square = sums["grad_sq"] / (dist.get_world_size() if self.plain_optimizer else 1)
            grad_norm = math.sqrt(square) if math.isfinite(square) else math.inf  # inf, as DeepSpeed reports a skip
        with stage("update"):
            if self.owns_gradients and not skip:
                clip_gradients(grads, grad_norm, self.grad_clip)
            engine_skipped = self._update(skip)
        outcome = account(state, sums, engine_skipped, fp16=self.fp16)
        return StepResult(outcome, lr, grad_norm, first_position, time.perf_counter() - t0, data_s)

    def _forward_backward(self, batches: list[Batch], step: int) -> torch.Tensor:
        stats = torch.zeros(len(STATS), dtype=torch.float64, device=self.device)
        for i, batch in enumerate(batches):
            with stage("forward"):
                batch = to_device(batch, self.device, non_blocking=True)
                out = forward(self.engine, batch)
                loss = self.faults.loss(out.loss, self.rank, step)
            with stage("backward"):
                self.engine.backward(loss)
            with stage("batch_stats"):
                stats += batch_stats(out, batch, loss)
            if i + 1 < len(batches):
                with stage("micro_step"):
                    self.engine.step()  # inside the accumulation window DeepSpeed only counts micro-steps
        return stats

    def _update(self, skip: bool) -> bool:
        """engine.step(); whether the engine skipped the update."""
        before = zero.skipped_steps(self.engine)
        if self.plain_optimizer:
            around = zero.direct_step(self.optimizer, skip)
        elif skip and self.owns_gradients:
            around = zero.checked_step(self.engine)
        else:
            around = contextlib.nullcontext()
        with around:
            self.engine.step()
        return zero.skipped_steps(self.engine) > before


def clip_gradients(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place so that their global ``norm`` is at most ``max_norm`` (0: no
    clipping): DeepSpeed's rule, the factor ``max_norm / (norm + 1e-6)`` where below 1. The
    factor is a host number: one fused multiply, no copy. bf16 gradients are scaled in bf16
    (DeepSpeed scales their fp32 copy): one more rounding, of 2^-8 relative, of gradients that
    were accumulated and reduced in bf16 already."""
    if max_norm > 0 and grads:
        factor = max_norm / (norm + 1e-6)
        if factor < 1.0:
            torch._foreach_mul_(grads, factor)


def grad_square_sum(grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The sum of squares of ``grads``, in float64: one fused norm over all of them (a few
    kernels on a GPU), without a host sync; inf or NaN where any gradient holds one. Under
    ZeRO-1/2 each rank sums its partition, and the step's all-reduce makes it the global
    squared norm, which DeepSpeed computes again for clipping, one tensor at a time."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    # float64: a float32 norm of a large gradient is off in the 6th digit on a CPU (the
    # accumulation order); the reduction is bound by reading the gradients either way
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()
