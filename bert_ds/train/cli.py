"""Pretrain BERT (MLM + NSP) from token shards through the DeepSpeed engine.

Runs as one process (``python -m bert_ds.train``), under ``torchrun``, or under the
``deepspeed`` launcher; the process group comes from the launcher's environment,
or is a group of one when there is none. On a machine without CUDA it uses the
CPU accelerator and gloo.

Every run appends to ``OUTPUT/metrics.jsonl`` (one object per optimizer step:
step, loss, mlm_acc, nsp_acc, lr, grad_norm, loss_scale, skipped_steps, tokens
(real, cumulative), tokens_per_s and wall_time_s by the host's clock, tokens_per_s_device
and step_time_s by the device's, and mfu on GPUs), writes
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
  save: the process exits with 128 + the signal number, at once, or, for a Ctrl-C during the
  start-up's imports, as they finish (``bert_ds.base.interrupts``).
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

Exit status (defined in ``bert_ds.base.errors``): 0 finished, or stopped by a signal after a
checkpoint; 1 a bug (traceback); 2 bad input, a damaged checkpoint or an OUTPUT in use (one
``error:`` line); 3 ``--max-bad-steps`` non-finite steps in a row; 4 a rank failed or hung;
128 + N stopped by signal N before the first step (nothing saved); 130 a second Ctrl-C.

This module is the command line: its flags, whose defaults are the config dataclasses'
(``bert_ds.config``), and the checks that need no process group. The run itself is
``bert_ds.train.loop.run``. At the top it imports only what the parser needs (no torch, no
DeepSpeed), so ``--help`` and a mistyped flag answer at once; the run's modules are imported
once the command line is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bert_ds.base.errors import EXIT_INTERRUPTED, EXIT_OK, ConfigError, guarded
from bert_ds.base.interrupts import deferred_interrupt
from bert_ds.config import (
    BF16_CPU_FLAGS, CPU_FP32_DS_CONFIG, DECAYS, OPTIMIZERS, DataConfig, OptimConfig, TrainConfig, check_writable,
    deepspeed_config, machine_ds_config,
)
from bert_ds.model.config import SPECIAL_TOKEN_IDS
from bert_ds.model.family import Family
from bert_ds.model.families import (DEFAULT_ARCH, FAMILIES, PRESETS, AnyModelConfig, check_preset, family, family_of,
                                    family_of_preset)
from bert_ds.train.faults import Faults
from bert_ds.train.step_range import StepRange

if TYPE_CHECKING:
    from bert_ds.checkpoint.hf_import import InitSource
    from bert_ds.train.loop import RunOptions

DEFAULT_PRESET = "mini"  # without --preset and without a checkpoint to resume
DefaultModelConfig = family_of_preset(DEFAULT_PRESET).config_class  # the model flags' defaults


class _Defaults:
    """A dataclass's field defaults as attributes, without building (and validating) one."""

    def __init__(self, cls: type):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                setattr(self, f.name, f.default)


def build_parser() -> argparse.ArgumentParser:
    """The command line; docs/configuration.md is generated from it (``bert_ds.tools.config_reference``)."""
    p = argparse.ArgumentParser(prog="python -m bert_ds.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d, o, t, m = _Defaults(DataConfig), _Defaults(OptimConfig), _Defaults(TrainConfig), _Defaults(DefaultModelConfig)
    p.add_argument("--data", required=True, nargs="+",
                   help="training data (from `data_tools build`): dataset folders or parents of a partitioned "
                        "build, trained on as one corpus (every sample once per epoch, in proportion to the data)")
    p.add_argument("--data-weights", type=float, nargs="+", default=None,
                   help="one weight per --data entry: each entry is a corpus of its own, blended by weight")
    p.add_argument("--val-data", default=None, help="held-out dataset folder built with the same vocabulary")
    p.add_argument("--held-out", type=float, default=d.held_out,
                   help="without --val-data: share of the corpus's documents (with --data-weights, of the first "
                        "entry's) held out for validation")
    p.add_argument("--whole-word-mask", action="store_true", help="mask every WordPiece of a chosen word")
    p.add_argument("--output", default=t.output, help="run folder: metrics, TensorBoard, checkpoints")
    p.add_argument("--preset", default=None,
                   help=f"model size: {', '.join(PRESETS)} (default: the checkpoint's model when resuming, "
                        f"else {DEFAULT_PRESET})")
    p.add_argument("--kernels", default=m.kernels, choices=["auto", "cuda", "torch"], help="fused CUDA kernels or the PyTorch path")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute layer activations in backward")
    p.add_argument("--compile-layers", action="store_true",
                   help="torch.compile each encoder layer: Inductor fuses its elementwise ops, attention as --kernels picks")
    p.add_argument("--dropout", type=float, default=None,
                   help="the model family's dropout: " + "; ".join(f"{f.name}'s {', '.join(f.dropout_fields)}"
                                                                    for f in FAMILIES.values())
                   + " (default: the model's); 0 makes a world-size change exact, see R8")
    _add_batch_flags(p, t)
    p.add_argument("--seq-len", type=int, default=d.max_seq_length, help="maximum tokens per sample")
    # The model family's defaults where these four are not given (its record's data_defaults)
    p.add_argument("--pair-task", default=None, choices=["nsp", "sop", "none"],
                   help=f"sentence-pair task (default: the model family's: {_family_defaults('pair_task')})")
    p.add_argument("--layout", default=None, choices=["sentences", "documents"],
                   help="samples of whole sentences (pairs, short targets) or [CLS] document [SEP], a long "
                        "document cut into consecutive pieces of --seq-len - 2 tokens; documents needs --pair-task "
                        f"none (default: the model family's: {_family_defaults('layout')})")
    p.add_argument("--token-budget", action=argparse.BooleanOptionalAction, default=None,
                   help="fill each micro-batch with samples up to --micro-batch-size x --seq-len tokens, in stream "
                        "order (a variable number of sequences; --layout documents; default: the model family's: "
                        f"{_family_defaults('token_budget')})")
    p.add_argument("--mask-rate", type=float, default=None,
                   help=f"share of tokens predicted by the MLM head (default: the model family's: "
                        f"{_family_defaults('mask_rate')})")
    p.add_argument("--num-workers", type=int, default=d.num_workers, help="loader processes per rank")
    p.add_argument("--val-samples", type=int, default=d.val_samples, help="held-out samples per validation pass")
    _add_optimizer_flags(p, o)
    p.add_argument("--ds-config", default=None,
                   help=f"engine JSON: a file in ds_configs/ or a path (default: {t.ds_config}, or "
                        f"{CPU_FP32_DS_CONFIG} on a CPU without bf16 instructions; resuming, the checkpoint's)")
    p.add_argument("--seed", type=int, default=t.seed, help="seed of weights, samples, masks and dropout")
    p.add_argument("--val-every", type=int, default=t.val_every, help="steps between validation passes (0: at the end)")
    p.add_argument("--save-every", type=int, default=t.save_every, help="steps between checkpoints (0: at the end)")
    p.add_argument("--keep-last", type=int, default=t.keep_last, help="checkpoints kept")
    p.add_argument("--exit-after", type=int, default=t.exit_after,
                   help="save a checkpoint and exit after this many steps of this invocation (time-limited jobs); 0: off")
    p.add_argument("--resume", default="auto", choices=["auto", "never"], help="resume from OUTPUT/checkpoints if present")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start a fresh run from these weights: a Hugging Face BERT folder (config.json and "
                        "model.safetensors or pytorch_model.bin, or their sharded *.index.json), a bert_ds export, "
                        "checkpoint or run folder, or a .safetensors file; without --preset the model's sizes come "
                        "from it; optimizer and schedule start fresh; ignored when resuming")
    p.add_argument("--max-bad-steps", type=int, default=t.max_bad_steps,
                   help="stop (exit 3) after this many non-finite steps in a row; single ones are skipped; 0: never")
    p.add_argument("--collective-timeout", type=float, default=t.collective_timeout, metavar="SECONDS",
                   help="fail (exit 4) when a rank waits this long on its peers; must exceed a checkpoint save")
    p.add_argument("--log-samples", default=None, metavar="FILE",
                   help="append the global stream positions each rank consumes at each step to FILE (JSON lines; "
                        "to check that a resume neither repeats nor skips samples, see consumed_positions())")
    p.add_argument("--profile-steps", default=None, metavar="FIRST-LAST",
                   help="profile these steps with torch.profiler (e.g. 11-13): per-step device busy and idle "
                        "time, host syncs, top kernels, and a Chrome trace, in OUTPUT/profile/")
    Faults.add_arguments(p)
    p.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard events")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p


def _family_defaults(field: str) -> str:
    return ", ".join(f"{family.arch} {family.data_defaults[field]}" for family in FAMILIES.values())


def _add_batch_flags(p: argparse.ArgumentParser, t: _Defaults) -> None:
    """The steps and the batch's flags; ``t``: TrainConfig's defaults."""
    p.add_argument("--steps", type=int, default=t.steps, help="optimizer steps")
    p.add_argument("--global-batch-size", type=int, default=t.global_batch_size, help="sequences per optimizer step, all ranks")
    p.add_argument("--micro-batch-size", type=int, default=t.micro_batch_size, help="sequences per forward pass per rank")
    p.add_argument("--batch-warmup-steps", type=int, default=t.batch_warmup_steps,
                   help="steps over which the global batch rises from --batch-warmup-start to --global-batch-size "
                        "(0: off)")
    p.add_argument("--batch-warmup-start", type=int, default=t.batch_warmup_start,
                   help="the global batch of step 1 under --batch-warmup-steps (in whole micro-batches on every rank)")


def _add_optimizer_flags(p: argparse.ArgumentParser, o: _Defaults) -> None:
    """The optimizer's and the schedule's flags; ``o``: OptimConfig's defaults."""
    p.add_argument("--optimizer", default=o.name, choices=list(OPTIMIZERS),
                   help="lamb is BERT's; stable_adamw ModernBERT's, AdamW with per-parameter update clipping; "
                        "adamw torch's")
    p.add_argument("--lamb-variant", default=o.lamb_variant, choices=["nvidia", "paper"],
                   help="LAMB's trust ratio: nvidia (only where weight decay is non-zero, NVIDIA's BERT recipe) "
                        "or paper (every tensor)")
    p.add_argument("--lr", type=float, default=o.lr, help="peak learning rate")
    p.add_argument("--betas", type=float, nargs=2, default=o.betas, metavar=("B1", "B2"),
                   help="decay rates of the first and second moments (ModernBERT: 0.9 0.98)")
    p.add_argument("--eps", type=float, default=o.eps, help="added to the second moment's root")
    p.add_argument("--weight-decay", type=float, default=o.weight_decay,
                   help="decoupled weight decay (not on biases and LayerNorm weights)")
    p.add_argument("--decouple-lr", action="store_true", default=o.decouple_lr,
                   help="adamw, stable_adamw: weight decay scaled by the step's fraction of the peak learning "
                        "rate instead of by the rate (ModernBERT's, with --weight-decay 1e-5)")
    p.add_argument("--schedule", default=o.schedule, choices=["bert", "wsd"],
                   help="bert: warm-up, then --decay over every later step; wsd: warm-up, the peak held, then "
                        "--decay over the last --decay-share of the steps")
    p.add_argument("--warmup-steps", type=int, default=o.warmup_steps, help="linear warm-up steps")
    p.add_argument("--decay", default=o.decay, choices=list(DECAYS),
                   help="the decay's shape, down to --final-lr-fraction at the last step")
    p.add_argument("--decay-share", type=float, default=o.decay_share,
                   help="--schedule wsd: the share of the steps that decay, the last ones")
    p.add_argument("--final-lr-fraction", type=float, default=o.final_lr_fraction,
                   help="the decay ends at --lr times this")
    p.add_argument("--poly-power", type=float, default=o.poly_power, help="exponent of --decay poly")
    p.add_argument("--grad-clip", type=float, default=o.grad_clip, help="global gradient-norm clip (0: off)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def model_from_args(args: argparse.Namespace, from_data: dict[str, int], saved_model: dict[str, Any] | None,
                    init: InitSource | None = None) -> AnyModelConfig:
    """The model a run asks for. Resuming (``saved_model``: the checkpoint's), every field not
    given on the command line stays as saved, the preset's sizes included when --preset is
    absent; a different size or vocabulary (which comes from the data) is then a refused
    change (bert_ds.checkpoint.resume), not a silent one. Starting from ``init`` (--init-from), the
    architecture is the source's (bert_ds.checkpoint.hf_import). ``from_data``: what the data sets
    (:meth:`Manifest.model_fields`): its vocabulary's size, and its special tokens' ids (the padding
    token's row among them) for a model that starts here; a resumed model keeps its own, which a
    run saved before the tokenizer's were taken holds as pad 0 and no others."""
    chosen = _family(args, saved_model, init)
    given = dict(vocab_size=from_data["vocab_size"], kernels=args.kernels,
                 activation_checkpointing=args.activation_checkpointing,
                 compile_layers=args.compile_layers)
    if args.dropout is not None:
        given.update(dict.fromkeys(chosen.dropout_fields, args.dropout))
    if saved_model is None:
        given.update({name: from_data[name] for name in SPECIAL_TOKEN_IDS if name in from_data})
    if saved_model is None and init is not None and init.model is not None:
        from bert_ds.checkpoint import hf_import  # the source is open: torch is in already

        return hf_import.model_config(init, args.preset, given)
    if saved_model is None:
        return chosen.preset(args.preset or DEFAULT_PRESET, **given)
    if args.preset is None:
        return chosen.config_class.from_dict({**saved_model, **given})
    # The saved fields the preset does not set, of its family: a preset of the other family is then a
    # refused change of model.arch, never a model of one family with the other's sizes.
    fields = {f.name for f in dataclasses.fields(chosen.config_class)} - set(chosen.presets[args.preset]) - {"arch"}
    kept = {k: v for k, v in saved_model.items() if k in fields}
    return chosen.preset(args.preset, **{**kept, **given})


def _family(args: argparse.Namespace, saved_model: dict[str, Any] | None, init: InitSource | None) -> Family:
    """The model family of the run: the checkpoint's, else --preset's, else the --init-from source's."""
    if saved_model is not None and args.preset is None:
        return family(saved_model.get("arch", DEFAULT_ARCH))
    if args.preset is None and init is not None and init.model is not None:
        return family(init.model["arch"])
    return family_of_preset(args.preset or DEFAULT_PRESET)


def ds_config_from_args(args: argparse.Namespace, saved: str | None, cuda: bool) -> tuple[str, str]:
    """--ds-config; without it, a resumed run's own (``saved``), else the machine's default
    (:func:`bert_ds.config.machine_ds_config`). With it, the line that says so where the
    machine's default is not TrainConfig's ("" otherwise)."""
    if args.ds_config is not None:
        return args.ds_config, ""
    if saved is not None:
        return saved, ""
    chosen = machine_ds_config(cuda)
    if chosen == TrainConfig.ds_config:
        return chosen, ""
    return chosen, (f"[bert_ds] this CPU has no bf16 instructions ({' or '.join(BF16_CPU_FLAGS)}): training in "
                    f"fp32 ({chosen}; --ds-config overrides)")


def config_from_args(args: argparse.Namespace, from_data: dict[str, int], saved_model: dict[str, Any] | None = None,
                     init: InitSource | None = None, ds_config: str | None = None) -> TrainConfig:
    """The run's config; ``ds_config`` where --ds-config is not given (TrainConfig's default if None)."""
    model = model_from_args(args, from_data, saved_model, init)
    family = {name: value if (value := getattr(args, name)) is not None else default
              for name, default in family_of(model).data_defaults.items()}
    data = DataConfig(train=args.data, weights=args.data_weights, val=args.val_data, held_out=args.held_out,
                      whole_word_mask=args.whole_word_mask, max_seq_length=args.seq_len, num_workers=args.num_workers,
                      val_samples=args.val_samples, **family)
    optim = OptimConfig(name=args.optimizer, lamb_variant=args.lamb_variant, lr=args.lr, betas=tuple(args.betas),
                        eps=args.eps, weight_decay=args.weight_decay, decouple_lr=args.decouple_lr,
                        schedule=args.schedule, warmup_steps=args.warmup_steps, decay=args.decay,
                        decay_share=args.decay_share, final_lr_fraction=args.final_lr_fraction,
                        poly_power=args.poly_power, grad_clip=args.grad_clip)
    return TrainConfig(model=model, data=data, optim=optim, output=args.output, steps=args.steps,
                       global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                       batch_warmup_steps=args.batch_warmup_steps, batch_warmup_start=args.batch_warmup_start,
                       ds_config=args.ds_config or ds_config or TrainConfig.ds_config, seed=args.seed,
                       val_every=args.val_every,
                       save_every=args.save_every, keep_last=args.keep_last, exit_after=args.exit_after,
                       init_from=args.init_from, max_bad_steps=args.max_bad_steps,
                       collective_timeout=args.collective_timeout,
                       tensorboard=not args.no_tensorboard, progress=not args.no_progress)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _checked_then_trained(args)
    except KeyboardInterrupt:
        # Ctrl-C while the inputs are read, torch is imported or the run is checked: the stop
        # handlers come with the run's folder lock (train.session), and nothing is written yet.
        rank = os.environ.get("RANK", "0")
        sys.stderr.write(f"[bert_ds] rank {rank}: received SIGINT before the first step; nothing to save, exiting\n")
        return EXIT_INTERRUPTED


def _checked_then_trained(args: argparse.Namespace) -> int:
    data, from_data = Path(), {}

    def read_data() -> None:  # a wrong --output or --data is said before torch is imported: at once
        nonlocal data, from_data
        _check_flags(args)
        data, from_data = _data_and_vocabulary(args)

    with deferred_interrupt():  # a Ctrl-C waits for the modules' initialisation (bert_ds.base.interrupts)
        status = guarded(read_data)
        if status != EXIT_OK:
            return status
        from bert_ds.train.session import entry  # torch and the run's modules: once the command line is read

    return entry(lambda: _train(args, data, from_data))


def _data_and_vocabulary(args: argparse.Namespace) -> tuple[Path, dict[str, int]]:
    """--data's dataset folder (a parent's first part) and what it sets of the model (its
    vocabulary's size, its padding token), once --output is known to be writable (a file, a
    read-only place: before anything is read). No torch."""
    from bert_ds.data_tools.manifest import Manifest
    from bert_ds.data_tools.partition import dataset_folders

    check_writable(args.output, "--output", folder=True)
    data = dataset_folders(args.data[0])[0]
    return data, Manifest.load(data).model_fields()


def _check_flags(args: argparse.Namespace) -> None:
    """The flags whose check needs neither torch nor the data: a typo is said at once."""
    if args.preset is not None:
        check_preset(args.preset)
    if args.profile_steps is not None:
        profile = StepRange.parse(args.profile_steps)
        if profile.first > args.steps:
            raise ConfigError(f"--profile-steps {profile} starts after the run's last step (--steps {args.steps})")


def _train(args: argparse.Namespace, data: Path, from_data: dict[str, int]) -> None:
    with deferred_interrupt():  # until the session's stop handlers: its modules', DeepSpeed's import (prepare's)
        from bert_ds.train.loop import run
        from bert_ds.train.session import locked_session
        from bert_ds.train.summary import print_summary

        prepared = prepare(args, data, from_data)
    if prepared is None:
        return
    cfg, options = prepared
    # Every input is checked before the lock, which creates OUTPUT: a refused command
    # leaves no folder behind. run() finds the checkpoint to resume again, under the lock.
    with locked_session(cfg.output, "bert_ds.train", cfg.collective_timeout) as (rank, world, device, stop):
        summary = run(cfg, args.resume == "auto", rank, world, device, options, stop)
        if rank == 0:
            print_summary(summary)


def prepare(args: argparse.Namespace, data: Path, from_data: dict[str, int]) -> tuple[TrainConfig, RunOptions] | None:
    """The run's validated config and options, checked without a process group so that bad
    input fails fast; None when the run in OUTPUT is finished already (said on rank 0).
    ``data``, ``from_data``: what :func:`_data_and_vocabulary` read before torch was imported."""
    import torch

    from bert_ds.checkpoint import hf_import
    from bert_ds.checkpoint import resume as resuming
    from bert_ds.checkpoint import store as checkpoint
    from bert_ds.kernels.choice import check_setting
    from bert_ds.loader.pretraining import check_tokenizers
    from bert_ds.train.loop import RunOptions, batch_plan

    found = checkpoint.find_latest(checkpoint.run_checkpoints(args.output)) if args.resume == "auto" else None
    init = hf_import.open_source(Path(args.init_from)) if args.init_from and found is None else None
    if init is not None:
        hf_import.check_vocabulary(init, data)
    ds_config, note = ds_config_from_args(args, resuming.saved_ds_config(found) if found else None,
                                          torch.cuda.is_available())
    cfg = config_from_args(args, from_data, resuming.saved_model(found) if found else None, init, ds_config)
    check_setting(cfg.model.kernels)  # kernels=cuda on a machine without CUDA: before the folder is made
    check_tokenizers(cfg.data)  # --data/--val-data folders of different tokenizers, likewise
    profile = StepRange.parse(args.profile_steps) if args.profile_steps is not None else None  # checked: _check_flags
    options = RunOptions(args.log_samples, Faults.from_args(args), profile)
    if options.log_samples:
        check_writable(options.log_samples, "--log-samples", folder=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if found is not None:
        resuming.changes(found, cfg, world)  # a refused change fails here, before any rank waits on another
        if _finished(found, cfg):
            return None
    plan = batch_plan(cfg, world, found)  # before any rank waits on another
    deepspeed_config(cfg, plan)  # an engine JSON that DeepSpeed would refuse after start-up fails here
    if note and os.environ.get("RANK", "0") == "0":  # said once the command is accepted
        print(note, flush=True)
    return cfg, options


def _finished(found: Path, cfg: TrainConfig) -> bool:
    """Whether the checkpoint ``found`` ends the run already (--steps reached); says so on rank 0."""
    from bert_ds.checkpoint import resume as resuming

    done_at = resuming.finished(found, cfg)
    if done_at is None:
        return False
    resuming.verify_newest(found)  # "finished" must not hide a damaged final checkpoint
    if os.environ.get("RANK", "0") == "0":
        kept = ("summary.json left as it was" if (Path(cfg.output) / "summary.json").is_file()
                else "no summary.json: the run ended after its last checkpoint")
        print(f"{cfg.output}: finished at step {done_at} (--steps {cfg.steps}), nothing to do; {kept}; "
              "a larger --steps trains on", flush=True)
    return True
