"""Typed, validated training configuration.

Design choices:
- Three small dataclasses (data, optimizer, run) plus the model family's config
  (:mod:`bert_ds.model.families`); each validates itself in ``__post_init__`` and raises :class:`ConfigError` naming the field, so a bad value stops the run before
  any process group or file exists.
- DeepSpeed JSON (``ds_configs/``) holds engine settings only: ZeRO stage,
  precision, communication. Batch sizes and clipping are training settings and are
  written into the engine config here, by :func:`deepspeed_config`; a JSON that sets
  them itself is rejected, so each number has one definition.
- Batch arithmetic lives in :class:`BatchPlan` and nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bert_ds.base.errors import ConfigError, require
from bert_ds.model.families import AnyModelConfig, family_of, model_config_from_dict

# bert_ds/ds_configs: in a checkout the link to the top-level folder, in a wheel the folder itself
DS_CONFIG_DIR = Path(__file__).resolve().parent / "ds_configs"

# Keys a DeepSpeed JSON may not set: they are derived from TrainConfig.
_DERIVED_DS_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "scheduler",
)


MAX_LR = 10.0  # far above any BERT recipe (LAMB peaks near 1e-2, Adam near 1e-4): a larger value is a typo
OPTIMIZERS = ("lamb", "adamw", "stable_adamw")
# bound to ZeRO's partitions (bert_ds.optim.fragments): the name in messages, and what is per parameter
PER_PARAMETER_OPTIMIZERS = {"lamb": ("LAMB", "trust ratios"), "stable_adamw": ("StableAdamW", "update clipping")}
DECAYS = ("linear", "poly", "one_minus_sqrt", "constant")
MAX_DECOUPLED_WEIGHT_DECAY = 1e-3


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass
class DataConfig:
    train: list[str] = field(default_factory=list)  # dataset folders (or parents of partitions) of `data_tools build`
    weights: list[float] | None = None  # None: all of `train` is one corpus; else each entry's blend weight
    val: str | None = None  # held-out dataset folder (same tokenizer), or None
    held_out: float = 0.0  # without `val`: this share of the corpus's documents (with weights: train[0]'s) is held out
    max_seq_length: int = 128  # tokens per sample including [CLS] and two [SEP]
    # sentences: BERT's samples of whole sentences (pairs, short targets); documents: [CLS] one document [SEP],
    # a longer one cut into consecutive pieces of max_seq_length - 2 tokens (no pairs: pair_task none)
    layout: Literal["sentences", "documents"] = "sentences"
    # fill each micro-batch with samples up to micro_batch_size x max_seq_length tokens, in stream order (documents)
    token_budget: bool = False
    short_seq_prob: float = 0.1  # BERT: this share of samples gets a shorter random target (sentences layout)
    mask_rate: float = 0.15  # share of tokens chosen for the MLM loss
    whole_word_mask: bool = False  # mask all WordPiece pieces of a chosen word together
    pair_task: Literal["nsp", "sop", "none"] = "nsp"  # second segment and its label
    num_workers: int = 1  # loader processes per rank; samples do not depend on it
    val_samples: int = 512  # held-out samples per validation pass (fixed, deterministic)

    def __post_init__(self) -> None:
        if isinstance(self.train, str):
            self.train = [self.train]
        self.train = list(self.train)
        require(len(self.train) >= 1, "train", "at least one dataset folder is needed")
        require(self.weights is None or (len(self.weights) == len(self.train) and all(w > 0 for w in self.weights)),
               "weights", f"need one positive weight per training dataset ({len(self.train)}), got {self.weights}")
        seen = [os.path.realpath(p) for p in self.train]
        twice = next((p for i, p in enumerate(self.train) if seen[i] in seen[:i]), None)
        require(twice is None, "train", f"{twice} is given twice (a dataset listed once is read whole every epoch; "
                "--data-weights blends datasets)")
        require(self.val is None or os.path.realpath(self.val) not in seen, "val",
                f"{self.val} is also a training dataset: its figures would not be held out (use another dataset, "
                "or --held-out)")
        require(0.0 <= self.held_out < 1.0, "held_out", f"must be in [0, 1), got {self.held_out}")
        # a sample's length must fit the sample map's 16-bit count (bert_ds.loader.sample_map)
        require(8 <= self.max_seq_length <= 65536, "max_seq_length", f"must be in [8, 65536], got {self.max_seq_length}")
        require(0.0 <= self.short_seq_prob <= 1.0, "short_seq_prob", f"must be in [0, 1], got {self.short_seq_prob}")
        require(0.0 < self.mask_rate < 1.0, "mask_rate", f"must be in (0, 1), got {self.mask_rate}")
        require(self.pair_task in ("nsp", "sop", "none"), "pair_task", f"must be nsp, sop or none, got {self.pair_task!r}")
        require(self.layout in ("sentences", "documents"), "layout",
                f"must be sentences or documents, got {self.layout!r}")
        require(self.layout == "sentences" or self.pair_task == "none", "pair_task",
                f"{self.pair_task} needs sentence pairs, which the documents layout has none of: set pair_task none "
                "(--pair-task none)")
        require(self.layout == "documents" or not self.token_budget, "token_budget",
                "needs layout documents (--layout documents): a sentences-layout sample's length is drawn when it "
                "is made, so a micro-batch cannot be filled ahead")
        require(self.num_workers >= 0, "num_workers", f"must be >= 0, got {self.num_workers}")
        require(self.val_samples > 0, "val_samples", f"must be > 0, got {self.val_samples}")


@dataclass
class OptimConfig:
    # lamb: per-parameter trust ratios (BERT's); stable_adamw: AdamW with per-parameter update
    # clipping (ModernBERT's); adamw: torch's fused AdamW. See bert_ds/optim/builders.py.
    name: Literal["lamb", "adamw", "stable_adamw"] = "lamb"
    # nvidia: the trust ratio only where weight decay is non-zero (NVIDIA's BERT recipe);
    # paper: on every tensor (the LAMB paper). See bert_ds/optim/lamb.py.
    lamb_variant: Literal["nvidia", "paper"] = "nvidia"
    lr: float = 6e-3  # peak learning rate after warm-up (NVIDIA's LAMB phase 1; AdamW wants ~10x less)
    betas: tuple[float, float] = (0.9, 0.999)  # decay rates of the first and second moments (ModernBERT: 0.9, 0.98)
    eps: float = 1e-6  # added to the second moment's root (BERT's and ModernBERT's 1e-6; 1e-8 is the Adam paper's)
    weight_decay: float = 0.01  # not applied to biases and LayerNorm weights
    # false: weight decay scaled by the step's learning rate, w *= 1 - lr_t * weight_decay (torch's
    # AdamW); true: by its fraction of the peak, w *= 1 - lr_t / lr * weight_decay, so weight_decay
    # is the share a weight loses per step at the peak (ModernBERT's 1e-5; optimi's decouple_lr).
    # adamw and stable_adamw only
    decouple_lr: bool = False
    # bert: warm-up, then `decay` over every later step; wsd: warm-up, the peak held, then `decay`
    # over the last decay_share of the steps (ModernBERT's warmup-stable-decay)
    schedule: Literal["bert", "wsd"] = "bert"
    warmup_steps: int = 100  # linear warm-up from 0 to lr
    # the decay's shape, down to final_lr_fraction at the last step; constant: none
    decay: Literal["linear", "poly", "one_minus_sqrt", "constant"] = "linear"
    decay_share: float = 0.1  # wsd: the share of the run's last steps that decay (0: never; 1: all after warm-up)
    final_lr_fraction: float = 0.0  # the decay ends at lr times this (ModernBERT's alpha_f)
    poly_power: float = 0.5  # exponent of the "poly" decay (NVIDIA's BERT uses 0.5)
    grad_clip: float = 1.0  # global-norm clipping; 0 disables (ModernBERT's recipe: 0, StableAdamW clips updates)

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # JSON gives a list
        require(self.name in OPTIMIZERS, "optim.name",
                f"unknown optimizer {self.name!r} (known: {', '.join(OPTIMIZERS)})")
        require(self.lamb_variant in ("nvidia", "paper"), "lamb_variant",
               f"must be nvidia or paper, got {self.lamb_variant!r}")
        # Every number in range and finite: an inf or 1e300 learning rate would start a run that
        # writes NaN weights into its checkpoints (R16).
        require(_finite(self.lr) and 0 < self.lr <= MAX_LR, "lr", f"must be a finite number in (0, {MAX_LR:g}], got {self.lr}")
        require(len(self.betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in self.betas), "betas",
               f"must be two values in [0, 1), got {self.betas}")
        require(_finite(self.eps) and 0 < self.eps < 1, "eps", f"must be a finite number in (0, 1), got {self.eps}")
        require(_finite(self.weight_decay) and 0 <= self.weight_decay <= 1, "weight_decay",
               f"must be a finite number in [0, 1], got {self.weight_decay}")
        self._check_decouple_lr()
        require(self.schedule in ("bert", "wsd"), "schedule", f"must be bert or wsd, got {self.schedule!r}")
        require(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "warmup_steps",
                f"must be an integer >= 0, got {self.warmup_steps}")
        require(self.decay in DECAYS, "decay", f"must be {', '.join(DECAYS[:-1])} or {DECAYS[-1]}, got {self.decay!r}")
        require(_finite(self.decay_share) and 0 <= self.decay_share <= 1, "decay_share",
                f"must be a finite number in [0, 1], got {self.decay_share}")
        require(_finite(self.final_lr_fraction) and 0 <= self.final_lr_fraction < 1, "final_lr_fraction",
                f"must be a finite number in [0, 1), got {self.final_lr_fraction}")
        require(self.final_lr_fraction == 0 or self.decay != "constant", "final_lr_fraction",
                f"{self.final_lr_fraction} is the end of a decay, and decay is constant (no decay)")
        require(_finite(self.poly_power) and self.poly_power > 0, "poly_power",
               f"must be a finite number > 0, got {self.poly_power}")
        require(_finite(self.grad_clip) and self.grad_clip >= 0, "grad_clip",
               f"must be a finite number >= 0 (0: off), got {self.grad_clip}")

    def _check_decouple_lr(self) -> None:
        if not self.decouple_lr:
            return
        require(self.name != "lamb", "decouple_lr",
                "LAMB's weight decay is part of the update its trust ratio scales; decouple_lr is for adamw "
                "and stable_adamw")
        # 1e-3 is where torch-optimi warns: a share per step, it takes 10% of a weight in 100 steps
        require(self.weight_decay <= MAX_DECOUPLED_WEIGHT_DECAY, "weight_decay",
                f"with decouple_lr it is the share of every weight lost per step at the peak (ModernBERT: 1e-5); "
                f"{self.weight_decay:g} is more than {MAX_DECOUPLED_WEIGHT_DECAY:g} (without decouple_lr it is "
                "multiplied by the learning rate first)")


@dataclass
class TrainConfig:
    model: AnyModelConfig  # the family (arch), sizes, dropout, kernels (in a phase plan: a preset and overrides)
    data: DataConfig  # what is read and how samples are made
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer and learning-rate schedule
    output: str = "runs/train"  # metrics.jsonl, TensorBoard events, checkpoints/
    steps: int = 1000  # optimizer steps
    global_batch_size: int = 32  # sequences per optimizer step, all ranks together
    micro_batch_size: int = 32  # sequences per forward pass on one rank
    batch_warmup_steps: int = 0  # steps over which the global batch rises to global_batch_size; 0 = off
    batch_warmup_start: int = 0  # the global batch of step 1 under batch_warmup_steps (ModernBERT: 768 of 4,608)
    ds_config: str = "zero1_bf16.json"  # a file in ds_configs/ or a path
    seed: int = 1234  # weights, sample order, masks and dropout all follow from it
    log_every: int = 1  # metrics.jsonl gets every step; this paces the console line
    val_every: int = 0  # steps between validation passes; 0 = only at the end
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last: int = 3  # checkpoints kept; older ones are deleted after a commit
    exit_after: int = 0  # save and stop after this many steps of one invocation (time-limited jobs); 0 = off
    init_from: str | None = None  # weights a fresh run starts from: HF BERT folder, bert_ds checkpoint/run folder, .safetensors
    max_bad_steps: int = 10  # this many non-finite steps in a row stop the run (exit 3); 0 = never stop
    collective_timeout: float = 600.0  # seconds a rank waits on its peers before the job fails (exit 4)
    tensorboard: bool = True  # events in OUTPUT/tensorboard beside metrics.jsonl
    progress: bool = True  # a progress bar on rank 0

    def __post_init__(self) -> None:
        require(self.steps > 0, "steps", f"must be > 0, got {self.steps}")
        require(self.global_batch_size > 0, "global_batch_size", f"must be > 0, got {self.global_batch_size}")
        require(self.micro_batch_size > 0, "micro_batch_size", f"must be > 0, got {self.micro_batch_size}")
        require(self.batch_warmup_steps >= 0, "batch_warmup_steps", f"must be >= 0, got {self.batch_warmup_steps}")
        if self.batch_warmup_steps:
            require(0 < self.batch_warmup_start <= self.global_batch_size, "batch_warmup_start",
                    f"must be in (0, global_batch_size {self.global_batch_size}] with batch_warmup_steps, "
                    f"got {self.batch_warmup_start}")
        require(self.log_every > 0, "log_every", f"must be > 0, got {self.log_every}")
        require(self.val_every >= 0 and self.save_every >= 0, "val_every/save_every", "must be >= 0")
        require(self.exit_after >= 0, "exit_after", f"must be >= 0, got {self.exit_after}")
        require(self.keep_last >= 1, "keep_last", f"must be >= 1, got {self.keep_last}")
        require(self.max_bad_steps >= 0, "max_bad_steps", f"must be >= 0, got {self.max_bad_steps}")
        # Ranks wait in barriers while rank 0 writes a checkpoint: the timeout must cover a save.
        require(self.collective_timeout >= 1, "collective_timeout", f"must be >= 1 second, got {self.collective_timeout}")
        require(self.data.max_seq_length <= self.model.max_position_embeddings, "max_seq_length",
               f"{self.data.max_seq_length} exceeds the model's max_position_embeddings {self.model.max_position_embeddings}")
        family_of(self.model).check_data(self.model, self.data)  # what the model's family cannot train on
        resolve_ds_config_path(self.ds_config)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["model"] = self.model.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        try:
            model = model_config_from_dict(d.pop("model"))
            data = _from_dict(DataConfig, d.pop("data"))
            optim = _from_dict(OptimConfig, d.pop("optim", {}))
        except KeyError as e:
            raise ConfigError(f"training config is missing the section {e.args[0]!r}") from None
        return _from_dict(cls, d, model=model, data=data, optim=optim)


def _from_dict(cls: type, d: dict[str, Any], **extra: Any) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}")
    return cls(**d, **extra)


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch splits into ranks and accumulation steps, step by step.

    ``global_batch_size == micro_batch_size * grad_accum * world_size`` always holds. Under a
    batch-size warm-up (``warmup_steps`` > 0) step s (1-based) of the first ``warmup_steps``
    runs fewer accumulation steps: from ``warmup_accum`` at step 1, rising linearly to
    ``grad_accum`` (ModernBERT's warm-up of its global batch, 768 to 4,608 sequences). The
    micro-batch stays as it is, so a step's batch moves in whole micro-batches on every rank,
    ``micro_batch_size x world_size`` sequences at a time.
    """

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    grad_accum: int
    warmup_steps: int = 0
    warmup_accum: int = 0  # the accumulation steps of step 1 under the warm-up

    @classmethod
    def resolve(cls, global_batch_size: int, micro_batch_size: int, world_size: int, warmup_steps: int = 0,
                warmup_start: int = 0) -> BatchPlan:
        """``warmup_start``: the global batch of step 1 under ``warmup_steps``, rounded down to
        whole micro-batches on every rank (at least one)."""
        per_step = micro_batch_size * world_size
        if global_batch_size % per_step:
            per_rank, fits = divmod(global_batch_size, world_size)
            hint = (f"; a micro_batch_size that fits: {max(d for d in range(1, micro_batch_size + 1) if per_rank % d == 0)}"
                    f" (--micro-batch-size)" if per_rank and not fits else "")
            raise ConfigError(
                f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size {micro_batch_size}"
                f" x world_size {world_size} = {per_step}{hint}"
            )
        grad_accum = global_batch_size // per_step
        warmup_accum = min(max(1, warmup_start // per_step), grad_accum) if warmup_steps else 0
        return cls(global_batch_size, micro_batch_size, world_size, grad_accum, warmup_steps, warmup_accum)

    def accum_at(self, step: int) -> int:
        """The accumulation steps of optimizer step ``step`` (1-based)."""
        if step > self.warmup_steps:
            return self.grad_accum
        return self.warmup_accum + (self.grad_accum - self.warmup_accum) * (step - 1) // self.warmup_steps

    def batch_at(self, step: int) -> int:
        """The global batch (sequences, all ranks) of optimizer step ``step``."""
        return self.accum_at(step) * self.micro_batch_size * self.world_size

    def describe(self) -> str:
        """The split, for the start-up line: ``32 = 8 x 2 accum x 2 ranks`` and any warm-up."""
        text = (f"{self.global_batch_size} = {self.micro_batch_size} x {self.grad_accum} accum x "
                f"{self.world_size} ranks")
        if self.warmup_steps:
            text += f", warming up from {self.batch_at(1)} over {self.warmup_steps} steps"
        return text


def check_writable(path: str | Path, flag: str, *, folder: bool) -> None:
    """Refuse, before anything starts, a path a run could not write: ``path`` must be a folder
    (``folder``) or a file to append to, existing or creatable. The probe creates an unnamed
    temporary file and nothing else: permission bits alone say nothing for root or a read-only
    mount, and a run that fails at its first write would leave a half-made run folder behind."""
    path = Path(path)
    if path.exists() and folder != path.is_dir():
        raise ConfigError(f"{flag} {path}: " + ("exists and is not a folder" if folder else "is a folder; give a file"))
    try:
        if path.exists() and not folder:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
            return
        base = path if folder else path.parent
        while not base.exists():
            base = base.parent
        if not base.is_dir():
            raise ConfigError(f"{flag} {path}: {base} exists and is not a folder")
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write there ({e.strerror})") from None


# The x86 instructions that run bf16 arithmetic natively; without them PyTorch emulates bf16 on
# a CPU, an order of magnitude slower than fp32 (tiny-h128 on a 2-core AVX2 EPYC: 1,597 against
# 11,887 real tokens/s).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPU_FP32_DS_CONFIG = "zero1_fp32.json"  # the same ZeRO stage as the default, in fp32


def cpu_runs_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bf16 instructions; where its flags cannot be read, assume it does
    (the stated default stays)."""
    try:
        words = set(cpuinfo.read_text(errors="replace").split())
    except OSError:
        return True
    return any(flag in words for flag in BF16_CPU_FLAGS)


def machine_ds_config(cuda: bool, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The engine JSON of a new run that names none: TrainConfig's default (bf16), but fp32 on
    a CPU without bf16 instructions."""
    if not cuda and not cpu_runs_bf16(cpuinfo):
        return CPU_FP32_DS_CONFIG
    return TrainConfig.ds_config


def resolve_ds_config_path(name: str) -> Path:
    """A bare file name is looked up in ds_configs/; anything else is a path."""
    path = Path(name)
    if not path.exists() and path.parent == Path("."):
        path = DS_CONFIG_DIR / name
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in DS_CONFIG_DIR.glob("*.json")))
        raise ConfigError(f"DeepSpeed config {name!r} not found (bundled: {known})")
    return path


def deepspeed_config(cfg: TrainConfig, plan: BatchPlan) -> dict[str, Any]:
    """The engine JSON from ds_configs/ plus the batch and clipping settings of ``cfg``."""
    path = resolve_ds_config_path(cfg.ds_config)
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    check_engine_json(ds, path)
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    per_parameter = PER_PARAMETER_OPTIMIZERS.get(cfg.optim.name)
    if per_parameter and stage == 3:
        raise ConfigError(f"{path}: {per_parameter[0]} with per-parameter {per_parameter[1]} supports ZeRO stages "
                          "0-2, not 3; use --optimizer adamw or a stage 0-2 config")
    if cfg.model.compile_layers and stage == 3:
        # ZeRO-3 gathers each Linear's weight in hooks around its forward: collectives that a
        # compiled layer (fullgraph) cannot hold
        raise ConfigError(f"{path}: --compile-layers supports ZeRO stages 0-2, not 3; "
                          "use a stage 0-2 config or leave the layers uncompiled")
    if per_parameter and stage == 0 and precision_of(ds) != "fp32":
        # DeepSpeed's stage-0 bf16/fp16 wrapper steps the optimizer once with zero gradients
        # at start-up; for LAMB that step is w -= lr * w wherever weight decay is on.
        raise ConfigError(f"{path}: {per_parameter[0]} needs ZeRO stage 1 or 2 with {precision_of(ds)} "
                          "(stage 0 is fp32 only); use zero1_* or --optimizer adamw")
    zero_cfg, bf16 = ds.get("zero_optimization", {}), ds.get("bf16", {})
    if _can_own_gradients(ds) and "compute_grad_norm" not in zero_cfg and "check_grad_overflow" not in bf16:
        zero_cfg["compute_grad_norm"] = False
        if precision_of(ds) == "bf16":
            bf16["check_grad_overflow"] = False
    elif zero_cfg.get("compute_grad_norm") is False and not step_owns_gradients(ds):
        raise ConfigError(f"{path}: zero_optimization.compute_grad_norm false needs bf16.check_grad_overflow false "
                          "as well (bert-ds then checks, measures and clips the gradients); set both or neither")
    ds.update(
        train_batch_size=plan.global_batch_size,
        train_micro_batch_size_per_gpu=plan.micro_batch_size,
        gradient_accumulation_steps=plan.grad_accum,
        # owned: the training step clips (bert_ds.train.step.clip_gradients)
        gradient_clipping=0.0 if step_owns_gradients(ds) else cfg.optim.grad_clip,
    )
    ds.setdefault("steps_per_print", 10**9)  # bert-ds does its own logging
    # DeepSpeed's throughput timer is on unless a config turns it off, and it synchronises the
    # device at every forward and every step: two stalls per step on a GPU. bert-ds measures
    # throughput itself; a config that names "timers" keeps its own choice.
    ds.setdefault("timers", {"throughput": {"enabled": False}})
    # bert-ds always hands DeepSpeed its own optimizer; LAMB binds to ZeRO's partitions.
    ds["zero_allow_untested_optimizer"] = True
    return ds


def step_owns_gradients(ds: dict[str, Any]) -> bool:
    """Whether the training step itself checks, measures and clips the gradients, and skips a
    non-finite step: under ZeRO-0 in fp32 (the engine steps the client optimizer, and
    :func:`deepspeed_config` turns the engine's clipping off) and under ZeRO-1/2's wrapper
    (``DeepSpeedZeroOptimizer``, in bf16 or fp32) where the engine config turns DeepSpeed's norm
    (``zero_optimization.compute_grad_norm``) and, in bf16, its overflow check
    (``bf16.check_grad_overflow``) off, as :func:`deepspeed_config` does unless the user's JSON
    sets either key.

    DeepSpeed's way costs, per step, about a dozen small kernels per gradient for the overflow
    check, two more per gradient for the norm, and four device reads (about 2,600 launches and
    the reads in a BERT-Base step). The step does all three with one fused norm over the
    gradients, summed in the all-reduce it makes anyway, and decides the skip and the clipping
    factor on the device (bert_ds.train.step): no device read at all.
    """
    if _steps_directly(ds):
        return True
    return (_can_own_gradients(ds) and ds["zero_optimization"].get("compute_grad_norm") is False
            and (precision_of(ds) != "bf16" or ds["bf16"].get("check_grad_overflow") is False))


def _steps_directly(ds: dict[str, Any]) -> bool:
    """ZeRO-0 in fp32: no DeepSpeed wrapper, the engine steps the client optimizer itself."""
    return ds.get("zero_optimization", {}).get("stage", 0) == 0 and precision_of(ds) == "fp32"


def _can_own_gradients(ds: dict[str, Any]) -> bool:
    """ZeRO-1/2 in bf16 or fp32: not ZeRO-0 or ZeRO-3, not fp16 (the loss scaler's overflows are
    DeepSpeed's), not CPU offload. In bf16 with fp32 gradient accumulation the step owns the
    gradients through :mod:`bert_ds.train.bf16_copy` (DeepSpeed's ``BF16_Optimizer``, which
    that layout otherwise gets at stage 1, checks them itself)."""
    zero_cfg = ds.get("zero_optimization", {})
    return (zero_cfg.get("stage", 0) in (1, 2) and precision_of(ds) != "fp16"
            and not zero_cfg.get("offload_optimizer") and not zero_cfg.get("cpu_offload"))


def runs_bf16_copy(ds: dict[str, Any]) -> bool:
    """Whether bert-ds runs this config's bf16 itself (:mod:`bert_ds.train.bf16_copy`): ZeRO-1/2
    in bf16 with fp32 gradient accumulation where the step owns the gradients (every shipped
    bf16 ZeRO-1/2 config). DeepSpeed then holds the fp32 weights (:func:`engine_json`), a bf16
    copy of the model computes, and each micro-batch's gradients are summed in fp32 in one flat
    buffer per param group: a few operations per micro-batch where DeepSpeed's ``BF16_Optimizer``
    makes two per parameter, and no device read in the step."""
    accum = ds.get("data_types", {}).get("grad_accum_dtype")
    return precision_of(ds) == "bf16" and accum in ("fp32", "float32") and step_owns_gradients(ds)


def engine_json(ds: dict[str, Any]) -> dict[str, Any]:
    """What ``deepspeed.initialize`` is given for the training config ``ds``: ``ds`` itself, but
    for :func:`runs_bf16_copy`'s layouts without its precision sections (the engine holds and
    steps fp32 weights; bert-ds runs the bf16 copy)."""
    if not runs_bf16_copy(ds):
        return ds
    return {k: v for k, v in ds.items() if k not in ("bf16", "bfloat16", "data_types")}


# Top-level engine settings that DeepSpeed reads as plain values, without a schema of its own:
# a wrong type there fails deep inside the engine, after the process group exists.
_DS_SCALARS: dict[str, tuple[tuple[type, ...], str]] = {
    "steps_per_print": ((int,), "an integer"),
    "wall_clock_breakdown": ((bool,), "true or false"),
    "memory_breakdown": ((bool,), "true or false"),
    "prescale_gradients": ((bool,), "true or false"),
    "gradient_predivide_factor": ((int, float), "a number"),
}
_COMM_DTYPES = (None, "fp32", "fp16", "bf16")
_PRECISION_KEYS = ("bf16", "bfloat16", "fp16")  # "bfloat16": DeepSpeed's older name for bf16


def check_engine_json(ds: Any, path: Path) -> None:
    """Reject, in one line, a DeepSpeed JSON that DeepSpeed would fail on only after start-up.

    DeepSpeed validates its ``zero_optimization``, ``bf16`` and ``fp16`` sections with pydantic
    models when the engine is built, and asserts on the rest; the same models run here, before
    any process group exists, and their ValidationError becomes one ConfigError.
    """
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: must hold a JSON object, got {type(ds).__name__}")
    clash = [k for k in _DERIVED_DS_KEYS if k in ds]
    if clash:
        raise ConfigError(f"{path}: sets {', '.join(clash)}, which bert-ds derives from the training config; remove them")
    for key, (types, what) in _DS_SCALARS.items():
        value = ds.get(key)
        if key in ds and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise ConfigError(f"{path}: {key} must be {what}, got {value!r}")
    if ds.get("communication_data_type") not in _COMM_DTYPES:
        raise ConfigError(f"{path}: communication_data_type must be fp32, fp16, bf16 or null, "
                          f"got {ds['communication_data_type']!r}")
    for key in ("zero_optimization", *_PRECISION_KEYS):
        if not isinstance(ds.get(key, {}), dict):
            raise ConfigError(f"{path}: {key} must be a JSON object, got {ds[key]!r}")
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):  # pydantic would also take "2" or true
        raise ConfigError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    enabled = [k for k in _PRECISION_KEYS if ds.get(k, {}).get("enabled") is True]
    if len(enabled) > 1:
        raise ConfigError(f"{path}: {' and '.join(enabled)} are both enabled; enable at most one")
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    models = {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config,
              "bfloat16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config}
    for key, model in models.items():
        if key in ds:
            _validate_section(ds[key], key, model, path)


def _validate_section(section: dict[str, Any], key: str, model: type, path: Path) -> None:
    from pydantic import ValidationError

    try:
        model(**section)
    except ValidationError as e:
        problems = [f"{'.'.join([key, *map(str, err['loc'])])}: {err['msg']} (got {err.get('input')!r})"
                    for err in e.errors()]
        raise ConfigError(f"{path}: {'; '.join(problems)}") from None


def precision_of(ds: dict[str, Any]) -> Literal["bf16", "fp16", "fp32"]:
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"
