"""Training-step speed of bert_ds's BERT against Hugging Face's, on the same batches.

    python -m bert_ds.bench [--device cpu|cuda] [--preset base] [--batch-size 32] [--steps 4] [--warmup 1]
                            [--data DIR] [--json FILE]

Both models get the same configuration, the same initial weights (ours, loaded into
``transformers.BertForPreTraining`` by name: the names are Hugging Face's), the same
batches and the same optimizer, and each step is forward, backward and optimizer
step. Prints a markdown table (ms/step, real tokens/s, useful TFLOP/s, MFU) and the
speed-up; ``--json FILE`` writes every figure and the settings.

Design choices, and why:

- **What is compared.** bert_ds: ``bert_ds.model.BertForPreTraining`` (unpadded, MLM
  decoder on masked tokens only) with ``--kernels`` (``torch`` by default: the PyTorch
  path). Hugging Face: ``transformers.BertForPreTraining`` with SDPA attention, fed the
  padded batch and labels the way its users feed it. No DeepSpeed engine on either
  side: the engine's cost is the same for both and would only blur the ratio.
- **Precision.** fp32 on CPU; bf16 autocast for both models on CUDA (fp32 weights and
  optimizer), the usual way to run HF in bf16. ``--precision`` overrides.
- **Lengths.** The padding the loader really produces decides how much HF wastes, so
  batches come from real shards with ``--data DIR`` (``PretrainingDataset`` + ``collate``,
  exactly the training loader's samples). Without it, lengths are synthetic and mimic
  that loader at the same ``--seq-len`` S (see :func:`synthetic_length`): with
  probability 0.9 a sample is full length (S); otherwise BERT's short target
  U[2, S-3] plus a sentence of overshoot U[0, 40] plus 3 special tokens, capped at S.
  On the bundled WikiText sample at S=128 the loader gives 90.2% full-length samples
  and a mean of 124.1 tokens; the synthetic rule gives 92% and 123.7. Every sample is
  an NSP pair ([CLS] A [SEP] B [SEP], a random split) with 15% of its non-special
  tokens masked. The synthetic vocabulary is BERT's 30,522 (``--vocab-size``).
- **Timing.** ``--warmup`` steps per model run first and are excluded (allocator,
  thread-pool and autotuning start-up); then ``--steps`` timed steps. The two models
  alternate step by step, in alternating order, so that load from other processes on a
  shared machine falls on both alike. On CUDA each step is bracketed by
  ``torch.cuda.synchronize()``. The process CPU time of each step (all threads) is
  recorded too: on a CPU shared with other jobs, wall time includes waiting for a
  core and CPU time does not, so the CPU-time ratio is the steadier one there.
- **One FLOPs accounting.** Useful FLOPs are :func:`bert_ds.flops.training_flops` for
  both models (the work a step must do, not what HF spends on padding and unmasked
  logits), so MFU compares directly. MFU is given against a matmul measured in the
  same run (fp32 2048^3 on CPU, bf16 8192^3 on CUDA; the best of one probe before and one
  after the timed steps, so that a burst of load from elsewhere does not lower the
  reference; ``--no-probes`` skips them) and, on known GPUs, against the datasheet bf16
  peak. A copy probe gives the memory bandwidth. The load average before and after
  the run is recorded: on a shared machine it says what else was running.
- **Same work, checked.** Before timing, both models compute the loss of the first
  batch in eval mode (no dropout); the difference is printed, so a mismatch in weights
  or inputs cannot hide behind a speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from bert_ds.errors import ConfigError, UserError
from data_tools.errors import report
from bert_ds.flops import datasheet_peak_tflops, training_flops
from bert_ds.model import PRESETS, BertForPreTraining, ModelConfig, model_preset

BERT_VOCAB_SIZE = 30522  # bert-base-uncased: the vocabulary of the published models
FULL_LENGTH_PROB = 0.9  # BERT's short_seq_prob = 0.1
SENTENCE_OVERSHOOT = 40  # a chunk closes at the first sentence end past its target: up to ~1 sentence more
MASK_RATE = 0.15
# Synthetic special ids, in the order data_tools writes them: [PAD] [UNK] [CLS] [SEP] [MASK].
PAD, CLS, SEP, MASK, FIRST_REGULAR = 0, 2, 3, 4, 5
# Matmul probe size and dtype per device: large enough to reach the device's peak.
PROBES = {"cpu": (2048, torch.float32), "cuda": (8192, torch.bfloat16)}


@dataclass
class BenchSettings:
    device: str  # "cpu" or "cuda"
    precision: str  # "fp32", or "bf16" (autocast)
    preset: str
    batch_size: int
    seq_len: int
    steps: int  # timed steps per model
    warmup: int  # untimed steps per model before them
    kernels: str  # bert_ds's kernels setting
    optimizer: str  # "adamw" (torch) or "lamb" (bert_ds.lamb), the same for both models
    lr: float
    vocab_size: int  # synthetic batches only; real data brings its own
    data: str | None
    seed: int
    probes: bool

    def __post_init__(self) -> None:
        for name in ("batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if not 8 <= self.seq_len <= 512:
            raise ConfigError(f"--seq-len must be in [8, 512], got {self.seq_len}")
        if self.vocab_size <= FIRST_REGULAR:
            raise ConfigError(f"--vocab-size must be > {FIRST_REGULAR}, got {self.vocab_size}")
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown model preset {self.preset!r}; choose one of {', '.join(PRESETS)}")


# --------------------------------------------------------------------------- batches

def synthetic_length(rng: np.random.Generator, seq_len: int) -> int:
    """One sample's length in tokens, the way bert_ds.data chunks documents (see module doc)."""
    if rng.random() < FULL_LENGTH_PROB:
        return seq_len
    target = int(rng.integers(2, seq_len - 3 + 1))
    return min(seq_len, target + int(rng.integers(0, SENTENCE_OVERSHOOT + 1)) + 3)


def synthetic_sample(rng: np.random.Generator, seq_len: int, vocab_size: int) -> dict[str, Any]:
    """An NSP pair of random tokens, in the loader's sample format (unmasked ids never matter for speed)."""
    n = synthetic_length(rng, seq_len)
    split = int(rng.integers(2, n - 1))  # [CLS] A [SEP] occupies [0, split]
    ids = rng.integers(FIRST_REGULAR, vocab_size, size=n)
    ids[0], ids[split], ids[-1] = CLS, SEP, SEP
    types = np.zeros(n, dtype=np.int64)
    types[split + 1:] = 1
    candidates = np.flatnonzero(ids >= FIRST_REGULAR)
    chosen = rng.choice(candidates, size=max(1, round(len(candidates) * MASK_RATE)), replace=False)
    labels = np.full(n, -100, dtype=np.int64)
    labels[chosen] = ids[chosen]
    ids[chosen] = MASK
    return {"input_ids": ids, "token_type_ids": types, "labels": labels,
            "next_sentence_label": int(rng.integers(0, 2))}


def make_batches(s: BenchSettings, count: int) -> tuple[list[dict[str, torch.Tensor]], int, int, str]:
    """``count`` batches; returns them, the vocabulary size, the pad id and where lengths came from."""
    from bert_ds.data import collate

    if s.data is not None:
        from bert_ds.config import DataConfig
        from bert_ds.data import PretrainingDataset

        ds = PretrainingDataset(s.data, DataConfig(train=[s.data], max_seq_length=s.seq_len, num_workers=0), s.seed)
        pad = ds.special.pad
        batches = [collate([ds[p] for p in range(i * s.batch_size, (i + 1) * s.batch_size)], pad)
                   for i in range(count)]
        return batches, ds.vocab_size, pad, f"real shards: {s.data}"
    rng = np.random.default_rng(s.seed)
    batches = [collate([synthetic_sample(rng, s.seq_len, s.vocab_size) for _ in range(s.batch_size)], PAD)
               for _ in range(count)]
    return batches, s.vocab_size, PAD, "synthetic (BERT's 90% full-length / 10% short targets, NSP pairs)"


def padded_dense_flops(cfg: ModelConfig, batch_size: int, width: int) -> float:
    """FLOPs of a training step that computes on padding and decodes every position (the HF way).

    :func:`training_flops` with every (B, width) position a real, masked token of a
    width-long sequence: what a padded model with a dense MLM decoder really computes.
    """
    positions = batch_size * width
    return training_flops(cfg, positions, batch_size * width ** 2, positions)


def batch_counts(batch: dict[str, torch.Tensor]) -> dict[str, int]:
    lengths = batch["attention_mask"].sum(dim=1)
    return {"tokens": int(lengths.sum()), "sum_sq_len": int((lengths ** 2).sum()),
            "masked": int((batch["labels"] != -100).sum()), "padded_tokens": batch["input_ids"].numel()}


# --------------------------------------------------------------------------- models

def build_models(cfg: ModelConfig, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours with a fixed seed, and HF's BertForPreTraining (SDPA) holding the same weights."""
    import transformers

    from bert_ds.export import to_hf_config

    torch.manual_seed(0)
    ours = BertForPreTraining(cfg)
    hf = transformers.BertForPreTraining(to_hf_config(cfg))
    hf.set_attn_implementation("sdpa")
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"HF model does not take our weights: missing {missing}, unexpected {unexpected}")
    return ours.to(device).train(), hf.to(device).train()


def build_optimizer(model: torch.nn.Module, s: BenchSettings) -> torch.optim.Optimizer:
    from bert_ds.lamb import Lamb
    from bert_ds.optim import param_groups

    groups = param_groups(model, weight_decay=0.01)
    if s.optimizer == "lamb":
        return Lamb(groups, lr=s.lr)
    return torch.optim.AdamW(groups, lr=s.lr, foreach=True)


def ours_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                 attention_mask=batch["attention_mask"], masked_lm_labels=batch["labels"],
                 next_sentence_label=batch["next_sentence_label"]).loss


def hf_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                 attention_mask=batch["attention_mask"], labels=batch["labels"],
                 next_sentence_label=batch["next_sentence_label"]).loss


@dataclass
class Contender:
    name: str
    model: torch.nn.Module
    loss_fn: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    optimizer: torch.optim.Optimizer
    times: list[float] = dataclasses.field(default_factory=list)  # wall seconds per timed step
    cpu_times: list[float] = dataclasses.field(default_factory=list)  # process CPU seconds (all threads)

    def step(self, batch: dict[str, torch.Tensor], autocast) -> None:
        with autocast():
            loss = self.loss_fn(self.model, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- probes

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_tflops(device: torch.device) -> tuple[float, str]:
    """Best-of-N TFLOP/s of one square matmul at the device's probe size and dtype."""
    n, dtype = PROBES[device.type]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _best_seconds(lambda: a @ b, device, reps=3 if device.type == "cpu" else 20)
    return 2 * n ** 3 / seconds / 1e12, f"{str(dtype).removeprefix('torch.')} {n}^3"


def copy_gb_per_s(device: torch.device) -> float:
    """Best-of-N bandwidth of a device-to-device copy (bytes read + written)."""
    numel = (64 if device.type == "cpu" else 1024) * 2**20 // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, reps=3 if device.type == "cpu" else 20)
    return 2 * numel * 4 / seconds / 1e9


# --------------------------------------------------------------------------- the run

def run(s: BenchSettings) -> dict[str, Any]:
    if s.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    device = torch.device(s.device)
    batches, vocab_size, pad, source = make_batches(s, s.warmup + s.steps)
    cfg = model_preset(s.preset, vocab_size, kernels=s.kernels, pad_token_id=pad)
    ours, hf = build_models(cfg, device)
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
    if s.precision == "bf16":
        def autocast():
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    else:
        autocast = nullcontext

    loss_check = _loss_check(ours, hf, batches[0], autocast)
    load_before = os.getloadavg()[0]
    probes_before = _probes(device) if s.probes else {}
    contenders = [Contender("bert_ds", ours, ours_loss, build_optimizer(ours, s)),
                  Contender("transformers", hf, hf_loss, build_optimizer(hf, s))]
    for i, batch in enumerate(batches):
        order = contenders if i % 2 == 0 else contenders[::-1]
        for c in order:
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            c.step(batch, autocast)
            _sync(device)
            if i >= s.warmup:
                c.times.append(time.perf_counter() - t0)
                c.cpu_times.append(time.process_time() - c0)

    timed = [batch_counts(b) for b in batches[s.warmup:]]
    tokens = sum(c["tokens"] for c in timed)
    flops = sum(training_flops(cfg, c["tokens"], c["sum_sq_len"], c["masked"]) for c in timed)
    dense = sum(padded_dense_flops(cfg, s.batch_size, b["input_ids"].shape[1]) for b in batches[s.warmup:])
    probes: dict[str, Any] = {}
    if s.probes:
        after = _probes(device)
        probes = {"matmul": after["matmul"],
                  **{k: max(probes_before[k], after[k]) for k in ("matmul_tflops", "copy_gb_per_s")}}
    load_after = os.getloadavg()[0]
    peak = datasheet_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    results = {}
    for c in contenders:
        total = sum(c.times)
        achieved = flops / total / 1e12
        results[c.name] = {
            "ms_per_step": 1e3 * total / len(c.times),
            "ms_per_step_min": 1e3 * min(c.times),
            "ms_per_step_median": 1e3 * statistics.median(c.times),
            "cpu_s_per_step": sum(c.cpu_times) / len(c.cpu_times),
            "real_tokens_per_s": tokens / total,
            "useful_tflops": achieved,
            "mfu_vs_matmul": achieved / probes["matmul_tflops"] if probes else None,
            "mfu_vs_datasheet_bf16": achieved / peak if peak else None,
        }
    all_counts = [batch_counts(b) for b in batches]
    return {
        "settings": dataclasses.asdict(s),
        "environment": {**_environment(device), "load_avg_1min_before": load_before,
                        "load_avg_1min_after": load_after},
        "batches": {
            "source": source, "vocab_size": vocab_size,
            "mean_real_length": sum(c["tokens"] for c in all_counts) / (len(all_counts) * s.batch_size),
            "full_length_share": float(np.mean([float(x) for b in batches
                                                for x in (b["attention_mask"].sum(1) == s.seq_len).tolist()])),
            "padding_share": 1 - sum(c["tokens"] for c in all_counts) / sum(c["padded_tokens"] for c in all_counts),
            "masked_per_step": sum(c["masked"] for c in timed) / len(timed),
            "real_tokens_per_step": tokens / len(timed),
            "useful_gflop_per_step": flops / len(timed) / 1e9,
            "padded_dense_gflop_per_step": dense / len(timed) / 1e9,
        },
        "loss_check": loss_check,
        "probes": probes,
        "results": results,
        "speedup": results["transformers"]["ms_per_step"] / results["bert_ds"]["ms_per_step"],
        "speedup_median": results["transformers"]["ms_per_step_median"] / results["bert_ds"]["ms_per_step_median"],
        "speedup_cpu_time": results["transformers"]["cpu_s_per_step"] / results["bert_ds"]["cpu_s_per_step"],
    }


def _probes(device: torch.device) -> dict[str, Any]:
    tflops, what = matmul_tflops(device)
    return {"matmul_tflops": tflops, "matmul": what, "copy_gb_per_s": copy_gb_per_s(device)}


def _loss_check(ours, hf, batch: dict[str, torch.Tensor], autocast) -> dict[str, float]:
    """Both models' loss on one batch without dropout: the same weights and inputs give the same loss."""
    ours.eval()
    hf.eval()
    with torch.no_grad(), autocast():
        a, b = float(ours_loss(ours, batch)), float(hf_loss(hf, batch))
    ours.train()
    hf.train()
    return {"bert_ds": a, "transformers": b, "abs_diff": abs(a - b)}


def _environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


# --------------------------------------------------------------------------- report

def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(r: dict[str, Any]) -> str:
    s, b, env = r["settings"], r["batches"], r["environment"]
    where = env.get("gpu") or f"{env['cpu']}, {env['threads']} threads"
    lines = [
        f"BERT {s['preset']} training step, {s['device']} ({where}), {s['precision']}, {s['optimizer']}, "
        f"batch {s['batch_size']} x seq {s['seq_len']}, vocab {b['vocab_size']:,}",
        f"lengths: {b['source']}; mean {b['mean_real_length']:.1f} real tokens/sample, "
        f"{100 * b['full_length_share']:.0f}% full length, {100 * b['padding_share']:.1f}% padding, "
        f"{b['masked_per_step']:.0f} masked tokens/step",
        f"work per step: {b['useful_gflop_per_step']:,.0f} GFLOP useful (bert_ds computes this), "
        f"{b['padded_dense_gflop_per_step']:,.0f} GFLOP padded with a dense MLM decoder (transformers); "
        f"ratio {b['padded_dense_gflop_per_step'] / b['useful_gflop_per_step']:.2f}x, the speed-up of a purely "
        "compute-bound device",
        f"timing: {s['warmup']} warm-up steps per model excluded, {s['steps']} timed steps per model, interleaved; "
        f"load average {env['load_avg_1min_before']:.2f} before, {env['load_avg_1min_after']:.2f} after",
        f"same loss check (eval, first batch): bert_ds {r['loss_check']['bert_ds']:.5f}, "
        f"transformers {r['loss_check']['transformers']:.5f} (|diff| {r['loss_check']['abs_diff']:.2g})",
    ]
    if r["probes"]:
        p = r["probes"]
        lines.append(f"probes: matmul {p['matmul']} {p['matmul_tflops']:.3f} TFLOP/s, copy {p['copy_gb_per_s']:.1f} GB/s")
    lines += [
        "",
        "| model | ms/step (mean) | ms/step (min) | CPU s/step | real tokens/s | useful TFLOP/s | MFU vs matmul "
        "| MFU vs datasheet bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"bert_ds": f"bert_ds (kernels={s['kernels']}, unpadded, sparse MLM decoder)",
             "transformers": "transformers BertForPreTraining (SDPA)"}
    for name, x in r["results"].items():
        lines.append(f"| {names[name]} | {x['ms_per_step']:.1f} | {x['ms_per_step_min']:.1f} | "
                     f"{x['cpu_s_per_step']:.2f} | {x['real_tokens_per_s']:,.0f} | {x['useful_tflops']:.4f} | "
                     f"{_fmt(x['mfu_vs_matmul'], '.1%')} | {_fmt(x['mfu_vs_datasheet_bf16'], '.1%')} |")
    lines += ["", f"speed-up (transformers ms/step / bert_ds ms/step): **{r['speedup']:.2f}x** "
              f"(of the medians: {r['speedup_median']:.2f}x; of the process CPU time: {r['speedup_cpu_time']:.2f}x)"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bert_ds.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                   help="fp32, or bf16 autocast for both models (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--preset", default="base", help=f"model size: {', '.join(PRESETS)}")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="maximum tokens per sample")
    p.add_argument("--steps", type=int, default=4, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per model before the timed ones")
    p.add_argument("--kernels", default="torch", choices=["auto", "cuda", "torch"], help="bert_ds's kernels")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "lamb"], help="optimizer of both models")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of both optimizers")
    p.add_argument("--data", default=None, help="dataset folder (data_tools build): batches from real shards")
    p.add_argument("--vocab-size", type=int, default=BERT_VOCAB_SIZE, help="vocabulary of synthetic batches")
    p.add_argument("--seed", type=int, default=0, help="seed of the batches")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-probes", action="store_true", help="skip the matmul and copy probes")
    p.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        settings = BenchSettings(
            device=args.device, precision=args.precision or ("bf16" if args.device == "cuda" else "fp32"),
            preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
            warmup=args.warmup, kernels=args.kernels, optimizer=args.optimizer, lr=args.lr,
            vocab_size=args.vocab_size, data=args.data, seed=args.seed, probes=not args.no_probes)
        result = run(settings)
    except UserError as err:
        return report(err)
    print(markdown(result), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
