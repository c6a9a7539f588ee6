"""Training throughput of bert_ds against Hugging Face transformers, on the same device in one run.

    python -m bert_ds.tools.bench [--device cpu|cuda] [--preset base[,large]] [--seq-len 128[,512]]
                                  [--variants a,b,c] [--steps N] [--warmup N] [--data DIR]
                                  [--json FILE] [--markdown FILE]
    python -m bert_ds.tools.bench --preset modernbert-base [--seq-len 1024[,8192]] [--variants a,b,c,f] ...

For every (preset, sequence length) it times four ways to train the same BERT on the
same batches, one after the other, each a loop of loader -> host-to-device copy ->
forward -> backward -> optimizer step:

- (a) bert_ds: ``bert_ds.model.bert`` with ``kernels=cuda`` (every op fused; where that is
  impossible, the variant reports why and the others still run), unpadded, the MLM
  decoder on masked tokens only, and LAMB over flat groups as ZeRO-1 lays them out
  (``bert_ds.optim.flat.FlatLamb``, its update fused); on a CPU, ``kernels=auto``;
- (b) bert_ds with ``kernels=torch``: the same model on the PyTorch-native ops (varlen_attn on CUDA);
- (c) ``transformers.BertForPreTraining`` with SDPA attention and torch's fused AdamW,
  fed the padded batch and dense labels: what a user would otherwise run;
- (d) bert_ds with its encoder layers under ``torch.compile`` (``--compile-layers`` of the
  trainer): Inductor's fusion of the PyTorch ops in place of the hand-fused kernels, the
  attention as ``kernels=auto`` picks it (the fused kernel as one custom op). Against (a) it
  says which of the two fusions is faster on the device; its first step compiles (warm-up), so
  it runs when asked for (``--variants a,b,c,d``; ``benchmarks/gpu_checks.sh`` asks).

A ModernBERT preset (``modernbert-tiny``, ``-base``, ``-large``; one model family per run) times
its own variants the same way, on the documents layout's batches (whole documents, 30% masked,
no pair task; its record's ``data_defaults``) at seq 1,024 and 8,192 on a GPU:

- (a) bert_ds's ``bert_ds.model.modernbert`` with ``kernels=auto`` (each op's fastest correct
  implementation at these shapes), unpadded, the local layers computing their windows alone, the
  MLM decoder on masked tokens only, and StableAdamW, the optimizer of ModernBERT's recipe;
- (b) the same with ``kernels=torch``;
- (c) ``transformers.ModernBertForMaskedLM`` with SDPA (a local window is a mask over the whole
  row) and torch's fused AdamW, fed the padded batch and dense labels;
- (f) the same with ``attn_implementation="flash_attention_2"``, where the flash-attn package is
  installed and a CUDA device runs it; elsewhere its row says which of the two is missing;
- (d) as BERT's: (a)'s model with its layers under ``torch.compile``, when asked for
  (``--variants a,b,c,d,f``).
It prints a markdown table per configuration and, for BERT, the projection of the anchor run
(:mod:`bert_ds.tools.projection`); ``--json`` and ``--markdown`` keep every figure.

Design choices, and why:

- **Same work, checked.** All variants start from the same weights (bert_ds's, loaded into
  transformers' class through the export's mapping, the family record's ``hf``: the
  names are Hugging Face's) and see the same batches. Before a variant is timed, its loss on the
  first batch without dropout is held to the reference's, bert_ds on PyTorch's ops in fp32
  (:class:`~bert_ds.tools.bench_variants.LossCheck`): within twice the reference's own error in the
  run's precision plus 1e-4 of the loss in fp32, 2^-8 in bf16. A variant outside it stops the run
  with a message naming it (a mismatch in weights or inputs cannot hide behind a speed-up); the
  losses are printed side by side. No DeepSpeed engine wraps any variant: its cost is the same
  for all of them.
- **Precision.** bf16 autocast with fp32 weights and optimizer state on CUDA, the usual
  way to run transformers in bf16, given to all four alike; fp32 on CPU. ``--precision``
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
  on CUDA: 128 x 128 and 32 x 512; 4,096 on CPU). A ModernBERT preset's default on CUDA is
  32,768 tokens (32 x 1,024, 4 x 8,192), the micro-batch ``kernels=auto`` races its ops at
  (``kernels/speed.py``), so that the ops run at the shapes their verdicts were timed at.
- **Timing.** ``--warmup`` steps per variant run first and are excluded (allocator,
  cuBLAS heuristics, loader workers starting, kernel loading); then ``--steps`` timed
  steps. The timed window is wall time between two device synchronizations, so real
  tokens/s counts everything a training loop spends. Within it, *data wait* is the
  host's time blocked on the loader and issuing the copy to the device; the rest is
  compute. Per-step compute times come from CUDA events (no synchronization between
  steps) or, on CPU, the host clock; the process CPU time is recorded too.
- **One FLOPs accounting.** Useful FLOPs are :func:`bert_ds.model.flops.training_flops` for all
  variants (the work a step must do, not what transformers spends on padding and
  unmasked logits; a ModernBERT's local layers credited with the pairs within their windows,
  :func:`bert_ds.kernels.local_attention.local_pairs`), so MFU and tokens/s rank alike. MFU is against the datasheet dense
  bf16 peak (known GPUs) and against a matmul measured in the same run (the best of one
  probe before and one after the variants; :mod:`bert_ds.kernels.probes`), next to a copy probe.
- **Peak memory** per variant is ``torch.cuda.max_memory_allocated`` over its whole life
  (model, gradients, optimizer state, activations); the variants run one at a time and
  each is freed before the next. On CPU there is no per-variant figure.
- **Three modules.** This one is the command: its flags, the rates, goals, projection and
  report. The variants and the settings they run under are :mod:`.bench_settings` (no torch).
  The batches and the variants' timed loops are :mod:`.bench_variants`, which imports torch,
  the model and transformers; it is imported once the command line is read, so ``--help`` and
  a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import ConfigError, guarded
from bert_ds.base.interrupts import import_whole
from bert_ds.model.families import FAMILIES, PRESETS, family_of_preset, model_preset
from bert_ds.model.flops import GOAL_MFU, training_flops
from bert_ds.tools.bench_settings import BASELINE, FLASH_BASELINE, BenchSettings
from bert_ds.tools.projection import ANCHOR, anchor_mfu, hours_minutes, project

ANCHOR_PRESET = "base"  # the anchor run's model (bert_ds.tools.projection): BERT-Base
DEFAULT_STEPS = {"cpu": (1, 4), "cuda": (10, 30)}  # (warm-up, timed) per variant
# The GPU goals in bf16: each family's speed-ups (its record's bench.goals), and (a)'s MFU for the
# anchor's model at this length.
MFU_GOAL = (128, GOAL_MFU)
SPEEDUP_OF = {BASELINE: "speedup_vs_transformers", FLASH_BASELINE: "speedup_vs_flash_attention_2"}  # (a)'s figure


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{what} is empty")
    return values


# --------------------------------------------------------------------------- the run

def run(s: BenchSettings) -> dict[str, Any]:
    """Every figure of the run: the variants timed (:mod:`.bench_variants`), then the rates, goals
    and projection computed from them."""
    from bert_ds.tools import bench_variants  # torch, the model, transformers: once the command line is read

    result = bench_variants.measure(s, [s.family.bench.variants[key] for key in s.variants])
    add_rates(result)
    result["goals"] = goals(result)
    result["projection"] = projection(result)
    return result


def _ran(results: dict[str, Any], key: str) -> dict[str, Any] | None:
    """Variant ``key``'s figures where it ran, else None."""
    x = results.get(key)
    return None if x is None or "not_run" in x else x


def add_rates(result: dict[str, Any]) -> None:
    """MFU against both peaks and the speed-ups over transformers (SDPA; FlashAttention-2 where it
    ran), once the probes are in."""
    peak, measured = result["datasheet_bf16_tflops"], result["probes"].get("matmul_tflops")
    for config in result["configs"]:
        base, flash = _ran(config["results"], BASELINE), _ran(config["results"], FLASH_BASELINE)
        for x in config["results"].values():
            if "not_run" in x:
                continue
            x["mfu_vs_datasheet_bf16"] = x["useful_tflops"] / peak if peak else None
            x["mfu_vs_matmul"] = x["useful_tflops"] / measured if measured else None
            x["speedup_vs_transformers"] = x["real_tokens_per_s"] / base["real_tokens_per_s"] if base else None
            x["speedup_vs_flash_attention_2"] = x["real_tokens_per_s"] / flash["real_tokens_per_s"] if flash else None


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU goals, each with its measured figure (``met`` None: not measured); only on CUDA, for
    the presets and lengths a family's record states goals for, and the anchor's MFU."""
    if result["settings"]["device"] != "cuda":
        return []
    return [goal for config in result["configs"] for goal in _goals_of(config)]


def _goals_of(config: dict[str, Any]) -> list[dict[str, Any]]:
    preset, seq, results = config["preset"], config["seq_len"], config["results"]
    family = family_of_preset(preset)
    speedups = [g for g in family.bench.goals if (g.preset, g.seq_len) == (preset, seq)]
    mfu = (preset, seq) == (ANCHOR_PRESET, MFU_GOAL[0])
    if not (speedups or mfu) or "a" not in results:
        return []
    a = results["a"]
    if "not_run" in a:
        return [{"goal": f"(a) at seq {seq}", "measured": f"not run: {a['not_run']}", "met": False}]
    out = [_speedup(g, family.bench.variants[g.baseline].attention, results) for g in speedups]
    if mfu and a["mfu_vs_datasheet_bf16"] is not None:
        out.append({"goal": f"(a) >= {MFU_GOAL[1]:.0%} MFU against the datasheet bf16 peak at seq {seq}",
                    "measured": f"{a['mfu_vs_datasheet_bf16']:.1%}", "met": a["mfu_vs_datasheet_bf16"] >= MFU_GOAL[1]})
    return out


def _speedup(goal, attention: str, results: dict[str, Any]) -> dict[str, Any]:
    """(a)'s speed-up over ``goal.baseline`` (transformers with ``attention``) against ``goal.speedup``."""
    name = (f"(a) >= {goal.speedup}x the real tokens/s of ({goal.baseline}) transformers {attention} "
            f"at seq {goal.seq_len}")
    base, speedup = results.get(goal.baseline), results["a"].get(SPEEDUP_OF[goal.baseline])
    if base is not None and "not_run" in base:
        return {"goal": name, "measured": f"not measured: ({goal.baseline}) not run: {base['not_run']}", "met": None}
    if speedup is None:
        return {"goal": name, "measured": f"not measured: ({goal.baseline}) not asked for (--variants)", "met": None}
    return {"goal": name, "measured": f"{speedup:.2f}x", "met": speedup >= goal.speedup}


def projection(result: dict[str, Any]) -> dict[str, Any] | None:
    """The anchor run (BERT-Base, 32.8B tokens, 8x A100) at each variant's MFU against the datasheet peak.

    Without a datasheet peak (a CPU, an unknown GPU) there is no MFU to carry to an A100:
    ``variants`` is then empty and ``why`` says so; the anchor's own figures are still given.
    None for a run of another family: the anchor is a BERT-Base's.
    """
    configs = result["configs"]
    if family_of_preset(configs[0]["preset"]) is not family_of_preset(ANCHOR_PRESET):
        return None
    config = next((c for c in configs if c["seq_len"] == 128 and c["preset"] == "base"),
                  next((c for c in configs if c["seq_len"] == 128), configs[0]))
    b = config["batches"]
    # BERT-Base FLOPs per real token for these batches' lengths and masks (linear in the counts).
    base = model_preset(ANCHOR_PRESET, family_of_preset(ANCHOR_PRESET).published_vocab_size)
    per_token = training_flops(base, b["real_tokens_per_step"], b["sum_sq_len_per_step"],
                               b["masked_per_step"]) / b["real_tokens_per_step"]
    rows = {key: project(x["mfu_vs_datasheet_bf16"], per_token) for key, x in config["results"].items()
            if "not_run" not in x and x["mfu_vs_datasheet_bf16"]}
    why = "" if rows else (f"no MFU against a datasheet bf16 peak was measured on {result['environment']['device']}"
                           ": nothing to carry to an A100")
    return {"from": {"preset": config["preset"], "seq_len": config["seq_len"]}, "flops_per_token": per_token,
            "anchor": dataclasses.asdict(ANCHOR), "anchor_tokens_per_s_per_gpu": ANCHOR.tokens_per_s_per_gpu,
            "anchor_mfu": anchor_mfu(per_token), "variants": rows, "why": why}


# --------------------------------------------------------------------------- report

def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None else format(x, spec) + suffix


def markdown(r: dict[str, Any]) -> str:
    s, env = r["settings"], r["environment"]
    family = family_of_preset(s["presets"][0]).name
    lines = [
        f"# {family} pretraining throughput: bert_ds against transformers",
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
        lines += config_markdown(c)
    if r["goals"]:
        lines += ["", "## Goals", ""]
        lines += [f"- {g['goal']}: measured {g['measured']}, **{met_text(g['met'])}**" for g in r["goals"]]
    if r["projection"]:
        lines += projection_markdown(r["projection"])
    return "\n".join(lines)


def met_text(met: bool | None) -> str:
    return "not measured" if met is None else "met" if met else "not met"


def config_markdown(c: dict[str, Any]) -> list[str]:
    """One configuration's section: its batches, the loss check, and a row per variant (with a
    column for the speed-up over (f) where the family has it)."""
    b, check = c["batches"], c["loss_check"]
    flash = FLASH_BASELINE in c["results"]
    windows = ", the local layers' window pairs counted as done" if b["local_pairs_per_step"] else ""
    heads = ["variant", "kernels", "wall ms/step", "real tokens/s", "vs (c)", *(["vs (f)"] if flash else []),
             "data wait", "useful TFLOP/s", "MFU datasheet", "MFU matmul", "peak memory", "first-batch loss"]
    lines = [
        "", f"## {c['preset']}, seq {c['seq_len']}, batch {c['batch_size']}", "",
        f"{c['source']}; vocabulary {c['vocab_size']:,}; {b['mean_real_length']:.1f} real tokens/sample, "
        f"{b['full_length_share']:.0%} full length, {b['padding_share']:.1%} padding, "
        f"{b['masked_per_step']:.0f} masked tokens/step. Work per step: {b['useful_gflop_per_step']:,.1f} GFLOP "
        f"useful (the accounting of bert_ds/model/flops.py{windows}), {b['padded_dense_gflop_per_step']:,.1f} GFLOP "
        f"computed by a padded model with a dense MLM decoder "
        f"({b['padded_dense_gflop_per_step'] / b['useful_gflop_per_step']:.2f}x).",
        "",
        f"First-batch loss check: the reference (bert_ds on PyTorch's ops) gives {check['fp32']:.6f} in fp32"
        + ("" if check["precision"] == "fp32" else f" and {check['run_precision']:.6f} in {check['precision']}")
        + f"; every variant below is within {check['tolerance']:.3g} of the fp32 loss.",
        "",
        "Rates by the host's wall clock over the timed steps (what a training loop takes for them).", "",
        "| " + " | ".join(heads) + " |", "|---|---|" + "---:|" * (len(heads) - 2),
    ]
    for key, x in c["results"].items():
        if "not_run" in x:
            lines.append(f"| ({key}) {x['description']} | not run: {x['not_run']} |" + " |" * (len(heads) - 2))
            continue
        speedups = [_fmt(x["speedup_vs_transformers"], ".2f", "x")]
        if flash:
            speedups.append(_fmt(x["speedup_vs_flash_attention_2"], ".2f", "x"))
        lines.append(
            f"| ({key}) {x['description']} | {x['kernels']} | {x['ms_per_step']:,.1f} | "
            f"{x['real_tokens_per_s']:,.0f} | {' | '.join(speedups)} | "
            f"{x['data_wait_share']:.1%} | {x['useful_tflops']:.3f} | "
            f"{_fmt(x['mfu_vs_datasheet_bf16'], '.1%')} | {_fmt(x['mfu_vs_matmul'], '.1%')} | "
            f"{_fmt(x['peak_memory_gib'], '.2f', ' GiB')} | {x['first_batch_loss']:.4f} |")
    return lines


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
    p = argparse.ArgumentParser(prog="python -m bert_ds.tools.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the variants run (default: cuda where torch sees a CUDA device, else cpu)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                   help="fp32, or bf16 autocast for every variant (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--preset", default="base", help=f"comma-separated model sizes of one family: {', '.join(PRESETS)}")
    p.add_argument("--seq-len", default=None, help="comma-separated sequence lengths (default: "
                   + "; ".join(f"{f.name} {f.bench.seq_lens['cuda']} on cuda, {f.bench.seq_lens['cpu']} on cpu"
                               for f in FAMILIES.values()) + ")")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: tokens-per-step / S)")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help="sets the batch size when --batch-size is not given (default: "
                   + "; ".join(f"{f.name} {dict(f.bench.tokens_per_step)}" for f in FAMILIES.values()) + ")")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per variant (default: {DEFAULT_STEPS})")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per variant before the timed ones")
    p.add_argument("--variants", default=None,
                   help="comma-separated subset of the presets' family's (default: "
                   + "; ".join(f"{f.name} {f.bench.default_variants}" for f in FAMILIES.values())
                   + "; d compiles first, seconds to minutes): "
                   + " ".join(f"{f.name}: " + "; ".join(f"{k}: {v.description}" for k, v in f.bench.variants.items())
                              + "." for f in FAMILIES.values()))
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of every optimizer")
    p.add_argument("--data", default=None, help="dataset folder (data_tools build): batches from real shards")
    p.add_argument("--workers", type=int, default=None, help="loader worker processes (default: 2 on cuda, 0 on cpu)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary of synthetic batches (default: "
                   + "; ".join(f"{f.name} {f.published_vocab_size}" for f in FAMILIES.values()) + ")")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-probes", action="store_true", help="skip the matmul and copy probes")
    p.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    p.add_argument("--markdown", type=Path, default=None, help="also write the report to this markdown file")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    device = args.device or visible_device()
    warmup, steps = DEFAULT_STEPS[device]
    presets = [x.strip() for x in args.preset.split(",") if x.strip()]
    if not presets:
        raise ConfigError("--preset is empty")
    family = family_of_preset(presets[0])  # its defaults (BenchSettings checks that the others share it)
    defaults = family.bench
    return BenchSettings(
        device=device, precision=args.precision or ("bf16" if device == "cuda" else "fp32"), presets=presets,
        seq_lens=_int_list(args.seq_len or defaults.seq_lens[device], "--seq-len"),
        batch_size=args.batch_size, tokens_per_step=args.tokens_per_step or defaults.tokens_per_step[device],
        steps=steps if args.steps is None else args.steps, warmup=warmup if args.warmup is None else args.warmup,
        variants=[x.strip() for x in (args.variants or defaults.default_variants).split(",") if x.strip()], lr=args.lr,
        vocab_size=args.vocab_size or family.published_vocab_size, data=args.data,
        workers=(2 if device == "cuda" else 0) if args.workers is None else args.workers,
        seed=args.seed, probes=not args.no_probes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return guarded(lambda: _bench(args), interrupted="no report written")


def visible_device() -> str:
    """"cuda" where torch sees a CUDA device, else "cpu": the default of --device."""
    import torch  # asked once the command line is read: --help needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _bench(args: argparse.Namespace) -> None:
    import_whole("torch")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    result = run(settings_from(args))
    write_report(markdown(result), result, args.json, args.markdown)


def write_report(text: str, result: dict[str, Any], json_path: Path | None, markdown_path: Path | None) -> None:
    """Print the markdown report; also write it, and every figure as JSON, where asked."""
    print(text, flush=True)
    for path, content in ((json_path, json.dumps(result, indent=2) + "\n"), (markdown_path, text + "\n")):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, content)


if __name__ == "__main__":
    sys.exit(main())
