"""Speed of the fused kernels against PyTorch, at BERT-Base and BERT-Large shapes.

    python -m bert_ds.kernels.bench [--ops layer_norm,dropout_add_layer_norm,bias_gelu,varlen_attention,
                                           mlm_cross_entropy,lamb_update]
                                    [--dtype bf16] [--models base,large] [--tokens 16384] [--lamb-elements N]
                                    [--reps 30] [--no-compile] [--device cuda|cpu] [--json FILE]

Prints a markdown table; ``--json FILE`` also writes every figure with the device,
driver, torch, CUDA and git commit. On a machine without a CUDA device it says so in
one line and exits 0, unless ``--device cpu`` asks for a CPU run: the same cases, tables
and files with the fused rows refused (``gpu_checks.sh --rehearse`` runs it at tiny
shapes, so that a broken case or writer is found before a GPU session).

Design choices, and why:

- **What each op is compared with.** "torch eager" is the op's ``<op>_ref`` (what
  ``kernels=torch`` runs in the model) and "torch.compile" the same reference compiled
  (default mode). For attention also every SDPA backend that takes the input: math,
  memory-efficient and cuDNN on the padded (B, nh, S, hd) batch with a key-padding
  mask (timed on tensors already padded: their best case, padding not charged), and
  flash on a nested (jagged) tensor, which needs no padding; and torch's own varlen
  FlashAttention (``varlen_attn``, on the unpadded tokens as ours), looked up where this
  torch keeps it. A backend that refuses the input (or is missing) is listed with its
  reason instead of a time.
- **Shapes.** ``--tokens`` real tokens (default 16,384, e.g. 128 x 128) at hidden
  768/3072/12 heads (Base) and 1024/4096/16 heads (Large); attention at S=128 with
  every sequence full, and at S=512 with lengths like the pretraining loader's (90%
  full, the rest uniform), where padding costs the padded backends.
- **Work per call, one definition per op** (``layer_norm_work``, ``dropout_add_layer_norm_work``,
  ``bias_gelu_work``, ``attention_work``, ``mlm_cross_entropy_work``): the FLOPs and the bytes
  the op must move (each input read once,
  each output written once; workspaces and re-reads are an implementation's own cost),
  the same for every implementation, so a slower one shows a lower figure. Attention
  FLOPs are the useful ones (4 * nh * hd * sum of L^2 forward, 2.5x that backward);
  padded work is not counted. ``dropout_add_layer_norm`` runs at p = 0.1 (BERT's), against its
  reference, whose mask torch's generator draws as a tensor (the fused op regenerates its own).
- **The MLM loss** (``mlm_cross_entropy``): 15% of ``--tokens`` as rows of the decoder's logits,
  30,528 wide (BERT's vocabulary padded with -inf to a multiple of 8), against its reference and
  "torch native", the model's path without the op (``F.cross_entropy`` on an fp32 copy).
- **LAMB's update** (``lamb_update``, pass "step"): one optimizer step over a flat fp32
  tensor of the model's parameter count (ZeRO-1 on one GPU: the whole model in one
  partition; ``--lamb-elements`` overrides), cut into 1,024-element chunks at fragments of
  the layer shapes, fused against the native path (what ``kernels=torch`` runs). Its work:
  g, m, v, w read once and m, v, w written once (7 x 4 bytes per element).
- **Figures.** Memory-bound ops (the LayerNorms, bias_gelu, the MLM loss, lamb_update): GB/s and
  the fraction of a device-to-device copy measured in the same run. Attention: TFLOP/s and the
  fraction of a bf16 8192^3 matmul measured in the same run.
- **Roofline.** Per op, for the fused kernel and (attention) ``varlen_attn``, flash
  and cuDNN SDPA: the time the call's FLOPs would take at the measured matmul peak and
  its bytes at the measured copy bandwidth; the larger is the bound no implementation
  beats, and "x bound" is how far the measured time is from it.
- **Timing.** CUDA events around ``--reps`` back-to-back calls after warm-up (which
  also triggers compilation and autotuning), best of three such rounds.
- **Three modules.** This one is the command and its report; the shapes and the work per
  call are plain arithmetic in ``bench_work.py``; the cases and their timing, on torch, are in
  ``bench_cases.py``, imported once the command line is read (``--help`` needs no torch).
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bert_ds.kernels.bench_work import DTYPES, MODELS, Work, roofline
from bert_ds.kernels.dispatch import OPS

# The implementations the roofline table lists: ours, and attention's fastest alternatives.
ROOFLINE_IMPLS = ("fused", "varlen_attn", "sdpa flash (nested)", "sdpa cuDNN")


def markdown(result: dict[str, Any]) -> str:
    env, device = result["environment"], result["device_probes"]
    lines = [f"{env['device']} (driver {env['driver']}), torch {env['torch']}, CUDA {env['cuda']}, "
             f"commit {(env['git_commit'] or '?')[:12]}{' (dirty)' if env['git_dirty'] else ''}; {result['dtype']}",
             f"measured: copy {device['copy_gb_per_s']:.0f} GB/s, bf16 matmul {device['matmul_tflops']:.0f} TFLOP/s",
             "", "| op | model | shape | pass | implementation | ms | rate | % of peak | vs eager |",
             "|---|---|---|---|---|---:|---:|---:|---:|"]
    eager = {(r["op"], r["model"], r["shape"], r["pass"]): r["ms"]
             for r in result["rows"] if r["impl"] == "torch eager"}
    for r in result["rows"]:
        base = eager.get((r["op"], r["model"], r["shape"], r["pass"]))
        if r["ms"] is None:
            lines.append(f"| {r['op']} | {r['model']} | {r['shape']} | {r['pass']} | {r['impl']} | — | "
                         f"refused: {r['note']} | | |")
            continue
        speedup = f"{base / r['ms']:.2f}x" if base else ""
        lines.append(f"| {r['op']} | {r['model']} | {r['shape']} | {r['pass']} | {r['impl']} | {r['ms']:.3f} | "
                     f"{r['rate']:.1f} {r['unit']} | {100 * r['fraction_of_peak']:.0f}% | {speedup} |")
    return "\n".join(lines + ["", roofline_table(result)])


def roofline_table(result: dict[str, Any]) -> str:
    """Each op's distance to its limit: the time its work takes at the run's measured matmul
    peak and copy bandwidth, beside the measured time of ours and of the alternatives."""
    lines = ["roofline: the work per call at the measured matmul peak and copy bandwidth; "
             "x bound = measured / the larger of the two", "",
             "| op | model | shape | pass | implementation | GFLOP | MB | ms at matmul peak | ms at copy bandwidth | "
             "bound | measured ms | x bound |",
             "|---|---|---|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in result["rows"]:
        if r["impl"] not in ROOFLINE_IMPLS:
            continue
        line = roofline(Work(r["flops"], r["bytes"]), result["device_probes"])
        measured = "—" if r["ms"] is None else f"{r['ms']:.3f}"
        distance = f"refused: {r['note']}" if r["ms"] is None else f"{r['ms'] / line['bound_ms']:.2f}x"
        lines.append(f"| {r['op']} | {r['model']} | {r['shape']} | {r['pass']} | {r['impl']} | "
                     f"{r['flops'] / 1e9:.3f} | {r['bytes'] / 1e6:.2f} | {line['compute_ms']:.4f} | "
                     f"{line['memory_ms']:.4f} | {line['limit']} | {measured} | {distance} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.kernels.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--tokens", type=int, default=16384, help="real tokens per call")
    parser.add_argument("--lamb-elements", type=int, default=None,
                        help="lamb_update's flat tensor (default: the model's parameter count)")
    parser.add_argument("--reps", type=int, default=30, help="calls per timed round")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile rows")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the same cases and files, fused rows refused (a rehearsal)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = (set(args.ops) - set(OPS)) | (set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown ops or models: {', '.join(sorted(unknown))}")
    if args.tokens < 1 or args.reps < 1 or (args.lamb_elements is not None and args.lamb_elements < 1):
        parser.error("--tokens, --reps and --lamb-elements must be >= 1")
    import torch  # and the ops, with the cases: once the command line is read

    from bert_ds.kernels import _build, bench_cases

    if args.device == "cpu":
        return _report(bench_cases.run(args), args.json)
    if not torch.cuda.is_available():
        print("bert_ds.kernels.bench: no CUDA device here; the kernels bench runs on a GPU only (--device cpu "
              "rehearses it)")
        return 0
    extension, reason = _build.load_extension()
    if extension is None:
        print(f"bert_ds.kernels.bench: the fused CUDA kernels cannot load: {reason}", file=sys.stderr)
        return 1
    return _report(bench_cases.run(args), args.json)


def _report(result: dict[str, Any], path: Path | None) -> int:
    print(markdown(result))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
