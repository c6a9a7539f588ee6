"""The training loop: open the data, build the engine, resume, then per step: launch it, read
and log the step before it, maybe validate, save. Each of these is one call here; what it does
lives in its own module (:mod:`.step`, :mod:`.validation`, :mod:`.checkpointer`,
:mod:`.summary`, :mod:`.session`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bert_ds import zero
from bert_ds.checkpoint import hf_import
from bert_ds.checkpoint import resume as resuming
from bert_ds.checkpoint import store as checkpoint
from bert_ds.base.errors import ConfigError
from bert_ds.config import (BatchPlan, TrainConfig, deepspeed_config, engine_json, precision_of, runs_bf16_copy,
                             step_owns_gradients)
from bert_ds.loader.pretraining import PretrainingDataset, PretrainingLoader, open_pretraining_data
from bert_ds.model.build import PretrainingModel, build_model
from bert_ds.model.flops import datasheet_peak_tflops, training_flops
from bert_ds.optim.builders import bind_to_engine, build_optimizer, build_schedule
from bert_ds.train.bf16_copy import Bf16Copy, EngineRunner
from bert_ds.train.checkpointer import Checkpointer
from bert_ds.train.faults import NO_FAULTS, Faults
from bert_ds.train.kernel_record import record_kernels
from bert_ds.train.metrics import MetricsLogger
from bert_ds.train.profiling import StepProfiler
from bert_ds.train.step_range import StepRange
from bert_ds.train.sample_log import SampleLog
from bert_ds.train.session import peer_failures, pid_file
from bert_ds.train.signals import StopRequest
from bert_ds.train.step import LaunchedStep, RunState, StepResult, TrainStep, check_bad_streak, ratio
from bert_ds.train.summary import Progress
from bert_ds.train.validation import validate


@dataclass(frozen=True)
class RunOptions:
    """Per-invocation options that are not part of the training recipe (not checkpointed)."""

    log_samples: str | None = None  # --log-samples
    faults: Faults = NO_FAULTS  # test hooks (bert_ds.train.faults)
    profile: StepRange | None = None  # --profile-steps


def run(cfg: TrainConfig, resume: bool, rank: int, world: int, device: torch.device,
        options: RunOptions = RunOptions(), stop: StopRequest | None = None) -> dict[str, Any]:
    """Train ``cfg`` on this rank (collective: every rank calls it alike); the run's summary.
    ``resume``: continue from OUTPUT/checkpoints if it holds one."""
    stop = stop if stop is not None else StopRequest(deadline_s=0, rank=rank)  # never signalled
    start = _start(cfg, resume, rank, world, device)  # open the data, build the engine, resume
    state, engine, loader = start.state, start.engine, start.loader
    log = MetricsLogger(Path(cfg.output), enabled=rank == 0, total_steps=cfg.steps, start_step=state.step,
                        tensorboard=cfg.tensorboard, progress=cfg.progress)
    _announce(log, cfg, start, rank, world, device)
    record_kernels(log, start.engine.module, Path(cfg.output), rank)  # OUTPUT/kernels.json
    progress = Progress()
    checkpointer = Checkpointer.for_run(cfg, engine, loader, rank, saved_at=state.step if start.found else None)
    train_step = TrainStep(engine, start.optimizer, loader, device, rank, stop,
                           fp16=start.precision == "fp16", faults=options.faults, grad_clip=cfg.optim.grad_clip,
                           owns_gradients=step_owns_gradients(start.ds_cfg), runner=start.runner)
    step_log = _StepLog(log, progress, cfg, loader, rank, world, device, options.log_samples)
    validation = _Validation(start.runner, start.val_set, cfg, rank, world, device, stop, log, progress)
    profiler = StepProfiler(options.profile, Path(cfg.output), device, rank)
    launched = state.step  # the newest step whose work is queued; state.step: the newest one read
    try:
        with pid_file(Path(cfg.output), rank), peer_failures(rank, world, cfg.collective_timeout, lambda: launched):
            last_step = min(cfg.steps, state.step + cfg.exit_after) if cfg.exit_after else cfg.steps
            stop.begin_steps()
            pending: LaunchedStep | None = None  # launched, not yet read

            def finish(step: LaunchedStep, next_step: LaunchedStep | None = None) -> int:
                """Read and log ``step`` (``next_step``: the one launched after it, if any); its stop votes."""
                result = train_step.finish(step, state)
                step_log.write(result, state, next_step.record.launched_at if next_step is not None else None)
                check_bad_streak(state, cfg.max_bad_steps, checkpointer.newest)
                return result.outcome.stop_votes

            while launched < last_step:
                launched += 1
                profiler.before(launched)
                current = train_step.launch(launched)
                _profiled(log, profiler.after(launched))
                # Each step is read after the next one is queued, so that the GPU works while the
                # host reads; a step that a checkpoint, validation or the run's end needs is read
                # at once. The same on every rank: the boundaries depend on the step number alone.
                boundary = launched == last_step or validation.due(launched) or checkpointer.due(launched)
                ready = [step for step in (pending, current if boundary else None) if step is not None]
                pending = None if boundary else current
                votes = max((finish(step, current if step is not current else None) for step in ready), default=0)
                if votes:
                    if pending is not None:  # launched before the votes were read: it runs to its end
                        finish(pending)
                        pending = None
                    stop.acknowledge()
                    progress.stopped_by = _stopping(log, stop, state, f"{votes} rank(s)")
                    break
                if not boundary:
                    continue
                if validation.due(state.step) and not validation.run(state):
                    break
                if checkpointer.save(state) and stop.agreed(device):  # a signal during the save
                    progress.stopped_by = _stopping(log, stop, state, "after this step's save")
                    break
            stop.end_steps()
            _profiled(log, profiler.close())
            if validation.due_at_end(state.step):
                validation.run(state)
            final = checkpointer.save(state, last=True)
    finally:
        stop.end_steps()
        profiler.discard()  # after an error: the profiler stops, nothing is written
        log.close()
        step_log.close()
    summary = progress.summary(state, final, checkpointer.last_save_s)
    if rank == 0:
        (Path(cfg.output) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def batch_plan(cfg: TrainConfig, world: int, found: Path | None) -> BatchPlan:
    """The batch split for ``world`` ranks; a resume that cannot keep the checkpoint's global
    batch (and so its sample order) on this world size says so."""
    try:
        return BatchPlan.resolve(cfg.global_batch_size, cfg.micro_batch_size, world, cfg.batch_warmup_steps,
                                 cfg.batch_warmup_start)
    except ConfigError as e:
        if found is None:
            raise
        saved_world = checkpoint.read_train_state(found).get("world_size")
        gbs = cfg.global_batch_size
        fix = (f"a global batch of {gbs} cannot be split over {world} ranks; resume on a world size that divides it"
               if gbs % world else f"keep --global-batch-size {gbs} and pick a --micro-batch-size that divides {gbs // world}")
        raise ConfigError(f"cannot resume {found} (saved on {saved_world} rank(s)) on {world} rank(s): {e}; {fix}") from None


@dataclass
class _Start:
    """Everything a run has before its first step."""

    found: Path | None  # the checkpoint resumed from
    changes: list  # recipe changes against it (bert_ds.checkpoint.resume)
    plan: BatchPlan
    ds_cfg: dict[str, Any]
    val_set: PretrainingDataset | None
    engine: Any
    runner: EngineRunner | Bf16Copy  # runs the micro-batches: the engine, or a bf16 copy of its module
    optimizer: torch.optim.Optimizer  # the one handed to DeepSpeed
    n_params: int
    state: RunState
    notes: list[str]  # what the restore did, for the log
    loader: PretrainingLoader
    samples_per_epoch: int

    @property
    def precision(self) -> str:
        return precision_of(self.ds_cfg)


def _start(cfg: TrainConfig, resume: bool, rank: int, world: int, device: torch.device) -> _Start:
    """Find and check the checkpoint to resume, open the data, build the engine, restore."""
    ckpt_root = checkpoint.run_checkpoints(cfg.output)
    found = checkpoint.find_latest(ckpt_root) if resume else None
    if resume and rank == 0:
        resuming.report_incomplete(ckpt_root)
    if found is not None:
        resuming.verify_newest(found)  # a damaged checkpoint fails here, before any engine is built
    changes = resuming.changes(found, cfg, world) if found is not None else []
    plan = batch_plan(cfg, world, found)
    ds_cfg = deepspeed_config(cfg, plan)
    torch.manual_seed(cfg.seed)
    train_set, val_set = open_pretraining_data(cfg.data, cfg.seed)
    engine, optimizer, n_params = _build_engine(cfg, ds_cfg, device)
    state, notes = _restore(engine, cfg, found, rank, world)
    runner = (Bf16Copy(engine, lambda: _model(cfg, device), plan.grad_accum, ds_cfg.get("communication_data_type"))
              if runs_bf16_copy(ds_cfg) else EngineRunner(engine))
    loader = PretrainingLoader(train_set, plan, rank, num_workers=cfg.data.num_workers,
                               pin_memory=device.type == "cuda")
    if state.loader:
        loader.load_state_dict(state.loader)
    return _Start(found, changes, plan, ds_cfg, val_set, engine, runner, optimizer, n_params, state, notes, loader,
                  train_set.num_samples)


def _model(cfg: TrainConfig, device: torch.device) -> PretrainingModel:
    return build_model(cfg.model, train_seq_len=cfg.data.max_seq_length).to(device)


def _build_engine(cfg: TrainConfig, ds_cfg: dict[str, Any], device: torch.device):
    """The DeepSpeed engine, the optimizer handed to it, and the model's parameter count."""
    model = _model(cfg, device)
    optimizer = build_optimizer(model, cfg.optim, kernels=cfg.model.kernels, shapes=model.op_shapes)
    engine, _, _, _ = zero.initialize(
        model=model, optimizer=optimizer, config=engine_json(ds_cfg),
        lr_scheduler=lambda opt: build_schedule(opt, cfg.optim, cfg.steps),
    )
    bind_to_engine(optimizer, engine)
    return engine, optimizer, sum(p.numel() for p in model.parameters())


def _restore(engine, cfg: TrainConfig, found: Path | None, rank: int, world: int) -> tuple[RunState, list[str]]:
    """The checkpoint's state loaded into the engine (or --init-from's weights); notes for the log."""
    if found is None:
        return RunState(world_size=world), hf_import.init_weights(engine, Path(cfg.init_from)) if cfg.init_from else []
    saved = checkpoint.load(engine, found, rank=rank, world_size=world, verified=True)
    notes = []
    if saved.get("world_size") != world:
        notes.append(f"{found.name} was saved on {saved.get('world_size')} rank(s): restored from its full "
                     f"weights and optimizer state onto {world}")
    return RunState(**{**saved, "world_size": world}), notes


def _announce(log: MetricsLogger, cfg: TrainConfig, start: _Start, rank: int, world: int,
              device: torch.device) -> None:
    """The start-up lines; rank 0 records the recipe (and a resume's changes) in OUTPUT."""
    for note in start.notes:
        log.print(note)
    plan, found, output = start.plan, start.found, Path(cfg.output)
    log.print(f"{'resuming from ' + str(found) if found else 'starting'}: model {start.n_params / 1e6:.1f}M params, "
              f"{start.samples_per_epoch} samples/epoch, batch {plan.describe()}, {start.precision}, "
              f"ZeRO-{start.ds_cfg['zero_optimization']['stage']}, device {device.type}")
    output.mkdir(parents=True, exist_ok=True)
    if start.changes:
        log.print(f"resuming with changes: {resuming.describe(start.changes)} (recorded in {resuming.LOG_NAME})")
    if rank == 0:
        if found is not None:
            resuming.record(output, found, start.state.step, start.changes)
        (output / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))


def _profiled(log: MetricsLogger, written: Path | None) -> None:
    if written is not None:
        log.print(f"profile written: {written} (and its .json, .trace.json.gz)")


def _stopping(log: MetricsLogger, stop: StopRequest, state: RunState, where: str) -> str:
    """Every rank agreed to stop: say so (rank 0) and name the cause for the summary."""
    name = stop.signal_name or "a signal to another rank"
    log.print(f"stop requested ({name}, {where}): checkpointing step {state.step} and exiting")
    return name


class _StepLog:
    """Each step's record (metrics.jsonl, TensorBoard, progress bar), the --log-samples line,
    a note on a bad step, and the summary's running figures."""

    def __init__(self, log: MetricsLogger, progress: Progress, cfg: TrainConfig, loader: PretrainingLoader, rank: int,
                 world: int, device: torch.device, log_samples: str | None):
        self.log, self.progress, self.cfg, self.loader = log, progress, cfg, loader
        self.rank, self.world, self.device = rank, world, device
        self.peak = datasheet_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.samples = SampleLog(Path(log_samples)) if log_samples else None

    def write(self, result: StepResult, state: RunState, next_launch: float | None) -> None:
        """Two clocks. The host's, ``wall_time_s``: from the step's launch to the next step's
        launch where that came before this step was read (the run's period: the next step is
        queued while this one runs), else to the step's read; over a run of steps these add up
        to the time from the first one's launch to the last one's read, what the run takes for
        them, with validation passes and checkpoints (between a read and the next launch) left
        out. The device's, ``step_time_s``: the span of the step's work (CUDA events; on a CPU
        the launch's own time). ``tokens_per_s`` and ``mfu`` are by the host's clock,
        ``*_device`` by the device's."""
        s, step_s = result.outcome.sums, result.step_s
        wall_s = (next_launch if next_launch is not None else result.read_at) - result.launched_at
        record = {
            "step": state.step, "loss": result.outcome.loss, "mlm_acc": ratio(s["mlm_correct"], s["mlm_count"]),
            "nsp_acc": ratio(s["nsp_correct"], s["nsp_count"]), "lr": result.lr,
            "grad_norm": _float(result.grad_norm), "loss_scale": result.loss_scale,
            "skipped_steps": state.skipped_steps, "tokens": state.tokens, "samples": result.samples,
            "tokens_per_s": s["tokens"] / wall_s, "tokens_per_s_device": s["tokens"] / step_s,
            "wall_time_s": wall_s, "step_time_s": step_s, "data_wait_s": result.data_s,
        }
        peak_s = None  # the step's work in seconds of the devices' datasheet peak
        if self.peak is not None:
            flops = training_flops(self.cfg.model, int(s["tokens"]), int(s["sum_sq_len"]), int(s["mlm_count"]),
                                   int(s["local_pairs"]))
            peak_s = flops / (self.peak * 1e12 * self.world)
            record["mfu"], record["mfu_device"] = peak_s / wall_s, peak_s / step_s
            record["max_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.log.log_step(record)
        if self.samples is not None:
            self.samples.write(state.step, self.rank, self.loader.step_positions(state.step, result.first_position))
        if result.outcome.bad:
            self.log.print(f"step {state.step}: non-finite loss or gradient, update skipped "
                           f"({state.bad_streak} in a row, {state.skipped_steps} skipped in all)")
        else:
            self.progress.add_step(record, s["tokens"], peak_s)

    def close(self) -> None:
        if self.samples is not None:
            self.samples.close()


def _float(x: Any) -> float:
    return float("nan") if x is None else float(x)


class _Validation:
    """When the held-out passes run, and their record (metrics.jsonl, the summary)."""

    def __init__(self, model, val_set: PretrainingDataset | None, cfg: TrainConfig, rank: int, world: int,
                 device: torch.device, stop: StopRequest, log: MetricsLogger, progress: Progress):
        self.model, self.val_set, self.cfg, self.rank, self.world = model, val_set, cfg, rank, world
        self.device, self.stop, self.log, self.progress = device, stop, log, progress

    def due(self, step: int) -> bool:
        """Every --val-every steps (0: only at the end), when there is held-out data."""
        return self.val_set is not None and bool(self.cfg.val_every) and step % self.cfg.val_every == 0

    def due_at_end(self, step: int) -> bool:
        """After the last step of the run (not of an --exit-after part, not after a stop), unless
        the pass on schedule just ran."""
        return (self.val_set is not None and step == self.cfg.steps and self.progress.stopped_by is None
                and not self.due(step))

    def run(self, state: RunState) -> bool:
        """A pass at this step, logged; False when a stop signal abandoned it."""
        result = validate(self.model, self.val_set, self.cfg, self.rank, self.world, self.device, self.stop)
        if result is None:
            self.progress.stopped_by = _stopping(self.log, self.stop, state, "during validation, pass abandoned")
            return False
        self.progress.val = result
        self.log.log_val({"step": state.step, **result})
        return True
