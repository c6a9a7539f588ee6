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
folder holds a checkpoint resumes from it (``--resume never`` starts afresh).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bert_ds import checkpoint
from bert_ds.config import BatchPlan, DataConfig, OptimConfig, TrainConfig, deepspeed_config, precision_of
from bert_ds.data import PretrainingDataset, PretrainingLoader, open_pretraining_data, validation_batches
from bert_ds.flops import datasheet_peak_tflops, training_flops
from bert_ds.metrics import MetricsLogger
from bert_ds.model import PRESETS, BertForPreTraining, model_preset
from bert_ds.optim import bind_to_engine, build_optimizer, build_schedule
from data_tools.errors import UserError


class _Defaults:
    """A dataclass's field defaults as attributes, without building (and validating) one."""

    def __init__(self, cls: type):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                setattr(self, f.name, f.default)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bert_ds.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d, o = _Defaults(DataConfig), _Defaults(OptimConfig)
    p.add_argument("--data", required=True, nargs="+", help="training dataset folder(s) (from `data_tools build`)")
    p.add_argument("--data-weights", type=float, nargs="+", default=None, help="blend weights of several --data folders")
    p.add_argument("--val-data", default=None, help="held-out dataset folder built with the same vocabulary")
    p.add_argument("--held-out", type=float, default=d.held_out,
                   help="without --val-data: share of the first dataset's documents held out for validation")
    p.add_argument("--whole-word-mask", action="store_true", help="mask every WordPiece of a chosen word")
    p.add_argument("--output", default="runs/train", help="run folder: metrics, TensorBoard, checkpoints")
    p.add_argument("--preset", default="mini", help=f"model size: {', '.join(PRESETS)}")
    p.add_argument("--kernels", default="auto", choices=["auto", "cuda", "torch"], help="fused CUDA kernels or the PyTorch path")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute layer activations in backward")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--global-batch-size", type=int, default=32, help="sequences per optimizer step, all ranks")
    p.add_argument("--micro-batch-size", type=int, default=32, help="sequences per forward pass per rank")
    p.add_argument("--seq-len", type=int, default=d.max_seq_length, help="maximum tokens per sample")
    p.add_argument("--pair-task", default=d.pair_task, choices=["nsp", "sop", "none"], help="sentence-pair task")
    p.add_argument("--mask-rate", type=float, default=d.mask_rate, help="share of tokens predicted by the MLM head")
    p.add_argument("--num-workers", type=int, default=d.num_workers, help="loader processes per rank")
    p.add_argument("--val-samples", type=int, default=d.val_samples, help="held-out samples per validation pass")
    p.add_argument("--optimizer", default=o.name, choices=["lamb", "adamw"], help="optimizer")
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
    p.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard events")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace, vocab_size: int) -> TrainConfig:
    model = model_preset(args.preset, vocab_size, kernels=args.kernels,
                         activation_checkpointing=args.activation_checkpointing)
    data = DataConfig(train=args.data, weights=args.data_weights, val=args.val_data, held_out=args.held_out,
                      whole_word_mask=args.whole_word_mask, max_seq_length=args.seq_len, pair_task=args.pair_task,
                      mask_rate=args.mask_rate, num_workers=args.num_workers, val_samples=args.val_samples)
    optim = OptimConfig(name=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
                        warmup_steps=args.warmup_steps, decay=args.decay, grad_clip=args.grad_clip)
    return TrainConfig(model=model, data=data, optim=optim, output=args.output, steps=args.steps,
                       global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                       ds_config=args.ds_config, seed=args.seed, val_every=args.val_every,
                       save_every=args.save_every, keep_last=args.keep_last, exit_after=args.exit_after,
                       tensorboard=not args.no_tensorboard, progress=not args.no_progress)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the launcher's process group, or form a group of one."""
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
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
    skipped_steps: int = 0
    loader: dict[str, int] = field(default_factory=dict)
    world_size: int = 1


# Per-step statistics summed over micro-batches and ranks in one all-reduce.
_STATS = ("loss_sum", "micro_batches", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "tokens",
          "sum_sq_len")


def _batch_stats(out, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The _STATS of one micro-batch, on the batch's device (no host sync)."""
    lengths = batch["attention_mask"].sum(dim=1).double()
    nsp = (out.nsp_correct, out.nsp_count) if out.nsp_count is not None else (0, 0)  # --pair-task none
    parts = [out.loss.detach(), 1, out.mlm_correct, out.mlm_count, *nsp, lengths.sum(), (lengths ** 2).sum()]
    return torch.stack([torch.as_tensor(x, device=lengths.device).double() for x in parts])


def _all_reduce(t: torch.Tensor) -> list[float]:
    """Sum across ranks (gloo reduces CPU tensors, NCCL device tensors) and bring to the host."""
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.cpu().tolist()


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _forward(engine, batch: dict[str, torch.Tensor]):
    return engine(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                  attention_mask=batch["attention_mask"], masked_lm_labels=batch["labels"],
                  next_sentence_label=batch.get("next_sentence_label"))


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def validate(engine, dataset: PretrainingDataset, cfg: TrainConfig, rank: int, world: int,
             device: torch.device) -> dict[str, float]:
    engine.eval()
    totals = torch.zeros(len(_STATS) + 1, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in validation_batches(dataset, cfg.data.val_samples, cfg.micro_batch_size, rank, world):
            batch = _to(batch, device)
            out = _forward(engine, batch)
            mlm_loss_sum = out.mlm_loss.detach().double() * out.mlm_count
            totals += torch.cat([_batch_stats(out, batch), mlm_loss_sum.reshape(1)])
    engine.train()
    *sums, mlm_loss_sum = _all_reduce(totals)
    s = dict(zip(_STATS, sums))
    return {"loss": _ratio(s["loss_sum"], s["micro_batches"]),
            "mlm_loss": _ratio(mlm_loss_sum, s["mlm_count"]),
            "mlm_acc": _ratio(s["mlm_correct"], s["mlm_count"]),
            "nsp_acc": _ratio(s["nsp_correct"], s["nsp_count"])}


def run(cfg: TrainConfig, resume: bool, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    import deepspeed

    plan = BatchPlan.resolve(cfg.global_batch_size, cfg.micro_batch_size, world)
    ds_cfg = deepspeed_config(cfg, plan)
    output = Path(cfg.output)
    ckpt_root = output / "checkpoints"
    torch.manual_seed(cfg.seed)
    train_set, val_set = open_pretraining_data(cfg.data, cfg.seed)

    model = BertForPreTraining(cfg.model).to(device)
    optimizer = build_optimizer(model, cfg.optim)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_cfg,
        lr_scheduler=lambda opt: build_schedule(opt, cfg.optim, cfg.steps),
    )
    bind_to_engine(optimizer, engine)
    state = RunState(world_size=world)
    found = checkpoint.find_latest(ckpt_root) if resume else None
    if found is not None:
        saved = checkpoint.load(engine, found, rank=rank, world_size=world)
        state = RunState(**{**saved, "world_size": world})
    loader = PretrainingLoader(train_set, plan, rank, num_workers=cfg.data.num_workers)
    if state.loader:
        loader.load_state_dict(state.loader)

    log = MetricsLogger(output, enabled=rank == 0, total_steps=cfg.steps, start_step=state.step,
                        tensorboard=cfg.tensorboard, progress=cfg.progress)
    precision = precision_of(ds_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log.print(f"{'resuming from ' + str(found) if found else 'starting'}: model {n_params / 1e6:.1f}M params, "
              f"{train_set.num_samples} samples/epoch, batch {plan.global_batch_size} = {plan.micro_batch_size} x "
              f"{plan.grad_accum} accum x {world} ranks, {precision}, ZeRO-{ds_cfg['zero_optimization']['stage']}, "
              f"device {device.type}")
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        (output / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    peak = datasheet_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    tokenizer_dir = Path(cfg.data.train[0])  # every dataset of a run shares one tokenizer

    def save_now() -> Path:
        state.loader = loader.state_dict()
        return checkpoint.save(engine, ckpt_root, state.step, rank=rank, model_config=cfg.model.to_dict(),
                               train_config=cfg.to_dict(), train_state=state.__dict__,
                               tokenizer_dir=tokenizer_dir, keep_last=cfg.keep_last)

    losses: list[float] = []
    rates: list[float] = []
    val: dict[str, float] = {}
    saved_at = state.step if found else -1
    try:
        stop_at = min(cfg.steps, state.step + cfg.exit_after) if cfg.exit_after else cfg.steps
        while state.step < stop_at:
            t0 = time.perf_counter()
            batches = loader.next_step()
            data_s = time.perf_counter() - t0
            stats = torch.zeros(len(_STATS), dtype=torch.float64, device=device)
            for batch in batches:
                batch = _to(batch, device)
                out = _forward(engine, batch)
                engine.backward(out.loss)
                engine.step()
                stats += _batch_stats(out, batch)
            s = dict(zip(_STATS, _all_reduce(stats)))  # the step's one host sync
            step_s = time.perf_counter() - t0
            state.step += 1
            state.tokens += int(s["tokens"])
            state.skipped_steps = int(engine.skipped_steps)
            loss = _ratio(s["loss_sum"], s["micro_batches"])
            record = {
                "step": state.step, "loss": loss, "mlm_acc": _ratio(s["mlm_correct"], s["mlm_count"]),
                "nsp_acc": _ratio(s["nsp_correct"], s["nsp_count"]), "lr": engine.get_lr()[0],
                "grad_norm": _float(engine.get_global_grad_norm()), "loss_scale": _loss_scale(engine),
                "skipped_steps": state.skipped_steps, "tokens": state.tokens,
                "tokens_per_s": s["tokens"] / step_s, "step_time_s": step_s, "data_wait_s": data_s,
            }
            if peak is not None:
                flops = training_flops(cfg.model, int(s["tokens"]), int(s["sum_sq_len"]), int(s["mlm_count"]))
                record["mfu"] = flops / step_s / (peak * 1e12 * world)
                record["max_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            log.log_step(record)
            losses.append(loss)
            rates.append(record["tokens_per_s"])
            if val_set is not None and cfg.val_every and state.step % cfg.val_every == 0:
                val = validate(engine, val_set, cfg, rank, world, device)
                log.log_val({"step": state.step, **val})
            if cfg.save_every and state.step % cfg.save_every == 0:
                save_now()
                saved_at = state.step
        if val_set is not None and state.step == cfg.steps and not (cfg.val_every and state.step % cfg.val_every == 0):
            val = validate(engine, val_set, cfg, rank, world, device)
            log.log_val({"step": state.step, **val})
        final_ckpt = save_now() if saved_at != state.step else ckpt_root / checkpoint.step_dir_name(state.step)
    finally:
        log.close()
    summary = _summary(state, losses, rates, val, final_ckpt)
    if rank == 0:
        (output / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _float(x: Any) -> float:
    return float("nan") if x is None else float(x)


def _loss_scale(engine) -> float:
    """fp16's dynamic loss scale; bf16 and fp32 have none (1.0). DeepSpeed has no public getter."""
    opt = engine.optimizer
    scale = getattr(opt, "cur_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else 1.0


def _summary(state: RunState, losses: list[float], rates: list[float], val: dict[str, float],
             ckpt: Path) -> dict[str, Any]:
    k = max(1, min(10, len(losses) // 5))
    warm = rates[k:] or rates  # the first steps include start-up and are excluded
    return {
        "steps": state.step, "tokens": state.tokens,
        "tokens_per_s": sum(warm) / len(warm) if warm else float("nan"),
        "loss_first": sum(losses[:k]) / k if losses else float("nan"),
        "loss_last": sum(losses[-k:]) / k if losses else float("nan"),
        "val": val, "checkpoint": str(ckpt),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = 0
    try:
        # Validate everything that needs no process group first: bad input fails fast.
        from data_tools.manifest import Manifest

        vocab_size = Manifest.load(Path(args.data[0])).vocab_size
        cfg = config_from_args(args, vocab_size)
        rank, world, device = init_distributed()
        summary = run(cfg, args.resume == "auto", rank, world, device)
        if rank == 0:
            _print_summary(summary)
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _print_summary(s: dict[str, Any]) -> None:
    val = s["val"]
    lines = [
        f"steps            {s['steps']}",
        f"real tokens      {s['tokens']:,}",
        f"real tokens/s    {s['tokens_per_s']:,.0f} (warm-up steps excluded)",
        f"loss             {s['loss_first']:.3f} -> {s['loss_last']:.3f}",
    ]
    if val:
        lines.append(f"held-out         MLM acc {val['mlm_acc']:.3f}, NSP acc {val['nsp_acc']:.3f}, "
                     f"MLM loss {val['mlm_loss']:.3f}")
    lines.append(f"checkpoint       {s['checkpoint']}")
    print("\n".join(["== training summary =="] + lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
