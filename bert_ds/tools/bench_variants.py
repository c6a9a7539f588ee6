"""The measuring half of :mod:`bert_ds.tools.bench`: its batches (synthetic, or real shards through
the training loader), the variants built from the same weights, the first-batch loss check, and
their timed loops.

The module docstring of :mod:`bert_ds.tools.bench` gives the design. The command imports this
module once its command line is read: it imports torch, the model and transformers, which
``--help`` does not need.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from bert_ds.base.errors import ConfigError, Failure, UserError
from bert_ds.config import BatchPlan
from bert_ds.kernels import probes
from bert_ds.kernels.ops import KernelUnavailable, OpPlan
from bert_ds.loader.pretraining import Batch, PretrainingLoader, SpecialTokens, collate, to_device
from bert_ds.model.padding import pretraining_inputs
from bert_ds.model.build import build_model
from bert_ds.model.family import BenchVariant
from bert_ds.model.families import AnyModelConfig, family_of, model_preset
from bert_ds.kernels.local_attention import local_pairs
from bert_ds.model.flops import datasheet_peak_tflops, training_flops
from bert_ds.model.padding import IGNORE_INDEX
from bert_ds.tools.bench_settings import BenchSettings

FULL_LENGTH_PROB = 0.9  # BERT's short_seq_prob = 0.1; the share of a documents layout's full pieces alike
SENTENCE_OVERSHOOT = 40  # a chunk closes at the first sentence end past its target: up to ~1 sentence more
# Synthetic special ids, in the order data_tools writes them: [PAD] [UNK] [CLS] [SEP] [MASK].
SYNTHETIC_SPECIAL = SpecialTokens(pad=0, unk=1, cls=2, sep=3, mask=4)
# The first-batch loss check's allowance beyond twice the reference's own rounding error, relative
# to the loss: fp32 1e-4 of it; bf16 one step of its 8 significant bits, 2^-8
# (the BERT variants' bf16 losses agreed to 1e-4 of 11.2 on an H100 and an H200).
LOSS_SLACK = {"fp32": 1e-4, "bf16": 2.0 ** -8}


class VariantUnavailable(Exception):
    """A variant that cannot run here (a package or a device it needs): its row says why."""


class LossMismatch(Failure):
    """A variant's first-batch loss is not the reference's: it does not compute the same model on
    the same batch, and a speed-up over it would mean nothing."""


# --------------------------------------------------------------------------- batches

def synthetic_length(rng: np.random.Generator, seq_len: int) -> int:
    """One sample's length in tokens, the way bert_ds.loader.pretraining chunks documents (see module doc)."""
    if rng.random() < FULL_LENGTH_PROB:
        return seq_len
    target = int(rng.integers(2, seq_len - 3 + 1))
    return min(seq_len, target + int(rng.integers(0, SENTENCE_OVERSHOOT + 1)) + 3)


def piece_length(rng: np.random.Generator, seq_len: int) -> int:
    """One sample's length in the documents layout: a full piece of a longer document, or with
    probability 1 - FULL_LENGTH_PROB a document's last piece, U[3, S] tokens ([CLS] and [SEP] in)."""
    return seq_len if rng.random() < FULL_LENGTH_PROB else int(rng.integers(3, seq_len + 1))


def _mask(rng: np.random.Generator, ids: np.ndarray, rate: float) -> np.ndarray:
    """Puts [MASK] on ``rate`` of the regular tokens of ``ids`` (in place) and returns the labels."""
    special = SYNTHETIC_SPECIAL
    candidates = np.flatnonzero(ids >= special.first_regular)
    chosen = rng.choice(candidates, size=max(1, round(len(candidates) * rate)), replace=False)
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    labels[chosen] = ids[chosen]
    ids[chosen] = special.mask
    return labels


def synthetic_sample(rng: np.random.Generator, seq_len: int, vocab_size: int, mask_rate: float) -> dict[str, Any]:
    """An NSP pair of random tokens, in the loader's sample format (unmasked ids never matter for speed)."""
    special = SYNTHETIC_SPECIAL
    n = synthetic_length(rng, seq_len)
    split = int(rng.integers(2, n - 1))  # [CLS] A [SEP] occupies [0, split]
    ids = rng.integers(special.first_regular, vocab_size, size=n)
    ids[0], ids[split], ids[-1] = special.cls, special.sep, special.sep
    types = np.zeros(n, dtype=np.int64)
    types[split + 1:] = 1
    labels = _mask(rng, ids, mask_rate)
    return {"input_ids": ids, "token_type_ids": types, "labels": labels,
            "next_sentence_label": int(rng.integers(0, 2))}


def synthetic_piece(rng: np.random.Generator, seq_len: int, vocab_size: int, mask_rate: float) -> dict[str, Any]:
    """``[CLS] piece [SEP]`` of random tokens, the documents layout's sample: no pair, no label."""
    special = SYNTHETIC_SPECIAL
    n = piece_length(rng, seq_len)
    ids = rng.integers(special.first_regular, vocab_size, size=n)
    ids[0], ids[-1] = special.cls, special.sep
    labels = _mask(rng, ids, mask_rate)
    return {"input_ids": ids, "token_type_ids": np.zeros(n, dtype=np.int64), "labels": labels,
            "next_sentence_label": -1}


class SyntheticPretraining(Dataset):
    """Synthetic samples by stream position, a pure function of (seed, position), for ``PretrainingLoader``,
    in a family's data layout (``data``: its ``data_defaults``): sentence pairs, or with the documents
    layout its pieces, masked at its rate."""

    special = SYNTHETIC_SPECIAL

    def __init__(self, seq_len: int, vocab_size: int, seed: int, data: Mapping[str, Any], num_samples: int = 2**31):
        self.seq_len, self.vocab_size, self.seed, self.num_samples = seq_len, vocab_size, seed, num_samples
        self.mask_rate = data["mask_rate"]
        self.draw = synthetic_piece if data["layout"] == "documents" else synthetic_sample

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, position: int) -> dict[str, Any]:
        rng = np.random.default_rng([self.seed, int(position)])
        return self.draw(rng, self.seq_len, self.vocab_size, self.mask_rate)


def synthetic_source(data: Mapping[str, Any]) -> str:
    """What :class:`SyntheticPretraining` draws in a family's data layout, for the report."""
    if data["layout"] == "documents":
        return (f"synthetic (documents layout: 90% full-length pieces / 10% a document's last piece, no pairs, "
                f"{data['mask_rate']:.0%} masked)")
    return f"synthetic (90% full-length / 10% short targets, {data['pair_task']} pairs, {data['mask_rate']:.0%} masked)"


def open_samples(s: BenchSettings, seq_len: int) -> tuple[Dataset, str]:
    """The samples of one configuration, and where they come from: the model family's data
    settings (its record's ``data_defaults``), with a fixed number of samples per batch (no token
    budget), so that every variant sees the same batches."""
    defaults = s.family.data_defaults
    if s.data is None:
        return SyntheticPretraining(seq_len, s.vocab_size, s.seed, defaults), synthetic_source(defaults)
    from bert_ds.config import DataConfig
    from bert_ds.loader.pretraining import PretrainingDataset

    data = {**defaults, "token_budget": False}
    return (PretrainingDataset(s.data, DataConfig(train=[s.data], max_seq_length=seq_len, **data), s.seed),
            f"real shards: {s.data}")


def local_window(cfg: AnyModelConfig) -> int:
    """Tokens on each side a local layer attends to; 0 for a model without local layers."""
    return family_of(cfg).local_window(cfg)


def batch_counts(batch: Batch, window: int = 0) -> dict[str, int]:
    """What the FLOPs accounting needs of one batch; ``window``: the local layers' (0: none)."""
    lengths = batch["attention_mask"].sum(dim=1)
    return {"tokens": int(lengths.sum()), "sum_sq_len": int((lengths ** 2).sum()),
            "local_pairs": int(local_pairs(lengths, window).sum()) if window else 0,
            "masked": batch["masked_labels"].numel(), "padded_tokens": batch["input_ids"].numel(),
            "full_length": int((lengths == batch["input_ids"].shape[1]).sum()), "width": batch["input_ids"].shape[1]}


def padded_dense_flops(cfg: AnyModelConfig, batch_size: int, width: int) -> float:
    """FLOPs of a training step that computes on padding and decodes every position (the transformers way).

    :func:`training_flops` with every (B, width) position a real, masked token of a
    width-long sequence, and every layer attending to all of it: what a padded model with a
    dense MLM decoder really computes (transformers' SDPA takes a local window as a mask over
    the whole row, so its local layers compute every pair too).
    """
    positions = batch_size * width
    return training_flops(cfg, positions, batch_size * width ** 2, positions, local_pairs=batch_size * width ** 2)


# --------------------------------------------------------------------------- variants

def bert_ds_loss(model, batch: Batch) -> torch.Tensor:
    return model(**pretraining_inputs(batch)).loss


def transformers_pair_loss(model, batch: Batch) -> torch.Tensor:
    """A transformers class with a sentence-pair head (``BertForPreTraining``): MLM and NSP on the padded batch."""
    return model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                 attention_mask=batch["attention_mask"], labels=batch["labels"],
                 next_sentence_label=batch["next_sentence_label"]).loss


def transformers_mlm_loss(model, batch: Batch) -> torch.Tensor:
    """A masked-LM class (``ModernBertForMaskedLM``): MLM on the padded batch (no segments, no pair task)."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss


def attention_problem(attention: str, device: torch.device) -> str | None:
    """Why transformers cannot run ``attn_implementation=attention`` here, or None where it can."""
    if attention != "flash_attention_2":
        return None
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed (transformers' flash_attention_2 needs it)"
    if device.type != "cuda":
        return "flash_attention_2 runs on a CUDA device only"
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return "transformers does not take the installed flash-attn (is_flash_attn_2_available() is False)"
    return None


def bert_ds_model(v: BenchVariant, cfg: AnyModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                  seq_len: int) -> tuple[torch.nn.Module, str]:
    """bert_ds's model of ``cfg``'s family holding ``weights``, and which kernels it runs.

    BERT's (a) asks for ``kernels=cuda`` on a GPU: every op fused, or a
    :class:`KernelUnavailable` that says why, never a silent mix. On a CPU it runs
    ``kernels=auto``, which is the reference there.
    """
    kernels = v.kernels if v.kernels != "fused" else "cuda" if device.type == "cuda" else "auto"
    model = build_model(dataclasses.replace(cfg, kernels=kernels, compile_layers=v.compile_layers),
                        train_seq_len=seq_len)
    model.load_state_dict(weights)
    ran = (model.backend.describe() if isinstance(model.backend, OpPlan)
           else {"cuda": "fused (all ops)", "torch": "torch"}[model.backend])
    if v.kernels == "fused" and device.type != "cuda":
        ran = "torch (no CUDA device)"
    if v.compile_layers:  # the layers' other ops are PyTorch's, for Inductor to fuse
        ran = f"layers compiled; attention: {ran}"
    return model, ran


def transformers_model(v: BenchVariant, cfg: AnyModelConfig, weights: dict[str, torch.Tensor],
                       device: torch.device) -> tuple[torch.nn.Module, str]:
    """transformers' class of ``cfg``'s family, configured and named by the export's mapping
    (the family record's ``hf``), holding ``weights``, with ``v``'s attention."""
    import transformers

    problem = attention_problem(v.attention, device)
    if problem:
        raise VariantUnavailable(problem)
    hf = family_of(cfg).hf
    model = getattr(transformers, hf.transformers_class)(hf.hf_config(cfg))
    model.set_attn_implementation(v.attention)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"transformers' {hf.transformers_class} does not take bert_ds's weights: "
                           f"missing {missing}, unexpected {unexpected}")
    return model, {"sdpa": "SDPA"}.get(v.attention, v.attention)


def build_optimizer(v: BenchVariant, model: torch.nn.Module, lr: float, kernels: str, shapes) -> torch.optim.Optimizer:
    """``v``'s optimizer over ``model``, built once the model is on its device."""
    from bert_ds.optim.builders import param_groups
    from bert_ds.optim.flat import FlatLamb
    from bert_ds.optim.stable_adamw import StableAdamW

    if v.optimizer == "lamb":  # LAMB over flat groups as ZeRO-1 lays them out: a training run's update
        return FlatLamb(param_groups(model, weight_decay=0.01), lr=lr, kernels=kernels, shapes=shapes)
    if v.optimizer == "stable_adamw":  # ModernBERT's recipe: betas (0.9, 0.98), eps 1e-6, decoupled decay 1e-5
        return StableAdamW(param_groups(model, weight_decay=1e-5), lr=lr, betas=(0.9, 0.98), eps=1e-6,
                           decouple_lr=True)
    return torch.optim.AdamW(param_groups(model, weight_decay=0.01), lr=lr, fused=True)


def build_variant(v: BenchVariant, cfg: AnyModelConfig, weights: dict[str, torch.Tensor], lr: float,
                  device: torch.device, seq_len: int) -> tuple[torch.nn.Module, Callable, torch.optim.Optimizer, str]:
    """Model (holding ``weights``), its loss function, its optimizer, and which kernels it runs."""
    if v.runner == "bert_ds":
        model, ran = bert_ds_model(v, cfg, weights, device, seq_len)
        loss_fn, kernels, shapes = bert_ds_loss, model.config.kernels, model.op_shapes
    else:
        model, ran = transformers_model(v, cfg, weights, device)
        pair_head = family_of(cfg).hf.pair_head
        loss_fn, kernels, shapes = transformers_pair_loss if pair_head else transformers_mlm_loss, "auto", None
    model = model.to(device).train()
    return model, loss_fn, build_optimizer(v, model, lr, kernels, shapes), ran


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


@dataclass(frozen=True)
class LossCheck:
    """The first-batch loss every variant must give before it is timed.

    The reference is bert_ds's model on PyTorch's ops. A variant's loss may differ from the
    reference's fp32 loss by twice the reference's own error in the run's precision (its loss
    there against its fp32 loss) plus :data:`LOSS_SLACK` of the loss: the rule the kernels are
    tested by (twice the same-dtype PyTorch path's error, plus a small allowance), on the loss.
    """

    fp32: float  # the reference's loss in fp32
    run_precision: float  # the same model's loss in the run's precision
    precision: str
    tolerance: float

    @classmethod
    def of(cls, cfg: AnyModelConfig, weights: dict[str, torch.Tensor], batch: Batch, device: torch.device,
           autocast, precision: str) -> LossCheck:
        model = build_model(dataclasses.replace(cfg, kernels="torch", compile_layers=False))
        model.load_state_dict(weights)
        model = model.to(device)
        fp32 = first_batch_loss(model, bert_ds_loss, batch, nullcontext)
        run = first_batch_loss(model, bert_ds_loss, batch, autocast)
        return cls(fp32, run, precision, 2 * abs(run - fp32) + LOSS_SLACK[precision] * max(1.0, abs(fp32)))

    def hold(self, v: BenchVariant, loss: float, where: str) -> None:
        """A :class:`LossMismatch` unless ``loss`` is within :attr:`tolerance` of the reference's."""
        if abs(loss - self.fp32) <= self.tolerance:  # written so that NaN fails
            return
        raise LossMismatch(
            f"{where}: ({v.key}) {v.description} gives a first-batch loss of {loss:.6g}, the reference "
            f"(bert_ds on PyTorch's ops, fp32) {self.fp32:.6g}: {abs(loss - self.fp32):.3g} apart, more than "
            f"the {self.tolerance:.3g} {self.precision} allows. The two do not hold the same weights or do "
            "not see the same batch; no speed is reported for different models")


@dataclass(frozen=True)
class Work:
    """What the timed batches hold, for every variant alike."""

    tokens: int  # real tokens over the timed steps
    useful: float  # FLOPs by the one accounting (bert_ds/model/flops.py)
    dense: float  # FLOPs a padded model with a dense decoder computes


@dataclass
class Configuration:
    """One (preset, sequence length) of a run: what every variant on it shares."""

    preset: str
    seq_len: int
    batch_size: int
    cfg: AnyModelConfig
    weights: dict[str, torch.Tensor]  # every variant starts from these
    samples: Dataset
    first: Batch  # the first batch, on the device: the loss check's
    check: LossCheck
    work: Work


def run_variant(v: BenchVariant, s: BenchSettings, c: Configuration, device: torch.device, autocast) -> dict[str, Any]:
    """One variant on one configuration: built, its first-batch loss held to the check, then timed."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = optimizer = loader = None
    try:
        model, loss_fn, optimizer, kernels = build_variant(v, c.cfg, c.weights, s.lr, device, c.seq_len)
        loss = first_batch_loss(model, loss_fn, c.first, autocast)
        c.check.hold(v, loss, f"{c.preset} at seq {c.seq_len}")
        loader = PretrainingLoader(c.samples, BatchPlan.resolve(c.batch_size, c.batch_size, world_size=1), rank=0,
                                   num_workers=s.workers, pin_memory=device.type == "cuda")
        t = time_variant(model, loss_fn, optimizer, loader, s, device, autocast)
    except (KernelUnavailable, VariantUnavailable) as err:
        return {"description": v.description, "not_run": str(err)}
    except torch.OutOfMemoryError:  # (f) or (c) at 8,192 on a smaller GPU: the others still run
        return {"description": v.description, "not_run": f"out of memory at {c.batch_size} x {c.seq_len} tokens"}
    finally:
        model = optimizer = loader = None  # freed before the next variant's peak memory is measured
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "description": v.description, "kernels": kernels, "optimizer": v.optimizer,
        "first_batch_loss": loss, "first_batch_loss_diff": loss - c.check.fp32,
        "ms_per_step": 1e3 * t.wall_s / s.steps,
        "compute_ms_per_step_median": 1e3 * statistics.median(t.step_s),
        "compute_ms_per_step_min": 1e3 * min(t.step_s),
        "data_wait_ms_per_step": 1e3 * t.data_wait_s / s.steps,
        "data_wait_share": t.data_wait_s / t.wall_s,
        "cpu_s_per_step": t.cpu_s / s.steps,
        "real_tokens_per_s": c.work.tokens / t.wall_s,
        "useful_tflops": c.work.useful / t.wall_s / 1e12,
        "peak_memory_gib": peak,
    }


# --------------------------------------------------------------------------- the run

def batches_summary(cfg: AnyModelConfig, timed: list[dict[str, int]], batch_size: int) -> tuple[Work, dict[str, float]]:
    """The timed batches' work, and their figures per step."""
    steps = len(timed)
    tokens = sum(c["tokens"] for c in timed)
    work = Work(tokens=tokens,
                useful=sum(training_flops(cfg, c["tokens"], c["sum_sq_len"], c["masked"], c["local_pairs"])
                           for c in timed),
                dense=sum(padded_dense_flops(cfg, batch_size, c["width"]) for c in timed))
    return work, {
        "mean_real_length": tokens / (steps * batch_size),
        "full_length_share": sum(c["full_length"] for c in timed) / (steps * batch_size),
        "padding_share": 1 - tokens / sum(c["padded_tokens"] for c in timed),
        "masked_per_step": sum(c["masked"] for c in timed) / steps,
        "real_tokens_per_step": tokens / steps,
        "sum_sq_len_per_step": sum(c["sum_sq_len"] for c in timed) / steps,
        "local_pairs_per_step": sum(c["local_pairs"] for c in timed) / steps,
        "useful_gflop_per_step": work.useful / steps / 1e9,
        "padded_dense_gflop_per_step": work.dense / steps / 1e9,
    }


def run_config(s: BenchSettings, variants: list[BenchVariant], preset: str, seq_len: int, device: torch.device,
               autocast) -> dict[str, Any]:
    """Every variant on one (preset, sequence length)."""
    samples, source = open_samples(s, seq_len)
    batch_size = s.batch_for(seq_len)
    pad = samples.special.pad
    cfg = model_preset(preset, samples.vocab_size, pad_token_id=pad)
    torch.manual_seed(s.seed)
    weights = build_model(dataclasses.replace(cfg, kernels="torch")).state_dict()
    batches_at = [list(range(i * batch_size, (i + 1) * batch_size)) for i in range(s.warmup + s.steps)]
    timed = [batch_counts(collate([samples[p] for p in positions], pad), local_window(cfg))
             for positions in batches_at[s.warmup:]]
    first = to_device(collate([samples[p] for p in batches_at[0]], pad), device)
    work, batches = batches_summary(cfg, timed, batch_size)
    check = LossCheck.of(cfg, weights, first, device, autocast, s.precision)
    c = Configuration(preset, seq_len, batch_size, cfg, weights, samples, first, check, work)
    return {"preset": preset, "seq_len": seq_len, "batch_size": batch_size, "source": source,
            "vocab_size": samples.vocab_size, "batches": batches, "loss_check": dataclasses.asdict(check),
            "results": {v.key: run_variant(v, s, c, device, autocast) for v in variants}}


def autocast_for(s: BenchSettings, device: torch.device) -> Callable[[], Any]:
    """The context every variant's forward runs in: bf16 autocast, or nothing (fp32)."""
    if s.precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext


def measure(s: BenchSettings, variants: list[BenchVariant]) -> dict[str, Any]:
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
        "arch": s.family.arch,
        "settings": dataclasses.asdict(s),
        "environment": {**probes.environment(device), "load_avg_1min_before": load_before,
                        "load_avg_1min_after": os.getloadavg()[0]},
        "probes": measured,
        "datasheet_bf16_tflops": datasheet_peak_tflops(torch.cuda.get_device_name(device))
        if device.type == "cuda" else None,
        "configs": configs,
    }
