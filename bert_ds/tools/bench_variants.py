"""The measuring half of :mod:`bert_ds.tools.bench`: its batches (synthetic, or real shards through
the training loader), the variants built from the same weights, and their timed loops.

The module docstring of :mod:`bert_ds.tools.bench` gives the design. The command imports this
module once its command line is read: it imports torch, the model and transformers, which
``--help`` does not need.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from bert_ds.base.errors import ConfigError, UserError
from bert_ds.config import BatchPlan
from bert_ds.kernels import probes
from bert_ds.kernels.ops import KernelUnavailable, OpPlan
from bert_ds.loader.pretraining import Batch, PretrainingLoader, SpecialTokens, collate, to_device
from bert_ds.model.bert import BertForPreTraining, ModelConfig, model_preset, pretraining_inputs
from bert_ds.model.flops import datasheet_peak_tflops, training_flops
from bert_ds.model.padding import IGNORE_INDEX
from bert_ds.tools.bench_settings import BenchSettings, Variant

FULL_LENGTH_PROB = 0.9  # BERT's short_seq_prob = 0.1
SENTENCE_OVERSHOOT = 40  # a chunk closes at the first sentence end past its target: up to ~1 sentence more
MASK_RATE = 0.15
# Synthetic special ids, in the order data_tools writes them: [PAD] [UNK] [CLS] [SEP] [MASK].
SYNTHETIC_SPECIAL = SpecialTokens(pad=0, unk=1, cls=2, sep=3, mask=4)


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
        model = BertForPreTraining(dataclasses.replace(cfg, kernels=kernels, compile_layers=v.compile_layers),
                                   train_seq_len=seq_len)
        model.load_state_dict(weights)
        shapes, loss_fn = model.op_shapes, bert_ds_loss
        ran = (model.backend.describe() if isinstance(model.backend, OpPlan)
               else {"cuda": "fused (all ops)", "torch": "torch"}[model.backend])
        if v.kernels == "fused" and device.type != "cuda":
            ran = "torch (no CUDA device)"
        if v.compile_layers:  # the layers' other ops are PyTorch's, for Inductor to fuse
            ran = f"layers compiled; attention: {ran}"
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

def run_config(s: BenchSettings, variants: list[Variant], preset: str, seq_len: int, device: torch.device,
               autocast) -> dict[str, Any]:
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
    for v in variants:
        key = v.key
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


def autocast_for(s: BenchSettings, device: torch.device) -> Callable[[], Any]:
    """The context every variant's forward runs in: bf16 autocast, or nothing (fp32)."""
    if s.precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext


def measure(s: BenchSettings, variants: list[Variant]) -> dict[str, Any]:
    """Every variant at every (preset, sequence length) of ``s``, with the probes and the environment."""
    if s.vocab_size <= SYNTHETIC_SPECIAL.first_regular:
        raise ConfigError(f"--vocab-size must be > {SYNTHETIC_SPECIAL.first_regular}, got {s.vocab_size}")
    if s.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    device = torch.device(s.device)
    autocast = autocast_for(s, device)
    load_before = os.getloadavg()[0]
    before = probes.measure(device) if s.probes else None
    configs = [run_config(s, variants, preset, seq_len, device, autocast)
               for preset in s.presets for seq_len in s.seq_lens]
    measured = probes.best_of(before, probes.measure(device)) if s.probes else {}
    return {
        "settings": dataclasses.asdict(s),
        "environment": {**probes.environment(device), "load_avg_1min_before": load_before,
                        "load_avg_1min_after": os.getloadavg()[0]},
        "probes": measured,
        "datasheet_bf16_tflops": datasheet_peak_tflops(torch.cuda.get_device_name(device))
        if device.type == "cuda" else None,
        "configs": configs,
    }
