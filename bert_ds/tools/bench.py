"""Training throughput of bert_ds against Hugging Face transformers, on the same device in one run.

    python -m bert_ds.tools.bench [--device cpu|cuda] [--preset base[,large]] [--seq-len 128[,512]]
                                  [--variants a,b,c] [--steps N] [--warmup N] [--data DIR]
                                  [--json FILE] [--markdown FILE]

For every (preset, sequence length) it times three ways to train the same BERT on the
same batches, one after the other, each a loop of loader -> host-to-device copy ->
forward -> backward -> optimizer step:

- (a) bert_ds: ``bert_ds.model.bert`` with ``kernels=cuda`` (every op fused; where that is
  impossible, the variant reports why and the others still run), unpadded, the MLM
  decoder on masked tokens only, and LAMB over flat groups as ZeRO-1 lays them out
  (``bert_ds.optim.flat.FlatLamb``, its update fused); on a CPU, ``kernels=auto``;
- (b) bert_ds with ``kernels=torch``: the same model on the PyTorch-native ops (varlen_attn on CUDA);
- (c) ``transformers.BertForPreTraining`` with SDPA attention and torch's fused AdamW,
  fed the padded batch and dense labels: what a user would otherwise run.

It prints a markdown table per configuration and the projection of the anchor run
(:mod:`bert_ds.tools.projection`); ``--json`` and ``--markdown`` keep every figure.

Design choices, and why:

- **Same work, checked.** All three start from the same weights (bert_ds's, loaded
  into transformers by name: the names are Hugging Face's) and see the same batches.
  Before timing, each computes the loss of the first batch without dropout; the losses
  are printed side by side, so a mismatch in weights or inputs cannot hide behind a
  speed-up. No DeepSpeed engine wraps any of them: its cost is the same for all three.
- **Precision.** bf16 autocast with fp32 weights and optimizer state on CUDA, the usual
  way to run transformers in bf16, given to all three alike; fp32 on CPU. ``--precision``
  overrides.
- **Batches.** ``--data DIR`` reads real shards through the training loader itself
  (``PretrainingDataset`` + ``PretrainingLoader``, ``--workers`` processes, pinned memory
  on CUDA). Without it, samples are synthetic and mimic that loader at sequence length
  S (:func:`synthetic_length`): full length with probability 0.9, otherwise BERT's short
  target U[2, S-3] plus up to a sentence of overshoot U[0, 40] plus 3 special tokens.
  On the bundled WikiText sample at S = 128 the loader gives 90.2% full-length samples
  and 124.1 tokens on average; this rule gives 92% and 123.7. Every sample is an NSP
  pair with 15% of its tokens masked, over BERT's 30,522 words (``--vocab-size``).
  Synthetic samples go through the same loader, so data time is measured the same way.
- **Batch size.** ``--batch-size``, or ``--tokens-per-step`` / S sequences (16,384 tokens
  on CUDA: 128 x 128 and 32 x 512; 4,096 on CPU).
- **Timing.** ``--warmup`` steps per variant run first and are excluded (allocator,
  cuBLAS heuristics, loader workers starting, kernel loading); then ``--steps`` timed
  steps. The timed window is wall time between two device synchronizations, so real
  tokens/s counts everything a training loop spends. Within it, *data wait* is the
  host's time blocked on the loader and issuing the copy to the device; the rest is
  compute. Per-step compute times come from CUDA events (no synchronization between
  steps) or, on CPU, the host clock; the process CPU time is recorded too.
- **One FLOPs accounting.** Useful FLOPs are :func:`bert_ds.model.flops.training_flops` for all
  three variants (the work a step must do, not what transformers spends on padding and
  unmasked logits), so MFU and tokens/s rank alike. MFU is against the datasheet dense
  bf16 peak (known GPUs) and against a matmul measured in the same run (the best of one
  probe before and one after the variants; :mod:`bert_ds.kernels.probes`), next to a copy probe.
- **Peak memory** per variant is ``torch.cuda.max_memory_allocated`` over its whole life
  (model, gradients, optimizer state, activations); the variants run one at a time and
  each is freed before the next. On CPU there is no per-variant figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from bert_ds.config import BatchPlan
from bert_ds.loader.pretraining import Batch, PretrainingLoader, SpecialTokens, collate, to_device
from bert_ds.base.errors import ConfigError, UserError, guarded
from bert_ds.model.flops import datasheet_peak_tflops, training_flops
from bert_ds.model.bert import PRESETS, BertForPreTraining, ModelConfig, model_preset, pretraining_inputs
from bert_ds.model.padding import IGNORE_INDEX
from bert_ds.tools.projection import ANCHOR, anchor_mfu, hours_minutes, project
from bert_ds.kernels import KernelUnavailable, OpPlan, probes

BERT_VOCAB_SIZE = 30522  # bert-base-uncased: the vocabulary of the published models
FULL_LENGTH_PROB = 0.9  # BERT's short_seq_prob = 0.1
SENTENCE_OVERSHOOT = 40  # a chunk closes at the first sentence end past its target: up to ~1 sentence more
MASK_RATE = 0.15
# Synthetic special ids, in the order data_tools writes them: [PAD] [UNK] [CLS] [SEP] [MASK].
SYNTHETIC_SPECIAL = SpecialTokens(pad=0, unk=1, cls=2, sep=3, mask=4)
TOKENS_PER_STEP = {"cpu": 4096, "cuda": 16384}
DEFAULT_STEPS = {"cpu": (1, 4), "cuda": (10, 30)}  # (warm-up, timed) per variant
# The issue's goals for a GPU in bf16: (a)'s tokens/s over (c)'s per sequence length, and (a)'s MFU.
SPEEDUP_GOALS = {128: 2.5, 512: 3.0}
MFU_GOAL = (128, 0.50)


@dataclass(frozen=True)
class Variant:
    key: str
    family: Literal["bert_ds", "transformers"]
    kernels: str  # bert_ds's kernels setting; "fused": every op fused on CUDA (see build_variant)
    optimizer: Literal["lamb", "adamw"]
    description: str


VARIANTS = {v.key: v for v in (
    Variant("a", "bert_ds", "fused", "lamb", "bert_ds: fused kernels, unpadded, sparse MLM decoder, LAMB"),
    Variant("b", "bert_ds", "torch", "lamb", "bert_ds: PyTorch-native ops, unpadded, sparse MLM decoder, LAMB"),
    Variant("c", "transformers", "", "adamw", "transformers BertForPreTraining: SDPA, padded, fused AdamW"),
)}
BASELINE = "c"


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{what} is empty")
    return values


@dataclass
class BenchSettings:
    device: str  # "cpu" or "cuda"
    precision: str  # "fp32", or "bf16" (autocast)
    presets: list[str]
    seq_lens: list[int]
    batch_size: int | None  # None: tokens_per_step // seq_len
    tokens_per_step: int
    steps: int  # timed steps per variant
    warmup: int  # untimed steps per variant before them
    variants: list[str]
    lr: float
    vocab_size: int  # synthetic batches only; real data brings its own
    data: str | None
    workers: int
    seed: int
    probes: bool

    def __post_init__(self) -> None:
        for name in ("steps", "tokens_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.warmup < 0 or self.workers < 0:
            raise ConfigError(f"--warmup and --workers must be >= 0, got {self.warmup} and {self.workers}")
        for seq_len in self.seq_lens:
            if not 8 <= seq_len <= 512:
                raise ConfigError(f"--seq-len must be in [8, 512], got {seq_len}")
        if self.vocab_size <= SYNTHETIC_SPECIAL.first_regular:
            raise ConfigError(f"--vocab-size must be > {SYNTHETIC_SPECIAL.first_regular}, got {self.vocab_size}")
        for preset in self.presets:
            if preset not in PRESETS:
                raise ConfigError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ConfigError(f"--variants takes a comma-separated subset of {','.join(VARIANTS)}, got "
                              f"{','.join(self.variants)!r}")
        if self.data is not None and not Path(self.data).is_dir():
            raise ConfigError(f"--data {self.data}: no such dataset folder")

    def batch_for(self, seq_len: int) -> int:
        return self.batch_size or max(1, self.tokens_per_step // seq_len)


# --------------------------------------------------------------------------- batches

def synthetic_length(rng: np.random.Generator, seq_len: int) -> int:
    """One sample's length in tokens, the way bert_ds.loader.pretraining chunks documents (see module doc)."""
    if rng.random() < FULL_LENGTH_PROB:
        return seq_len
    target = int(rng.integers(2, seq_len - 3 + 1))
    return min(seq_len, target + int(rng.integers(0, SENTENCE_OVERSHOOT + 1)) + 3)


def synthetic_sample(rng: np.random.Generator, seq_len: int, vocab_size: int) -> dict[str, Any]:
    """An NSP pair of random tokens, in the loader's sample format (unmasked ids never matter for speed)."""
    special = SYNTHETIC_SPECIAL
    n = synthetic_length(rng, seq_len)
    split = int(rng.integers(2, n - 1))  # [CLS] A [SEP] occupies [0, split]
    ids = rng.integers(special.first_regular, vocab_size, size=n)
    ids[0], ids[split], ids[-1] = special.cls, special.sep, special.sep
    types = np.zeros(n, dtype=np.int64)
    types[split + 1:] = 1
    candidates = np.flatnonzero(ids >= special.first_regular)
    chosen = rng.choice(candidates, size=max(1, round(len(candidates) * MASK_RATE)), replace=False)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    labels[chosen] = ids[chosen]
    ids[chosen] = special.mask
    return {"input_ids": ids, "token_type_ids": types, "labels": labels,
            "next_sentence_label": int(rng.integers(0, 2))}


class SyntheticPretraining(Dataset):
    """Synthetic samples by stream position, a pure function of (seed, position), for ``PretrainingLoader``."""

    special = SYNTHETIC_SPECIAL

    def __init__(self, seq_len: int, vocab_size: int, seed: int, num_samples: int = 2**31):
        self.seq_len, self.vocab_size, self.seed, self.num_samples = seq_len, vocab_size, seed, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, position: int) -> dict[str, Any]:
        return synthetic_sample(np.random.default_rng([self.seed, int(position)]), self.seq_len, self.vocab_size)


def open_samples(s: BenchSettings, seq_len: int) -> tuple[Dataset, str]:
    """The samples of one configuration, and where they come from."""
    if s.data is None:
        return (SyntheticPretraining(seq_len, s.vocab_size, s.seed),
                "synthetic (BERT's 90% full-length / 10% short targets, NSP pairs)")
    from bert_ds.config import DataConfig
    from bert_ds.loader.pretraining import PretrainingDataset

    return (PretrainingDataset(s.data, DataConfig(train=[s.data], max_seq_length=seq_len), s.seed),
            f"real shards: {s.data}")


def batch_counts(batch: Batch) -> dict[str, int]:
    lengths = batch["attention_mask"].sum(dim=1)
    return {"tokens": int(lengths.sum()), "sum_sq_len": int((lengths ** 2).sum()),
            "masked": batch["masked_labels"].numel(), "padded_tokens": batch["input_ids"].numel(),
            "full_length": int((lengths == batch["input_ids"].shape[1]).sum()), "width": batch["input_ids"].shape[1]}


def padded_dense_flops(cfg: ModelConfig, batch_size: int, width: int) -> float:
    """FLOPs of a training step that computes on padding and decodes every position (the transformers way).

    :func:`training_flops` with every (B, width) position a real, masked token of a
    width-long sequence: what a padded model with a dense MLM decoder really computes.
    """
    positions = batch_size * width
    return training_flops(cfg, positions, batch_size * width ** 2, positions)


# --------------------------------------------------------------------------- variants

def bert_ds_loss(model, batch: Batch) -> torch.Tensor:
    return model(**pretraining_inputs(batch)).loss


def transformers_loss(model, batch: Batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                 attention_mask=batch["attention_mask"], labels=batch["labels"],
                 next_sentence_label=batch["next_sentence_label"]).loss


def build_variant(v: Variant, cfg: ModelConfig, weights: dict[str, torch.Tensor], lr: float,
                  device: torch.device, seq_len: int) -> tuple[torch.nn.Module, Callable, torch.optim.Optimizer, str]:
    """Model (holding ``weights``), its loss function, its optimizer, and which kernels it runs.

    Variant (a) asks for ``kernels=cuda`` on a GPU: every op fused, or a
    :class:`KernelUnavailable` that says why, never a silent mix. On a CPU it runs
    ``kernels=auto``, which is the reference there.
    """
    from bert_ds.optim.builders import param_groups
    from bert_ds.optim.flat import FlatLamb

    kernels, shapes = "auto", None
    if v.family == "bert_ds":
        kernels = v.kernels if v.kernels != "fused" else "cuda" if device.type == "cuda" else "auto"
        model = BertForPreTraining(dataclasses.replace(cfg, kernels=kernels), train_seq_len=seq_len)
        model.load_state_dict(weights)
        shapes, loss_fn = model.op_shapes, bert_ds_loss
        ran = (model.backend.describe() if isinstance(model.backend, OpPlan)
               else {"cuda": "fused (all ops)", "torch": "torch"}[model.backend])
        if v.kernels == "fused" and device.type != "cuda":
            ran = "torch (no CUDA device)"
    else:
        import transformers

        from bert_ds.checkpoint.export import to_hf_config

        model = transformers.BertForPreTraining(to_hf_config(cfg))
        model.set_attn_implementation("sdpa")
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"transformers does not take bert_ds's weights: missing {missing}, "
                               f"unexpected {unexpected}")
        loss_fn, ran = transformers_loss, "SDPA"
    model = model.to(device).train()
    groups = param_groups(model, weight_decay=0.01)
    # LAMB over flat groups as ZeRO-1 lays them out: the update a training run makes (fused on a GPU)
    optimizer = (FlatLamb(groups, lr=lr, kernels=kernels, shapes=shapes) if v.optimizer == "lamb" else
                 torch.optim.AdamW(groups, lr=lr, fused=True))
    return model, loss_fn, optimizer, ran


@dataclass
class Timings:
    wall_s: float  # the timed window: everything a training loop spends
    data_wait_s: float  # host time blocked on the loader and issuing the device copy
    step_s: list[float]  # compute per step (CUDA events, or the host clock on CPU)
    cpu_s: float  # process CPU time (all threads) over the window


def time_variant(model, loss_fn, optimizer, loader: PretrainingLoader, s: BenchSettings,
                 device: torch.device, autocast) -> Timings:
    cuda = device.type == "cuda"
    marks: list[tuple[Any, Any]] = []
    data_wait = 0.0
    for i in range(s.warmup + s.steps):
        if i == s.warmup:
            probes.synchronize(device)
            t_start, c_start = time.perf_counter(), time.process_time()
            data_wait, marks = 0.0, []
        t0 = time.perf_counter()
        batch = to_device(loader.next_step()[0], device, non_blocking=True)
        data_wait += time.perf_counter() - t0
        begin = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            begin.record()
        with autocast():
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        marks.append((begin, end))
    probes.synchronize(device)
    wall, cpu = time.perf_counter() - t_start, time.process_time() - c_start
    steps = [b.elapsed_time(e) / 1e3 for b, e in marks] if cuda else [e - b for b, e in marks]
    return Timings(wall, data_wait, steps, cpu)


def first_batch_loss(model, loss_fn, batch: Batch, autocast) -> float:
    """The loss of one batch without dropout: the same weights and inputs give the same loss."""
    model.eval()
    with torch.no_grad(), autocast():
        loss = float(loss_fn(model, batch))
    model.train()
    return loss


# --------------------------------------------------------------------------- the run

def run_config(s: BenchSettings, preset: str, seq_len: int, device: torch.device, autocast) -> dict[str, Any]:
    """Every variant on one (preset, sequence length)."""
    samples, source = open_samples(s, seq_len)
    batch_size = s.batch_for(seq_len)
    pad = samples.special.pad
    cfg = model_preset(preset, samples.vocab_size, pad_token_id=pad)
    torch.manual_seed(s.seed)
    weights = BertForPreTraining(dataclasses.replace(cfg, kernels="torch")).state_dict()
    batches_at = [list(range(i * batch_size, (i + 1) * batch_size)) for i in range(s.warmup + s.steps)]
    timed = [batch_counts(collate([samples[p] for p in positions], pad)) for positions in batches_at[s.warmup:]]
    first = to_device(collate([samples[p] for p in batches_at[0]], pad), device)
    plan = BatchPlan.resolve(batch_size, batch_size, world_size=1)

    tokens = sum(c["tokens"] for c in timed)
    useful = sum(training_flops(cfg, c["tokens"], c["sum_sq_len"], c["masked"]) for c in timed)
    dense = sum(padded_dense_flops(cfg, batch_size, c["width"]) for c in timed)
    results = {}
    for key in s.variants:
        v = VARIANTS[key]
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            model, loss_fn, optimizer, kernels = build_variant(v, cfg, weights, s.lr, device, seq_len)
            loss = first_batch_loss(model, loss_fn, first, autocast)
            loader = PretrainingLoader(samples, plan, rank=0, num_workers=s.workers,
                                       pin_memory=device.type == "cuda")
            t = time_variant(model, loss_fn, optimizer, loader, s, device, autocast)
        except KernelUnavailable as err:
            results[key] = {"description": v.description, "not_run": str(err)}
            continue
        finally:
            model = optimizer = loader = None  # freed before the next variant's peak memory is measured
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        results[key] = {
            "description": v.description, "kernels": kernels, "optimizer": v.optimizer,
            "first_batch_loss": loss,
            "ms_per_step": 1e3 * t.wall_s / s.steps,
            "compute_ms_per_step_median": 1e3 * statistics.median(t.step_s),
            "compute_ms_per_step_min": 1e3 * min(t.step_s),
            "data_wait_ms_per_step": 1e3 * t.data_wait_s / s.steps,
            "data_wait_share": t.data_wait_s / t.wall_s,
            "cpu_s_per_step": t.cpu_s / s.steps,
            "real_tokens_per_s": tokens / t.wall_s,
            "useful_tflops": useful / t.wall_s / 1e12,
            "peak_memory_gib": peak,
        }
    return {
        "preset": preset, "seq_len": seq_len, "batch_size": batch_size, "source": source,
        "vocab_size": samples.vocab_size,
        "batches": {
            "mean_real_length": tokens / (len(timed) * batch_size),
            "full_length_share": sum(c["full_length"] for c in timed) / (len(timed) * batch_size),
            "padding_share": 1 - tokens / sum(c["padded_tokens"] for c in timed),
            "masked_per_step": sum(c["masked"] for c in timed) / len(timed),
            "real_tokens_per_step": tokens / len(timed),
            "sum_sq_len_per_step": sum(c["sum_sq_len"] for c in timed) / len(timed),
            "useful_gflop_per_step": useful / len(timed) / 1e9,
            "padded_dense_gflop_per_step": dense / len(timed) / 1e9,
        },
        "results": results,
    }


def add_rates(result: dict[str, Any]) -> None:
    """MFU against both peaks and the speed-up over the baseline, once the probes are in."""
    peak, measured = result["datasheet_bf16_tflops"], result["probes"].get("matmul_tflops")
    for config in result["configs"]:
        base = config["results"].get(BASELINE)
        base = None if base is None or "not_run" in base else base
        for x in config["results"].values():
            if "not_run" in x:
                continue
            x["mfu_vs_datasheet_bf16"] = x["useful_tflops"] / peak if peak else None
            x["mfu_vs_matmul"] = x["useful_tflops"] / measured if measured else None
            x["speedup_vs_transformers"] = x["real_tokens_per_s"] / base["real_tokens_per_s"] if base else None


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU goals, each with its measured figure; only for BERT-Base runs on CUDA."""
    if result["settings"]["device"] != "cuda":
        return []
    out = []
    for config in result["configs"]:
        if config["preset"] != "base" or "a" not in config["results"]:
            continue
        a, seq = config["results"]["a"], config["seq_len"]
        if "not_run" in a:
            out.append({"goal": f"(a) at seq {seq}", "measured": f"not run: {a['not_run']}", "met": False})
            continue
        if seq in SPEEDUP_GOALS and a["speedup_vs_transformers"] is not None:
            out.append({"goal": f"(a) >= {SPEEDUP_GOALS[seq]}x the real tokens/s of (c) at seq {seq}",
                        "measured": f"{a['speedup_vs_transformers']:.2f}x",
                        "met": a["speedup_vs_transformers"] >= SPEEDUP_GOALS[seq]})
        if seq == MFU_GOAL[0] and a["mfu_vs_datasheet_bf16"] is not None:
            out.append({"goal": f"(a) >= {MFU_GOAL[1]:.0%} MFU against the datasheet bf16 peak at seq {seq}",
                        "measured": f"{a['mfu_vs_datasheet_bf16']:.1%}", "met": a["mfu_vs_datasheet_bf16"] >= MFU_GOAL[1]})
    return out


def projection(result: dict[str, Any]) -> dict[str, Any]:
    """The anchor run (BERT-Base, 32.8B tokens, 8x A100) at each variant's MFU against the datasheet peak.

    Without a datasheet peak (a CPU, an unknown GPU) there is no MFU to carry to an A100:
    ``variants`` is then empty and ``why`` says so; the anchor's own figures are still given.
    """
    configs = result["configs"]
    config = next((c for c in configs if c["seq_len"] == 128 and c["preset"] == "base"),
                  next((c for c in configs if c["seq_len"] == 128), configs[0]))
    b = config["batches"]
    # BERT-Base FLOPs per real token for these batches' lengths and masks (linear in the counts).
    base = model_preset("base", BERT_VOCAB_SIZE)
    per_token = training_flops(base, b["real_tokens_per_step"], b["sum_sq_len_per_step"],
                               b["masked_per_step"]) / b["real_tokens_per_step"]
    rows = {key: project(x["mfu_vs_datasheet_bf16"], per_token) for key, x in config["results"].items()
            if "not_run" not in x and x["mfu_vs_datasheet_bf16"]}
    why = "" if rows else (f"no MFU against a datasheet bf16 peak was measured on {result['environment']['device']}"
                           ": nothing to carry to an A100")
    return {"from": {"preset": config["preset"], "seq_len": config["seq_len"]}, "flops_per_token": per_token,
            "anchor": dataclasses.asdict(ANCHOR), "anchor_tokens_per_s_per_gpu": ANCHOR.tokens_per_s_per_gpu,
            "anchor_mfu": anchor_mfu(per_token), "variants": rows, "why": why}


def autocast_for(s: BenchSettings, device: torch.device) -> Callable[[], Any]:
    """The context every variant's forward runs in: bf16 autocast, or nothing (fp32)."""
    if s.precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext


def run(s: BenchSettings) -> dict[str, Any]:
    if s.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    device = torch.device(s.device)
    autocast = autocast_for(s, device)
    load_before = os.getloadavg()[0]
    before = probes.measure(device) if s.probes else None
    configs = [run_config(s, preset, seq_len, device, autocast) for preset in s.presets for seq_len in s.seq_lens]
    measured = probes.best_of(before, probes.measure(device)) if s.probes else {}
    result = {
        "settings": dataclasses.asdict(s),
        "environment": {**probes.environment(device), "load_avg_1min_before": load_before,
                        "load_avg_1min_after": os.getloadavg()[0]},
        "probes": measured,
        "datasheet_bf16_tflops": datasheet_peak_tflops(torch.cuda.get_device_name(device))
        if device.type == "cuda" else None,
        "configs": configs,
    }
    add_rates(result)
    result["goals"] = goals(result)
    result["projection"] = projection(result)
    return result


# --------------------------------------------------------------------------- report

def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None else format(x, spec) + suffix


def markdown(r: dict[str, Any]) -> str:
    s, env = r["settings"], r["environment"]
    lines = [
        "# BERT pretraining throughput: bert_ds against transformers",
        "",
        f"- device: {env['device']}" + (f" (driver {env['driver']}, CUDA {env['cuda']})" if env.get("driver") else "")
        + f"; torch {env['torch']}; commit {(env['git_commit'] or '?')[:12]}{' (dirty)' if env['git_dirty'] else ''}",
        f"- precision: {s['precision']}" + (" autocast, fp32 weights and optimizer state" if s["precision"] == "bf16"
                                           else ""),
        f"- timing: per variant, {s['warmup']} warm-up step(s) excluded, then {s['steps']} timed step(s); "
        f"loader workers {s['workers']}; load average {env['load_avg_1min_before']:.2f} before, "
        f"{env['load_avg_1min_after']:.2f} after",
    ]
    if r["probes"]:
        p = r["probes"]
        lines.append(f"- probes (same run): matmul {p['matmul']} {p['matmul_tflops']:.3f} TFLOP/s, "
                     f"copy {p['copy_gb_per_s']:.1f} GB/s"
                     + (f"; datasheet bf16 dense peak {r['datasheet_bf16_tflops']:.0f} TFLOP/s"
                        if r["datasheet_bf16_tflops"] else ""))
    for c in r["configs"]:
        b = c["batches"]
        lines += [
            "", f"## {c['preset']}, seq {c['seq_len']}, batch {c['batch_size']}", "",
            f"{c['source']}; vocabulary {c['vocab_size']:,}; {b['mean_real_length']:.1f} real tokens/sample, "
            f"{b['full_length_share']:.0%} full length, {b['padding_share']:.1%} padding, "
            f"{b['masked_per_step']:.0f} masked tokens/step. Work per step: {b['useful_gflop_per_step']:,.1f} GFLOP "
            f"useful (the accounting of bert_ds/model/flops.py), {b['padded_dense_gflop_per_step']:,.1f} GFLOP computed "
            f"by a padded model with a dense MLM decoder ({b['padded_dense_gflop_per_step'] / b['useful_gflop_per_step']:.2f}x).",
            "",
            "| variant | kernels | ms/step | real tokens/s | vs (c) | data wait | useful TFLOP/s | MFU datasheet "
            "| MFU matmul | peak memory | first-batch loss |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for key, x in c["results"].items():
            if "not_run" in x:
                lines.append(f"| ({key}) {x['description']} | not run: {x['not_run']} |" + " |" * 9)
                continue
            lines.append(
                f"| ({key}) {x['description']} | {x['kernels']} | {x['ms_per_step']:,.1f} | "
                f"{x['real_tokens_per_s']:,.0f} | {_fmt(x['speedup_vs_transformers'], '.2f', 'x')} | "
                f"{x['data_wait_share']:.1%} | {x['useful_tflops']:.3f} | "
                f"{_fmt(x['mfu_vs_datasheet_bf16'], '.1%')} | {_fmt(x['mfu_vs_matmul'], '.1%')} | "
                f"{_fmt(x['peak_memory_gib'], '.2f', ' GiB')} | {x['first_batch_loss']:.4f} |")
    if r["goals"]:
        lines += ["", "## Goals", ""]
        lines += [f"- {g['goal']}: measured {g['measured']}, **{'met' if g['met'] else 'not met'}**" for g in r["goals"]]
    lines += projection_markdown(r["projection"])
    return "\n".join(lines)


def projection_markdown(p: dict[str, Any]) -> list[str]:
    a = p["anchor"]
    peak = ANCHOR.peak_flops / 1e12
    f = p["flops_per_token"]
    lines = [
        "", "## Projection: the anchor run at the measured MFU", "",
        f"Anchor: {a['source']}: {a['tokens'] / 1e9:.1f}B tokens in {hours_minutes(a['seconds'])} "
        f"= {a['tokens']:.3g} / ({a['seconds']:,.0f} s x {a['gpus']}) = {p['anchor_tokens_per_s_per_gpu']:,.0f} "
        f"tokens/s per GPU.",
        f"BERT-Base FLOPs per real token (training, this run's lengths and masks at seq {p['from']['seq_len']}): "
        f"{f / 1e9:.3f} GFLOP, so the anchor's MFU is {p['anchor_tokens_per_s_per_gpu']:,.0f} x {f / 1e9:.3f} GFLOP "
        f"/ {peak:.0f} TFLOP/s = {p['anchor_mfu']:.1%}.",
    ]
    if not p["variants"]:
        return lines + ["", f"No projection: {p['why']}."]
    lines += [
        f"At MFU m (against the datasheet bf16 peak, measured at {p['from']['preset']}, seq {p['from']['seq_len']}): "
        f"tokens/s per A100 = m x {peak:.0f} TFLOP/s / {f / 1e9:.3f} GFLOP; time = {a['tokens'] / 1e9:.1f}B / "
        f"({a['gpus']} x tokens/s per A100). Assumes the MFU carries over to an A100 and perfect 8-GPU data "
        "parallelism (see bert_ds/tools/projection.py).",
        "", "| variant | MFU | tokens/s per A100 | 32.8B tokens on 8x A100 | vs anchor |", "|---|---:|---:|---:|---:|",
        f"| anchor (HF under Composer, reported) | {p['anchor_mfu']:.1%} | {p['anchor_tokens_per_s_per_gpu']:,.0f} | "
        f"{hours_minutes(a['seconds'])} | 1.00x |",
    ]
    for key, x in p["variants"].items():
        lines.append(f"| ({key}) | {x['mfu']:.1%} | {x['tokens_per_s_per_gpu']:,.0f} | {hours_minutes(x['seconds'])} | "
                     f"{x['speedup']:.2f}x |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m bert_ds.tools.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                   help="fp32, or bf16 autocast for every variant (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--preset", default="base", help=f"comma-separated model sizes: {', '.join(PRESETS)}")
    p.add_argument("--seq-len", default=None, help="comma-separated sequence lengths (default: 128,512 on cuda, "
                   "128 on cpu)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: tokens-per-step / S)")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help=f"sets the batch size when --batch-size is not given (default: {TOKENS_PER_STEP})")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per variant (default: {DEFAULT_STEPS})")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per variant before the timed ones")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated subset: " + "; ".join(f"{k}: {v.description}" for k, v in VARIANTS.items()))
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of every optimizer")
    p.add_argument("--data", default=None, help="dataset folder (data_tools build): batches from real shards")
    p.add_argument("--workers", type=int, default=None, help="loader worker processes (default: 2 on cuda, 0 on cpu)")
    p.add_argument("--vocab-size", type=int, default=BERT_VOCAB_SIZE, help="vocabulary of synthetic batches")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-probes", action="store_true", help="skip the matmul and copy probes")
    p.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    p.add_argument("--markdown", type=Path, default=None, help="also write the report to this markdown file")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    device = args.device
    warmup, steps = DEFAULT_STEPS[device]
    return BenchSettings(
        device=device, precision=args.precision or ("bf16" if device == "cuda" else "fp32"),
        presets=[x.strip() for x in args.preset.split(",") if x.strip()],
        seq_lens=_int_list(args.seq_len or ("128,512" if device == "cuda" else "128"), "--seq-len"),
        batch_size=args.batch_size, tokens_per_step=args.tokens_per_step or TOKENS_PER_STEP[device],
        steps=steps if args.steps is None else args.steps, warmup=warmup if args.warmup is None else args.warmup,
        variants=[x.strip() for x in args.variants.split(",") if x.strip()], lr=args.lr,
        vocab_size=args.vocab_size, data=args.data,
        workers=(2 if device == "cuda" else 0) if args.workers is None else args.workers,
        seed=args.seed, probes=not args.no_probes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return guarded(lambda: _bench(args))


def _bench(args: argparse.Namespace) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = run(settings_from(args))
    write_report(markdown(result), result, args.json, args.markdown)


def write_report(text: str, result: dict[str, Any], json_path: Path | None, markdown_path: Path | None) -> None:
    """Print the markdown report; also write it, and every figure as JSON, where asked."""
    print(text, flush=True)
    for path, content in ((json_path, json.dumps(result, indent=2) + "\n"), (markdown_path, text + "\n")):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)


if __name__ == "__main__":
    sys.exit(main())
