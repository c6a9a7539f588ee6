"""Pretrain BERT (MLM + NSP) from token shards through the DeepSpeed engine.

Runs as one process (``python -m bert_ds.train``), under ``torchrun``, or under the
``deepspeed`` launcher; the process group comes from the launcher's environment,
or is a group of one when there is none. On a machine without CUDA it uses the
CPU accelerator and gloo.

Every run appends to ``OUTPUT/metrics.jsonl`` (one object per optimizer step:
step, loss, mlm_acc, nsp_acc, lr, grad_norm, loss_scale, skipped_steps, tokens
(real, cumulative), tokens_per_s, step_time_s, and mfu on GPUs), writes
TensorBoard events to ``OUTPUT/tensorboard``, checkpoints to
``OUTPUT/checkpoints`` and a closing ``OUTPUT/summary.json``. A run whose output
folder holds a checkpoint resumes from it (``--resume never`` starts afresh), on the
same or on another number of ranks.

Faults (the R-numbers of the README's reliability promises) and what the run does about them:
- SIGINT (Ctrl-C), SIGTERM or SIGUSR1 to any rank: all ranks learn of it through the
  step's one all-reduce, commit a checkpoint after that step and exit 0; during a
  validation pass or a periodic save, the pass is abandoned and the last finished step is
  saved, without training another (``bert_ds.train.signals``). A second Ctrl-C ends the process
  at once (exit 130; the newest committed checkpoint stays). Each rank writes its pid to
  ``OUTPUT/pids/rank_N.pid`` while it runs. Before the first step there is nothing to
  save: the process exits at once with 128 + the signal number.
- A second run into the same OUTPUT while one runs: refused in one line naming the holder
  (exit 2); the lock goes with the process that held it, however it ended (R17).
- DeepSpeed's extension build lock left by a killed start is removed with a note; one a
  live process holds is waited on for at most ``BERT_DS_BUILD_LOCK_TIMEOUT`` seconds
  (``bert_ds.train.extensions``).
- A non-finite loss or gradient on any rank: the optimizer step is skipped (no update,
  counted in ``skipped_steps``); ``--max-bad-steps`` such steps in a row stop the run
  without checkpointing them. fp16 loss-scale overflows are skipped and counted too,
  but are the loss scaler's business, not a bad streak.
- A rank that hangs or dies: the others fail after ``--collective-timeout`` seconds and
  name the ranks that did not report back.

Exit status: 0 finished, or stopped by a signal after a checkpoint; 1 a bug (traceback);
2 bad input, a damaged checkpoint or an OUTPUT in use (one ``error:`` line); 3
``--max-bad-steps`` non-finite steps in a row; 4 a rank failed or hung; 128 + N stopped
by signal N before the first step (nothing saved); 130 a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bert_ds.checkpoint import store as checkpoint
from bert_ds.checkpoint import hf_import
from bert_ds.checkpoint import resume as resuming
from bert_ds.config import (BatchPlan, DataConfig, OptimConfig, TrainConfig, check_writable, deepspeed_config,
                            precision_of)
from bert_ds.loader.pretraining import (Batch, PretrainingDataset, PretrainingLoader, open_pretraining_data, step_positions,
                          to_device, validation_batches)
from bert_ds.base.errors import ConfigError
from bert_ds.model.flops import datasheet_peak_tflops, training_flops
from bert_ds.train.metrics import MetricsLogger
from bert_ds.model.bert import PRESETS, BertForPreTraining, ModelConfig, model_preset, pretraining_inputs
from bert_ds.optim.builders import bind_to_engine, build_optimizer, build_schedule
from bert_ds.train.signals import EXIT_RANK_FAILURE, StopRequest
from bert_ds.base.errors import EXIT_USER_ERROR, UserError
from bert_ds.base.locking import FolderLock
EXIT_BAD_STEPS = 3
DEFAULT_PRESET = "mini"  # without --preset and without a checkpoint to resume


class BadStepsError(Exception):
    """--max-bad-steps non-finite steps in a row: the run stops (exit 3) without checkpointing them."""


class RankFailure(Exception):
    """A collective failed because a rank hung or died (exit 4)."""


class _Defaults:
    """A dataclass's field defaults as attributes, without building (and validating) one."""

    def __init__(self, cls: type):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                setattr(self, f.name, f.default)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bert_ds.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d, o, t = _Defaults(DataConfig), _Defaults(OptimConfig), _Defaults(TrainConfig)
    p.add_argument("--data", required=True, nargs="+", help="training dataset folder(s) (from `data_tools build`)")
    p.add_argument("--data-weights", type=float, nargs="+", default=None, help="blend weights of several --data folders")
    p.add_argument("--val-data", default=None, help="held-out dataset folder built with the same vocabulary")
    p.add_argument("--held-out", type=float, default=d.held_out,
                   help="without --val-data: share of the first dataset's documents held out for validation")
    p.add_argument("--whole-word-mask", action="store_true", help="mask every WordPiece of a chosen word")
    p.add_argument("--output", default="runs/train", help="run folder: metrics, TensorBoard, checkpoints")
    p.add_argument("--preset", default=None,
                   help=f"model size: {', '.join(PRESETS)} (default: the checkpoint's model when resuming, "
                        f"else {DEFAULT_PRESET})")
    p.add_argument("--kernels", default="auto", choices=["auto", "cuda", "torch"], help="fused CUDA kernels or the PyTorch path")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute layer activations in backward")
    p.add_argument("--dropout", type=float, default=None,
                   help="hidden dropout (default: the model's 0.1); 0 makes a world-size change exact, see R8")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--global-batch-size", type=int, default=32, help="sequences per optimizer step, all ranks")
    p.add_argument("--micro-batch-size", type=int, default=32, help="sequences per forward pass per rank")
    p.add_argument("--seq-len", type=int, default=d.max_seq_length, help="maximum tokens per sample")
    p.add_argument("--pair-task", default=d.pair_task, choices=["nsp", "sop", "none"], help="sentence-pair task")
    p.add_argument("--mask-rate", type=float, default=d.mask_rate, help="share of tokens predicted by the MLM head")
    p.add_argument("--num-workers", type=int, default=d.num_workers, help="loader processes per rank")
    p.add_argument("--val-samples", type=int, default=d.val_samples, help="held-out samples per validation pass")
    p.add_argument("--optimizer", default=o.name, choices=["lamb", "adamw"], help="optimizer")
    p.add_argument("--lamb-variant", default=o.lamb_variant, choices=["nvidia", "paper"],
                   help="LAMB's trust ratio: nvidia (only where weight decay is non-zero, NVIDIA's BERT recipe) "
                        "or paper (every tensor)")
    p.add_argument("--lr", type=float, default=o.lr, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=o.weight_decay, help="decoupled weight decay")
    p.add_argument("--warmup-steps", type=int, default=o.warmup_steps, help="linear warm-up steps")
    p.add_argument("--decay", default=o.decay, choices=["linear", "poly", "constant"], help="decay after warm-up")
    p.add_argument("--grad-clip", type=float, default=o.grad_clip, help="global gradient-norm clip (0: off)")
    p.add_argument("--ds-config", default="zero1_bf16.json", help="engine JSON: a file in ds_configs/ or a path")
    p.add_argument("--seed", type=int, default=1234, help="seed of weights, samples, masks and dropout")
    p.add_argument("--val-every", type=int, default=0, help="steps between validation passes (0: at the end)")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints kept")
    p.add_argument("--exit-after", type=int, default=0,
                   help="save a checkpoint and exit after this many steps of this invocation (time-limited jobs); 0: off")
    p.add_argument("--resume", default="auto", choices=["auto", "never"], help="resume from OUTPUT/checkpoints if present")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start a fresh run from these weights: a Hugging Face BERT folder (config.json and "
                        "model.safetensors or pytorch_model.bin), a bert_ds export, checkpoint or run folder, or a "
                        "model.safetensors; without --preset the model's sizes come from it; optimizer and "
                        "schedule start fresh; ignored when resuming")
    p.add_argument("--max-bad-steps", type=int, default=t.max_bad_steps,
                   help="stop (exit 3) after this many non-finite steps in a row; single ones are skipped; 0: never")
    p.add_argument("--collective-timeout", type=float, default=t.collective_timeout, metavar="SECONDS",
                   help="fail (exit 4) when a rank waits this long on its peers; must exceed a checkpoint save")
    p.add_argument("--log-samples", default=None, metavar="FILE",
                   help="append the global stream positions each rank consumes at each step to FILE (JSON lines; "
                        "to check that a resume neither repeats nor skips samples, see consumed_positions())")
    g = p.add_argument_group("test hooks (fault injection; not for real runs)")
    g.add_argument("--debug-inject-nan-at", default="", metavar="STEP[,STEP...]",
                   help="make rank 0's loss NaN at these steps")
    g.add_argument("--debug-hang-at", default=None, metavar="RANK:STEP",
                   help="make RANK hang forever when it starts STEP")
    p.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard events")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p.parse_args(argv)


def model_from_args(args: argparse.Namespace, vocab_size: int, saved_model: dict[str, Any] | None,
                    init: hf_import.InitSource | None = None) -> ModelConfig:
    """The model a run asks for. Resuming (``saved_model``: the checkpoint's), every field not
    given on the command line stays as saved, the preset's sizes included when --preset is
    absent; a different size or vocabulary (which comes from the data) is then a refused
    change (bert_ds.checkpoint.resume), not a silent one. Starting from ``init`` (--init-from), the
    architecture is the source's (bert_ds.checkpoint.hf_import)."""
    given = dict(vocab_size=vocab_size, kernels=args.kernels, activation_checkpointing=args.activation_checkpointing)
    if args.dropout is not None:
        given["hidden_dropout"] = args.dropout
    if saved_model is None and init is not None and init.model is not None:
        return hf_import.model_config(init, args.preset, given)
    if saved_model is None:
        return model_preset(args.preset or DEFAULT_PRESET, **given)
    if args.preset is None:
        return ModelConfig.from_dict({**saved_model, **given})
    kept = {k: v for k, v in saved_model.items() if k not in PRESETS.get(args.preset, {})}
    return model_preset(args.preset, **{**kept, **given})


def config_from_args(args: argparse.Namespace, vocab_size: int, saved_model: dict[str, Any] | None = None,
                     init: hf_import.InitSource | None = None) -> TrainConfig:
    model = model_from_args(args, vocab_size, saved_model, init)
    data = DataConfig(train=args.data, weights=args.data_weights, val=args.val_data, held_out=args.held_out,
                      whole_word_mask=args.whole_word_mask, max_seq_length=args.seq_len, pair_task=args.pair_task,
                      mask_rate=args.mask_rate, num_workers=args.num_workers, val_samples=args.val_samples)
    optim = OptimConfig(name=args.optimizer, lamb_variant=args.lamb_variant, lr=args.lr, weight_decay=args.weight_decay,
                        warmup_steps=args.warmup_steps, decay=args.decay, grad_clip=args.grad_clip)
    return TrainConfig(model=model, data=data, optim=optim, output=args.output, steps=args.steps,
                       global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                       ds_config=args.ds_config, seed=args.seed, val_every=args.val_every,
                       save_every=args.save_every, keep_last=args.keep_last, exit_after=args.exit_after,
                       init_from=args.init_from, max_bad_steps=args.max_bad_steps,
                       collective_timeout=args.collective_timeout,
                       tensorboard=not args.no_tensorboard, progress=not args.no_progress)


@dataclass(frozen=True)
class RunOptions:
    """Per-invocation options that are not part of the training recipe (not checkpointed)."""

    log_samples: str | None = None  # --log-samples
    nan_at: frozenset[int] = frozenset()  # test hook: steps whose loss is NaN on rank 0
    hang_at: tuple[int, int] | None = None  # test hook: (rank, step) that hangs

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RunOptions":
        try:
            nan_at = frozenset(int(x) for x in args.debug_inject_nan_at.split(",") if x.strip())
            hang_at = tuple(int(x) for x in args.debug_hang_at.split(":")) if args.debug_hang_at else None
        except ValueError:
            raise ConfigError("--debug-inject-nan-at takes STEP[,STEP...] and --debug-hang-at RANK:STEP") from None
        if hang_at is not None and len(hang_at) != 2:
            raise ConfigError(f"--debug-hang-at takes RANK:STEP, got {args.debug_hang_at!r}")
        return cls(args.log_samples, nan_at, hang_at)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Join the launcher's process group, or form a group of one. Every collective, the
    start-up rendezvous included, fails after ``timeout_s`` instead of waiting forever."""
    from bert_ds.train import extensions

    extensions.use_environment_cache()  # before DeepSpeed builds its communication op
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    cuda = torch.cuda.is_available()
    timeout = timedelta(seconds=timeout_s)
    with extensions.bounded_build_locks():  # the JIT build's lock: stale removed, live waited on (bounded)
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", timeout=timeout)
    # DeepSpeed runs ZeRO's collectives on a clone of the world group that it makes with
    # torch's default timeout (30 min), not the one above; make that clone ourselves, first.
    from deepspeed.utils import groups

    if groups._WORLD_GROUP is None:
        groups._WORLD_GROUP = dist.new_group(ranks=range(dist.get_world_size()), timeout=timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


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
_STATS = ("loss_sum", "micro_batches", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "tokens",
          "sum_sq_len", "nonfinite_loss", "nonfinite_grad", "stop")
_AT = {name: i for i, name in enumerate(_STATS)}


def _batch_stats(out, batch: Batch, loss: torch.Tensor) -> torch.Tensor:
    """The _STATS of one micro-batch, on the batch's device (no host sync)."""
    lengths = batch["attention_mask"].sum(dim=1).double()
    nsp = (out.nsp_correct, out.nsp_count) if out.nsp_count is not None else (0, 0)  # --pair-task none
    loss = loss.detach()
    parts = [loss, 1, out.mlm_correct, out.mlm_count, *nsp, lengths.sum(), (lengths ** 2).sum(),
             ~torch.isfinite(loss), 0, 0]
    return torch.stack([torch.as_tensor(x, device=lengths.device).double() for x in parts])


def _nonfinite_grads(module: torch.nn.Module) -> torch.Tensor:
    """1.0 if any gradient holds an inf or NaN (ZeRO-0: gradients are already all-reduced, so
    every rank gets the same answer), without a host sync."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return (~torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())).double()


def _all_reduce(t: torch.Tensor) -> list[float]:
    """Sum across ranks (gloo reduces CPU tensors, NCCL device tensors) and bring to the host."""
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.cpu().tolist()


def _forward(engine, batch: Batch):
    return engine(**pretraining_inputs(batch))


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# Validation batches between two checks that no rank was asked to stop: a signal during a
# pass ends it within this many forward passes (a fraction of a second on the tiny preset).
VAL_STOP_CHECK_EVERY = 4


def validate(engine, dataset: PretrainingDataset, cfg: TrainConfig, rank: int, world: int,
             device: torch.device, stop: StopRequest) -> dict[str, float] | None:
    """The held-out metrics, or None when a stop was requested on any rank during the pass
    (the pass is abandoned; every rank returns None at the same batch)."""
    engine.eval()
    totals = torch.zeros(len(_STATS) + 1, dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            batches = validation_batches(dataset, cfg.data.val_samples, cfg.micro_batch_size, rank, world)
            for i, batch in enumerate(batches):
                if i % VAL_STOP_CHECK_EVERY == 0 and stop.agreed(device):
                    return None
                batch = to_device(batch, device, non_blocking=True)
                out = _forward(engine, batch)
                mlm_loss_sum = out.mlm_loss.detach().double() * out.mlm_count
                totals += torch.cat([_batch_stats(out, batch, out.loss), mlm_loss_sum.reshape(1)])
    finally:
        engine.train()
    totals[_AT["stop"]] = float(stop.requested)  # a signal after the last check: the closing all-reduce tells
    *sums, mlm_loss_sum = _all_reduce(totals)
    s = dict(zip(_STATS, sums))
    if s["stop"] > 0:
        stop.acknowledge()
        return None
    return {"loss": _ratio(s["loss_sum"], s["micro_batches"]),
            "mlm_loss": _ratio(mlm_loss_sum, s["mlm_count"]),
            "mlm_acc": _ratio(s["mlm_correct"], s["mlm_count"]),
            "nsp_acc": _ratio(s["nsp_correct"], s["nsp_count"])}


def run(cfg: TrainConfig, resume: bool, rank: int, world: int, device: torch.device,
        options: RunOptions = RunOptions(), stop: StopRequest | None = None) -> dict[str, Any]:
    import deepspeed

    output = Path(cfg.output)
    ckpt_root = output / "checkpoints"
    found = checkpoint.find_latest(ckpt_root) if resume else None
    if resume and rank == 0:
        resuming.report_incomplete(ckpt_root)
    if found is not None:
        resuming.verify_newest(found)  # a damaged checkpoint fails here, before any engine is built
    recipe_changes = resuming.changes(found, cfg, world) if found is not None else []
    plan = _batch_plan(cfg, world, found)
    ds_cfg = deepspeed_config(cfg, plan)
    torch.manual_seed(cfg.seed)
    train_set, val_set = open_pretraining_data(cfg.data, cfg.seed)
    stop = stop if stop is not None else StopRequest(deadline_s=0, rank=rank)  # never signalled

    model = BertForPreTraining(cfg.model).to(device)
    optimizer = build_optimizer(model, cfg.optim)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_cfg,
        lr_scheduler=lambda opt: build_schedule(opt, cfg.optim, cfg.steps),
    )
    bind_to_engine(optimizer, engine)
    # ZeRO-0 in fp32 steps our optimizer directly and DeepSpeed never checks the gradients (we
    # do, and skip); under any DeepSpeed wrapper, a non-finite gradient norm makes DeepSpeed skip.
    plain_optimizer = engine.optimizer is optimizer
    precision = precision_of(ds_cfg)
    state = RunState(world_size=world)
    notes = []
    if found is not None:
        saved = checkpoint.load(engine, found, rank=rank, world_size=world, verified=True)
        if saved.get("world_size") != world:
            notes.append(f"{found.name} was saved on {saved.get('world_size')} rank(s): restored from its full "
                         f"weights and optimizer state onto {world}")
        state = RunState(**{**saved, "world_size": world})
    elif cfg.init_from:
        notes += hf_import.init_weights(engine, Path(cfg.init_from))
    loader = PretrainingLoader(train_set, plan, rank, num_workers=cfg.data.num_workers,
                               pin_memory=device.type == "cuda")
    if state.loader:
        loader.load_state_dict(state.loader)

    log = MetricsLogger(output, enabled=rank == 0, total_steps=cfg.steps, start_step=state.step,
                        tensorboard=cfg.tensorboard, progress=cfg.progress)
    for note in notes:
        log.print(note)
    n_params = sum(p.numel() for p in model.parameters())
    log.print(f"{'resuming from ' + str(found) if found else 'starting'}: model {n_params / 1e6:.1f}M params, "
              f"{train_set.num_samples} samples/epoch, batch {plan.global_batch_size} = {plan.micro_batch_size} x "
              f"{plan.grad_accum} accum x {world} ranks, {precision}, ZeRO-{ds_cfg['zero_optimization']['stage']}, "
              f"device {device.type}")
    output.mkdir(parents=True, exist_ok=True)
    if recipe_changes:
        log.print(f"resuming with changes: {resuming.describe(recipe_changes)} (recorded in {resuming.LOG_NAME})")
    if rank == 0:
        if found is not None:
            resuming.record(output, found, state.step, recipe_changes)
        (output / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    peak = datasheet_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    tokenizer_dir = Path(cfg.data.train[0])  # every dataset of a run shares one tokenizer
    save_s = 0.0

    def save_now() -> Path:
        nonlocal save_s
        t = time.perf_counter()
        state.loader = loader.state_dict()
        snapshot = checkpoint.optimizer_snapshot(engine)
        path = checkpoint.save(engine, ckpt_root, state.step, rank=rank, model_config=cfg.model.to_dict(),
                               train_config=cfg.to_dict(), train_state=dataclasses.asdict(state),
                               tokenizer_dir=tokenizer_dir, keep_last=cfg.keep_last, optimizer=snapshot)
        save_s = time.perf_counter() - t
        return path

    def stopping(where: str) -> str:
        """Every rank agreed to stop: say so (rank 0) and name the cause for the summary."""
        name = stop.signal_name or "a signal to another rank"
        log.print(f"stop requested ({name}, {where}): checkpointing step {state.step} and exiting")
        return name

    def validate_now() -> bool:
        """A validation pass at this step, logged; False when a stop signal abandoned it."""
        nonlocal val, stopped_by
        result = validate(engine, val_set, cfg, rank, world, device, stop)
        if result is None:
            stopped_by = stopping("during validation, pass abandoned")
            return False
        val = result
        log.log_val({"step": state.step, **val})
        return True

    losses: list[float] = []
    rates: list[float] = []
    mfus: list[float] = []  # on GPUs (where the peak is known), one per good step
    val: dict[str, float] = {}
    stopped_by: str | None = None
    saved_at = state.step if found else -1
    sample_log = _SampleLog(Path(options.log_samples)) if options.log_samples else None
    try:
        with _pid_file(output, rank), _peer_failures(rank, world, cfg.collective_timeout, lambda: state.step + 1):
            stop_at = min(cfg.steps, state.step + cfg.exit_after) if cfg.exit_after else cfg.steps
            stop.begin_steps()
            while state.step < stop_at:
                step = state.step + 1
                if options.hang_at == (rank, step):
                    _hang_forever()
                t0 = time.perf_counter()
                first_position = loader.consumed_samples
                batches = loader.next_step()
                data_s = time.perf_counter() - t0
                stats = torch.zeros(len(_STATS), dtype=torch.float64, device=device)
                for i, batch in enumerate(batches):
                    batch = to_device(batch, device, non_blocking=True)
                    out = _forward(engine, batch)
                    loss = out.loss * float("nan") if rank == 0 and step in options.nan_at else out.loss
                    engine.backward(loss)
                    stats += _batch_stats(out, batch, loss)
                    if i + 1 < len(batches):
                        engine.step()  # inside the accumulation window DeepSpeed only counts micro-steps
                if plain_optimizer:
                    stats[_AT["nonfinite_grad"]] = _nonfinite_grads(engine.module)
                stats[_AT["stop"]] = float(stop.requested)
                s = dict(zip(_STATS, _all_reduce(stats)))  # the step's one host sync, before the update
                nonfinite = s["nonfinite_loss"] > 0 or s["nonfinite_grad"] > 0
                ds_skipped_before = engine.skipped_steps
                lr = engine.get_lr()[0]  # this step's; the scheduler moves on inside engine.step()
                with _plain_step(optimizer, skip=nonfinite) if plain_optimizer else contextlib.nullcontext():
                    engine.step()
                ds_skipped = engine.skipped_steps > ds_skipped_before
                if nonfinite and not ds_skipped:
                    raise BadStepsError(f"step {step} had a non-finite loss but DeepSpeed applied the update "
                                        "(a config with its gradient-overflow check off?); stopping without a checkpoint")
                step_s = time.perf_counter() - t0
                state.step = step
                state.tokens += int(s["tokens"])
                state.skipped_steps += int(nonfinite or ds_skipped)
                # fp16's loss scaler overflows routinely while it finds its scale: skipped, but not "bad"
                bad = nonfinite or (ds_skipped and precision != "fp16")
                state.bad_streak = state.bad_streak + 1 if bad else 0
                loss_value = _ratio(s["loss_sum"], s["micro_batches"])
                record = {
                    "step": state.step, "loss": loss_value, "mlm_acc": _ratio(s["mlm_correct"], s["mlm_count"]),
                    "nsp_acc": _ratio(s["nsp_correct"], s["nsp_count"]), "lr": lr,
                    "grad_norm": _float(engine.get_global_grad_norm()), "loss_scale": _loss_scale(engine),
                    "skipped_steps": state.skipped_steps, "tokens": state.tokens,
                    "samples": loader.consumed_samples,
                    "tokens_per_s": s["tokens"] / step_s, "step_time_s": step_s, "data_wait_s": data_s,
                }
                if peak is not None:
                    flops = training_flops(cfg.model, int(s["tokens"]), int(s["sum_sq_len"]), int(s["mlm_count"]))
                    record["mfu"] = flops / step_s / (peak * 1e12 * world)
                    record["max_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
                log.log_step(record)
                if sample_log is not None:
                    sample_log.write(step, rank, step_positions(plan, rank, first_position))
                if bad:
                    log.print(f"step {step}: non-finite loss or gradient, update skipped "
                              f"({state.bad_streak} in a row, {state.skipped_steps} skipped in all)")
                if cfg.max_bad_steps and state.bad_streak >= cfg.max_bad_steps:
                    newest = checkpoint.find_latest(ckpt_root)
                    raise BadStepsError(
                        f"{state.bad_streak} non-finite steps in a row ({step - state.bad_streak + 1}-{step}, "
                        f"--max-bad-steps {cfg.max_bad_steps}); stopping without a checkpoint of them; newest "
                        f"checkpoint: {newest if newest else 'none'}")
                if not bad:
                    losses.append(loss_value)
                    rates.append(record["tokens_per_s"])
                    if "mfu" in record:
                        mfus.append(record["mfu"])
                if s["stop"] > 0:
                    stop.acknowledge()
                    stopped_by = stopping(f"{int(s['stop'])} rank(s)")
                    break
                if val_set is not None and cfg.val_every and state.step % cfg.val_every == 0:
                    if not validate_now():
                        break
                # A step whose update was skipped is not checkpointed on schedule: the newest
                # checkpoint stays a good one while a bad streak lasts.
                if cfg.save_every and state.step % cfg.save_every == 0 and not bad:
                    save_now()
                    saved_at = state.step
                    if stop.agreed(device):  # a signal during the save: this checkpoint is the last step
                        stopped_by = stopping("after this step's save")
                        break
            stop.end_steps()
            if (val_set is not None and state.step == cfg.steps and stopped_by is None
                    and not (cfg.val_every and state.step % cfg.val_every == 0)):
                validate_now()
            final_ckpt = save_now() if saved_at != state.step else ckpt_root / checkpoint.step_dir_name(state.step)
    finally:
        stop.end_steps()
        log.close()
        if sample_log is not None:
            sample_log.close()
    summary = _summary(state, losses, rates, mfus, val, final_ckpt, stopped_by, save_s)
    if rank == 0:
        (output / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@contextlib.contextmanager
def _plain_step(optimizer: torch.optim.Optimizer, skip: bool) -> Iterator[None]:
    """Around engine.step() under ZeRO-0 in fp32, where DeepSpeed calls our optimizer directly:
    a skipped step steps it over no parameters, so weights and optimizer state stay as they
    were, and reports ``overflow`` the way DeepSpeed's own wrappers do, so that the engine
    holds the LR schedule and counts the skip. (The non-finite gradients are left for
    DeepSpeed's clipping, which needs some, and its zero_grad.)"""
    optimizer.overflow = skip
    if not skip:
        yield
        return
    held = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = []
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, held):
            group["params"] = params


def _batch_plan(cfg: TrainConfig, world: int, found: Path | None) -> BatchPlan:
    """The batch split for ``world`` ranks; a resume that cannot keep the checkpoint's global
    batch (and so its sample order) on this world size says so."""
    try:
        return BatchPlan.resolve(cfg.global_batch_size, cfg.micro_batch_size, world)
    except ConfigError as e:
        if found is None:
            raise
        saved_world = checkpoint.read_train_state(found).get("world_size")
        gbs = cfg.global_batch_size
        fix = (f"a global batch of {gbs} cannot be split over {world} ranks; resume on a world size that divides it"
               if gbs % world else f"keep --global-batch-size {gbs} and pick a --micro-batch-size that divides {gbs // world}")
        raise ConfigError(f"cannot resume {found} (saved on {saved_world} rank(s)) on {world} rank(s): {e}; {fix}") from None


def _hang_forever() -> None:
    """Test hook (--debug-hang-at): stand in for a rank stuck in I/O or a deadlock."""
    while True:
        time.sleep(3600)


@contextlib.contextmanager
def output_lock(output: str | os.PathLike, command: str) -> Iterator[None]:
    """Hold OUTPUT's folder lock (``bert_ds.base.locking``) for the run's whole life, so that a
    second run into the same folder refuses (R17) before it reads or builds anything.

    Only global rank 0 (the launcher's ``RANK``, read before the process group exists) takes
    it: the ranks of one run share the folder, on one node or, through a shared filesystem,
    on several, and must not lock each other out. A second run is therefore refused where
    its rank 0 sees the first run's folder: on the first run's rank-0 node, or anywhere on a
    shared filesystem. Its other ranks, waiting for rank 0 at the rendezvous, end when their
    launcher stops them (``torchrun``: SIGTERM, then SIGKILL 30 s later)."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    with FolderLock(output, command):
        yield


@contextlib.contextmanager
def _pid_file(output: Path, rank: int) -> Iterator[None]:
    """OUTPUT/pids/rank_N.pid while the rank trains: whom to signal for a graceful stop."""
    path = output / "pids" / f"rank_{rank}.pid"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _peer_failures(rank: int, world: int, timeout_s: float, step: Callable[[], int]) -> Iterator[None]:
    """Turn a collective that failed because a peer hung or died into a RankFailure naming the
    ranks that did not report back; other errors pass through unchanged."""
    try:
        yield
    except RuntimeError as e:
        if world == 1:
            raise
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        missing = _ranks_not_reporting(rank, world, wait_s=min(2.0, timeout_s))
        timed_out = "timed out" in first.lower() or "timeout" in first.lower()
        if not missing and not timed_out:
            raise
        who = ("could not reach the rendezvous store to tell which rank" if missing is None else
               f"rank(s) {', '.join(map(str, missing))} did not report back (hung or dead)" if missing else
               "every rank reported back")
        raise RankFailure(f"rank {rank}: a collective failed during step {step()} "
                          f"(--collective-timeout {timeout_s:g} s): {first.strip()}; {who}") from e


def _ranks_not_reporting(rank: int, world: int, wait_s: float) -> list[int] | None:
    """Check in at the launcher's store and list the ranks that do not within ``wait_s``
    (every surviving rank checks in as its collective fails); None if the store is unreachable."""
    prefix = f"bert_ds/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=wait_s))
        store.set(f"{prefix}{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world) if not store.check([f"{prefix}{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except (KeyError, ValueError, RuntimeError, OSError):
        return None


class _SampleLog:
    """--log-samples: one JSON line per rank and step, ``{"step", "rank", "positions": [[lo, hi], ...]}``
    (half-open ranges of global stream positions, one per micro-batch). All ranks append to one
    file, one write() per line, so lines never interleave."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, step: int, rank: int, micro_batches) -> None:
        ranges = [[b[0], b[-1] + 1] for b in micro_batches]
        os.write(self._fd, (json.dumps({"step": step, "rank": rank, "positions": ranges}) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def consumed_positions(path: Path) -> list[int]:
    """The global stream positions that the final model was trained on, in order, from a
    --log-samples file that may span several invocations.

    A line for a (step, rank) that is already recorded means a restart redid that step from a
    checkpoint: everything recorded from that step on belonged to the abandoned attempt and is
    dropped. A resume that repeats or skips samples shows up as duplicates or gaps in the result.
    """
    steps: dict[int, dict[int, list[list[int]]]] = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r["rank"] in steps.get(r["step"], {}):
            steps = {s: v for s, v in steps.items() if s < r["step"]}
        steps.setdefault(r["step"], {})[r["rank"]] = r["positions"]
    out: list[int] = []
    for step in sorted(steps):
        out += sorted(p for ranges in steps[step].values() for lo, hi in ranges for p in range(lo, hi))
    return out


def _float(x: Any) -> float:
    return float("nan") if x is None else float(x)


def _loss_scale(engine) -> float:
    """fp16's dynamic loss scale; bf16 and fp32 have none (1.0). DeepSpeed has no public getter."""
    opt = engine.optimizer
    scale = getattr(opt, "cur_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else 1.0


def _summary(state: RunState, losses: list[float], rates: list[float], mfus: list[float], val: dict[str, float],
             ckpt: Path, stopped_by: str | None, save_s: float) -> dict[str, Any]:
    k = max(1, min(10, len(losses) // 5))
    warm = rates[k:] or rates  # the first steps include start-up and are excluded
    warm_mfu = mfus[k:] or mfus
    return {
        "steps": state.step, "tokens": state.tokens,
        "tokens_per_s": sum(warm) / len(warm) if warm else float("nan"),
        "mfu": sum(warm_mfu) / len(warm_mfu) if warm_mfu else None,
        "loss_first": sum(losses[:k]) / k if losses else float("nan"),
        "loss_last": sum(losses[-k:]) / k if losses else float("nan"),
        "val": val, "checkpoint": str(ckpt), "skipped_steps": state.skipped_steps,
        "stopped_by": stopped_by, "last_save_s": save_s,
    }


@contextlib.contextmanager
def training_session(collective_timeout: float) -> Iterator[tuple[int, int, torch.device, StopRequest]]:
    """Stop-signal handlers and the process group, for one or more runs in this process."""
    stop = StopRequest(deadline_s=collective_timeout, rank=int(os.environ.get("RANK", "0")))
    stop.install()  # before the process group: a signal during start-up ends the process at once
    try:
        rank, world, device = init_distributed(collective_timeout)
        stop.rank = rank
        yield rank, world, device, stop
    finally:
        stop.uninstall()


def guarded(body: Callable[[], None]) -> int:
    """Run an entry point's body; map the failures users act on to one line and an exit status,
    and destroy the process group on every path."""
    try:
        body()
        return 0
    except UserError as e:
        status = EXIT_USER_ERROR
        message = str(e)
    except (BadStepsError, checkpoint.NonFiniteWeightsError) as e:
        status = EXIT_BAD_STEPS
        message = str(e)
    except RankFailure as e:
        status = EXIT_RANK_FAILURE
        message = str(e)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        # The interpreter's last garbage collection would walk every torch/DeepSpeed object
        # (2 s and more on a busy machine, after a stop signal too); everything is closed by now.
        gc.freeze()
    print(f"error: {message}", file=sys.stderr, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def body() -> None:
        # Validate everything that needs no process group first: bad input fails fast.
        from bert_ds.data_tools.manifest import Manifest

        check_writable(args.output, "--output", folder=True)  # a file, a read-only place: before anything is read
        vocab_size = Manifest.load(Path(args.data[0])).vocab_size
        found = checkpoint.find_latest(Path(args.output) / "checkpoints") if args.resume == "auto" else None
        init = hf_import.open_source(Path(args.init_from)) if args.init_from and found is None else None
        if init is not None:
            hf_import.check_vocabulary(init, Path(args.data[0]))
        cfg = config_from_args(args, vocab_size, resuming.saved_model(found) if found else None, init)
        options = RunOptions.from_args(args)
        if options.log_samples:
            check_writable(options.log_samples, "--log-samples", folder=False)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if found is not None:
            resuming.changes(found, cfg, world)  # a refused change fails here, before any rank waits on another
            done_at = resuming.finished(found, cfg)
            if done_at is not None:
                resuming.verify_newest(found)  # "finished" must not hide a damaged final checkpoint
                if os.environ.get("RANK", "0") == "0":
                    kept = ("summary.json left as it was" if (Path(cfg.output) / "summary.json").is_file()
                            else "no summary.json: the run ended after its last checkpoint")
                    print(f"{cfg.output}: finished at step {done_at} (--steps {cfg.steps}), nothing to do; {kept}; "
                          "a larger --steps trains on", flush=True)
                return
        plan = _batch_plan(cfg, world, found)  # before any rank waits on another
        deepspeed_config(cfg, plan)  # an engine JSON that DeepSpeed would refuse after start-up fails here
        # Every input is checked before the lock, which creates OUTPUT: a refused command
        # leaves no folder behind. run() finds the checkpoint to resume again, under the lock.
        with output_lock(cfg.output, "bert_ds.train"), \
                training_session(cfg.collective_timeout) as (rank, world, device, stop):
            summary = run(cfg, args.resume == "auto", rank, world, device, options, stop)
            if rank == 0:
                _print_summary(summary)

    return guarded(body)


def _print_summary(s: dict[str, Any]) -> None:
    val = s["val"]
    lines = [
        f"steps            {s['steps']}",
        f"real tokens      {s['tokens']:,}",
        f"real tokens/s    {s['tokens_per_s']:,.0f} (warm-up steps excluded)",
        f"loss             {s['loss_first']:.3f} -> {s['loss_last']:.3f}",
    ]
    if s["mfu"] is not None:
        lines.append(f"MFU              {s['mfu']:.1%} of the datasheet dense bf16 peak (bert_ds/model/flops.py accounting)")
    if val:
        lines.append(f"held-out         MLM acc {val['mlm_acc']:.3f}, NSP acc {val['nsp_acc']:.3f}, "
                     f"MLM loss {val['mlm_loss']:.3f}")
    if s["skipped_steps"]:
        lines.append(f"skipped steps    {s['skipped_steps']} (non-finite or fp16 overflow)")
    if s["stopped_by"]:
        lines.append(f"stopped by       {s['stopped_by']} (rerun the same command to resume)")
    lines.append(f"checkpoint       {s['checkpoint']}")
    print("\n".join(["== training summary =="] + lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
