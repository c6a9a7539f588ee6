"""One optimizer step and its statistics, read one step late.

:class:`TrainStep` runs a step on the DeepSpeed engine in two calls. :meth:`TrainStep.launch`
queues the step's work: forward and backward over its micro-batches, one all-reduce of the
step's statistics, then the update. Nothing in it reads the device: on a GPU each read waits
for all the work queued before it, and the GPU then idles while the host catches up.
:meth:`TrainStep.finish` reads the statistics, copied to host memory as the step ended; the
loop calls it after it has launched the next step, so the GPU is busy while the host reads
(or at once where the run needs them: a checkpoint, validation, the last step).

Where the step owns the gradients (:func:`bert_ds.config.step_owns_gradients`), the skip of a
non-finite step and the clipping factor are decided on the device: the optimizer leaves
weights and moments as they were when its flag is set (:mod:`bert_ds.optim.device_skip`).
DeepSpeed then sees the step applied: its LR schedule moves on, as does LAMB's step count.
Elsewhere DeepSpeed decides the skip itself (and reads the device to do it).

:func:`account` decides what the step counts as, from the all-reduced statistics alone, so
every rank decides alike; it is plain Python, tested without an engine or a process group:

- a non-finite loss (any micro-batch, any rank) or gradient skips the update and counts in
  ``skipped_steps``; so does an fp16 loss-scale overflow, which is the loss scaler's
  business, not a bad step;
- bad steps in a row are the bad streak; :func:`check_bad_streak` stops the run at
  ``--max-bad-steps`` of them (:class:`~bert_ds.base.errors.BadStepsError`, exit 3);
- a stop signal on any rank is a vote in the same all-reduce: every rank stops once it has
  read it (after the step launched by then).
"""

from __future__ import annotations

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
from bert_ds.model.padding import pretraining_inputs
from bert_ds.kernels.local_attention import local_pairs
from bert_ds.optim import device_skip
from bert_ds.train.bf16_copy import Bf16Copy, EngineRunner
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
         "sum_sq_len", "local_pairs", "grad_sq", "nonfinite_loss", "nonfinite_grad", "stop")
AT = {name: i for i, name in enumerate(STATS)}


def batch_stats(out, batch: Batch, loss: torch.Tensor, window: int = 0) -> torch.Tensor:
    """The STATS of one micro-batch, on the batch's device, made of device values only: a
    Python number turned into a device tensor is a copy from host memory, which on a GPU
    waits for everything queued before it. The step-wide entries (``grad_sq``,
    ``nonfinite_grad``, ``stop``) are zero here; :class:`TrainStep` fills them. ``window``: the
    model's local layers' (``OpShapes.window``; 0: none), for their attention pairs (FLOPs)."""
    lengths = batch["attention_mask"].sum(dim=1, dtype=torch.float64)
    loss = loss.detach().double()
    zero = torch.zeros((), dtype=torch.float64, device=loss.device)  # filled on the device: no copy
    nsp = (out.nsp_correct, out.nsp_count) if out.nsp_count is not None else (zero, zero)  # --pair-task none
    pairs = local_pairs(lengths, window).sum() if window else zero
    parts = [loss, zero + 1, out.mlm_correct, out.mlm_count, *nsp, lengths.sum(), (lengths ** 2).sum(), pairs, zero,
             (~torch.isfinite(loss)).double(), zero, zero]
    return torch.stack([x.double() for x in parts])


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum across ranks, in place (gloo reduces CPU tensors, NCCL device tensors): queued on the
    device like any kernel, no read."""
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


class StepRecord:
    """What a step leaves for its read: its figures on their way to host memory, and how long
    the device took over the step's work.

    On a GPU the copy is queued behind the work that makes the figures, and two timing events
    in the stream mark where the device began the step (after the previous step's work, or as
    the host queued it, whichever came later) and where it ended it: :meth:`read` waits for
    this step's work alone, not for whatever was queued after it, and the span is the
    device's, which is the step's time however far ahead the host runs. On a CPU the work is
    done as it is launched: the host's clock and the figures themselves.
    """

    def __init__(self, device: torch.device):
        self._started = time.perf_counter()
        self.launched_at = self._started  # the host's clock as the step's launch began
        self._ended = self._started
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._host: torch.Tensor | None = None

    def close(self, values: torch.Tensor) -> None:
        """The step's last work is queued: ``values`` go to host memory behind it."""
        if self._events is not None:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._events[1].record()
        else:  # on the host already (an accelerator without events here: a copy that waits)
            self._host = values.detach().to("cpu", copy=True)
            self._ended = time.perf_counter()

    def read(self) -> tuple[list[float], float]:
        """The figures, and the seconds the device spent on the step."""
        if self._events is None:
            return self._host.tolist(), self._ended - self._started
        self._events[1].synchronize()
        return self._host.tolist(), self._events[0].elapsed_time(self._events[1]) / 1e3


def forward(model, batch: Batch):
    """``model``: what computes, the engine or a :mod:`~bert_ds.train.bf16_copy` runner."""
    return model(**pretraining_inputs(batch))


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
    grad_norm: float | None  # the gradients' global L2 norm before clipping; None: the engine has none
    loss_scale: float  # fp16's loss scale after the step; 1.0 without fp16
    first_position: int  # the loader's stream position at the start of the step
    samples: int  # the loader's stream position at its end
    step_s: float  # the device's time on the step (StepRecord)
    data_s: float  # of which waiting for the loader
    launched_at: float  # the host's clock (time.perf_counter) as the step's launch began
    read_at: float  # and once its figures were read, its work done


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose work is queued; :meth:`TrainStep.finish` reads what it counted."""

    step: int
    record: StepRecord  # the all-reduced STATS, then DeepSpeed's gradient norm where it is a tensor
    grad_norm: float | None  # DeepSpeed's norm where it is a host number (or none); else the last value
    lr: float
    loss_scale: float
    engine_skipped: bool  # DeepSpeed skipped the update (its own overflow checks, which read the device)
    first_position: int
    samples: int
    data_s: float


class TrainStep:
    """Runs optimizer steps on the engine; ``optimizer`` is the one handed to DeepSpeed;
    ``runner`` runs the micro-batches (:mod:`bert_ds.train.bf16_copy`: the engine itself, or a
    bf16 copy of its module whose gradients it hands to the engine's step)."""

    def __init__(self, engine, optimizer: torch.optim.Optimizer, loader: PretrainingLoader, device: torch.device,
                 rank: int, stop: StopRequest, *, fp16: bool, faults: Faults, grad_clip: float = 0.0,
                 owns_gradients: bool = False, runner: EngineRunner | Bf16Copy | None = None):
        self.engine, self.optimizer, self.loader = engine, optimizer, loader
        self.runner = runner if runner is not None else EngineRunner(engine)
        self.window = engine.module.op_shapes.window  # the local layers' (0: none), for their FLOPs
        self.device, self.rank, self.stop, self.fp16, self.faults = device, rank, stop, fp16, faults
        # Where the step owns the gradients (ZeRO-0 in fp32; ZeRO-1/2 with DeepSpeed's checks off:
        # bert_ds.config.step_owns_gradients) it checks, measures and clips them, and skips a
        # non-finite step on the device. Elsewhere (fp16, bf16 with fp32 accumulation, ZeRO-3)
        # DeepSpeed does all three.
        self.plain_optimizer = zero.steps_directly(engine, optimizer)
        self.owns_gradients = owns_gradients
        self.grad_clip = grad_clip
        if owns_gradients != zero.step_owns_gradients(engine):
            raise RuntimeError(f"the engine config {'gives' if owns_gradients else 'does not give'} the step the "
                               f"gradients' checks, but the engine's optimizer ({type(engine.optimizer).__name__}) "
                               f"{'still does them' if owns_gradients else 'leaves them undone'}")
        if owns_gradients and not device_skip.skips_on_device(optimizer):
            raise RuntimeError(f"{type(optimizer).__name__} cannot skip a step on the device, which a config that "
                               "leaves the gradients' checks to the training step needs")

    def launch(self, step: int) -> LaunchedStep:
        """Queue step ``step``'s work, the update included; reads nothing from the device."""
        self.faults.before_step(self.rank, step)
        record = StepRecord(self.device)
        t0 = time.perf_counter()
        first_position = self.loader.consumed_samples
        with stage("data"):
            batches = self.loader.next_step()
        data_s = time.perf_counter() - t0
        stats = self._forward_backward(batches, step)
        with stage("gradient_reduce"):
            self.runner.reduce_gradients()
        with stage("gradient_checks"):
            grads = self._gradients()
            if grads is not None:  # the flag that decides a skip, and the norm, in the same all-reduce
                stats[AT["grad_sq"]] = grad_square_sum(grads, self.device)
                stats[AT["nonfinite_grad"]] = (~torch.isfinite(stats[AT["grad_sq"]])).double()
            stats[AT["stop"]] = float(self.stop.requested)  # a host number assigned is a fill: no copy
        with stage("all_reduce"):
            all_reduce(stats)
        lr = self.engine.get_lr()[0]  # this step's; the scheduler moves on inside engine.step()
        with stage("update"):
            if grads is not None:
                self._decide_on_device(stats, grads)
            before = zero.skipped_steps(self.engine)
            self.engine.step()
            engine_skipped = zero.skipped_steps(self.engine) > before
            self.runner.refresh_weights()
        norm = None if grads is not None else self.engine.get_global_grad_norm()
        record.close(torch.cat([stats, norm.detach().reshape(1).double()]) if isinstance(norm, torch.Tensor) else stats)
        return LaunchedStep(step, record, None if isinstance(norm, torch.Tensor) else _number(norm), lr,
                            zero.loss_scale(self.engine), engine_skipped, first_position,
                            self.loader.consumed_samples, data_s)

    def finish(self, launched: LaunchedStep, state: RunState) -> StepResult:
        """Read what ``launched`` counted (waiting for its work, not for what was queued after it)
        and count it into ``state``; steps are finished in the order they were launched."""
        values, step_s = launched.record.read()
        read_at = time.perf_counter()
        sums = dict(zip(STATS, values))
        nonfinite = sums["nonfinite_loss"] > 0 or sums["nonfinite_grad"] > 0
        grad_norm = values[len(STATS)] if len(values) > len(STATS) else launched.grad_norm
        if self.owns_gradients:  # ZeRO-0: every rank holds all the gradients, the sum counts them world times
            square = sums["grad_sq"] / (dist.get_world_size() if self.plain_optimizer else 1)
            grad_norm = math.sqrt(square) if math.isfinite(square) else math.inf  # inf, as DeepSpeed reports a skip
        # where the step owns the gradients, the device skipped exactly the non-finite steps
        skipped = launched.engine_skipped or (self.owns_gradients and nonfinite)
        outcome = account(state, sums, skipped, fp16=self.fp16)
        return StepResult(outcome, launched.lr, grad_norm, launched.loss_scale, launched.first_position,
                          launched.samples, step_s, launched.data_s, launched.record.launched_at, read_at)

    def _forward_backward(self, batches: list[Batch], step: int) -> torch.Tensor:
        stats = torch.zeros(len(STATS), dtype=torch.float64, device=self.device)
        self.runner.begin_step(len(batches))
        for i, batch in enumerate(batches):
            # The boundary is the step's last micro-batch, said to the engine: its own count of
            # micro-steps modulo the accumulation steps misplaces it once those have changed
            # (a batch-size warm-up)
            self.engine.set_gradient_accumulation_boundary(i + 1 == len(batches))
            with stage("forward"):
                batch = to_device(batch, self.device, non_blocking=True)
                out = forward(self.runner, batch)
                loss = self.faults.loss(out.loss, self.rank, step)
            with stage("backward"):
                self.runner.backward(loss)
            with stage("batch_stats"):
                stats += batch_stats(out, batch, loss, self.window)
            if i + 1 < len(batches):
                with stage("micro_step"):
                    self.engine.step()  # inside the accumulation window DeepSpeed only counts micro-steps
        return stats

    def _gradients(self) -> list[torch.Tensor] | None:
        """The gradients the step checks, measures and clips; None where DeepSpeed does."""
        if not self.owns_gradients:
            return None
        if self.plain_optimizer:
            return [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return zero.partition_gradients(self.engine)

    def _decide_on_device(self, sums: torch.Tensor, grads: list[torch.Tensor]) -> None:
        """From the all-reduced ``sums``, on the device: the optimizer's skip flag (a non-finite
        loss or gradient anywhere) and the clipping of ``grads``."""
        bad = (sums[AT["nonfinite_loss"]] + sums[AT["nonfinite_grad"]]) > 0
        device_skip.skip_next_step_if(self.optimizer, bad.to(torch.float32))
        if self.grad_clip > 0:
            square = sums[AT["grad_sq"]] / (dist.get_world_size() if self.plain_optimizer else 1)
            clip_gradients(grads, square.sqrt(), self.grad_clip)


def _number(x) -> float | None:
    return None if x is None else float(x)


def clip_gradients(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place so that their global ``norm`` (a device scalar) is at most
    ``max_norm``: DeepSpeed's rule, the factor ``max_norm / (norm + 1e-6)`` where below 1,
    computed on the device (a factor of 1 leaves the gradients bitwise as they were). A
    non-finite norm makes the factor NaN: the step is skipped then, its gradients unused.
    bf16 gradients are scaled in bf16 (DeepSpeed scales their fp32 copy): one more rounding,
    of 2^-8 relative, of gradients that were accumulated and reduced in bf16 already."""
    if max_norm > 0 and grads:
        factor = (max_norm / (norm + 1e-6)).clamp(max=1.0).to(torch.float32)
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
