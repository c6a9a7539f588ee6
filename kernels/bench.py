"""Speed of the fused kernels against PyTorch, at BERT-Base and BERT-Large shapes.

    python -m bert_ds.kernels.bench [--ops layer_norm,dropout_add_layer_norm,bias_gelu,varlen_attention,lamb_update]
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
  ``bias_gelu_work``, ``attention_work``): the FLOPs and the bytes the op must move (each input read once,
  each output written once; workspaces and re-reads are an implementation's own cost),
  the same for every implementation, so a slower one shows a lower figure. Attention
  FLOPs are the useful ones (4 * nh * hd * sum of L^2 forward, 2.5x that backward);
  padded work is not counted. ``dropout_add_layer_norm`` runs at p = 0.1 (BERT's), against its
  reference, whose mask torch's generator draws as a tensor (the fused op regenerates its own).
- **LAMB's update** (``lamb_update``, pass "step"): one optimizer step over a flat fp32
  tensor of the model's parameter count (ZeRO-1 on one GPU: the whole model in one
  partition; ``--lamb-elements`` overrides), cut into 1,024-element chunks at fragments of
  the layer shapes, fused against the native path (what ``kernels=torch`` runs). Its work:
  g, m, v, w read once and m, v, w written once (7 x 4 bytes per element).
- **Figures.** Memory-bound ops (the LayerNorms, bias_gelu, lamb_update): GB/s and the fraction of a
  device-to-device copy measured in the same run. Attention: TFLOP/s and the fraction
  of a bf16 8192^3 matmul measured in the same run.
- **Roofline.** Per op, for the fused kernel and (attention) ``varlen_attn``, flash
  and cuDNN SDPA: the time the call's FLOPs would take at the measured matmul peak and
  its bytes at the measured copy bandwidth; the larger is the bound no implementation
  beats, and "x bound" is how far the measured time is from it.
- **Timing.** CUDA events around ``--reps`` back-to-back calls after warm-up (which
  also triggers compilation and autotuning), best of three such rounds.
"""

import argparse
import functools
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bert_ds.kernels import _build, probes, speed
from bert_ds.kernels.dispatch import OPS
from bert_ds.kernels.attention import varlen_attention, varlen_attention_ref, varlen_attn_api
from bert_ds.kernels.bias_gelu import bias_gelu, bias_gelu_ref
from bert_ds.kernels.dropout_layer_norm import dropout_add_layer_norm, dropout_add_layer_norm_ref
from bert_ds.kernels.lamb import lamb_update, lamb_update_native
from bert_ds.kernels.layer_norm import layer_norm, layer_norm_ref

# params: BertForPreTraining's parameter count at BERT's 30,522-token vocabulary (bert_ds.model)
MODELS = {"base": dict(hidden=768, intermediate=3072, heads=12, params=110_106_428),
          "large": dict(hidden=1024, intermediate=4096, heads=16, params=336_226_108)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PASSES = ("forward", "forward+backward")
HEAD_DIM = 64
# The implementations the roofline table lists: ours, and attention's fastest alternatives.
ROOFLINE_IMPLS = ("fused", "varlen_attn", "sdpa flash (nested)", "sdpa cuDNN")


# --------------------------------------------------------------------------- work per call

@dataclass(frozen=True)
class Work:
    """What one call must do: FLOPs, and bytes read plus written."""

    flops: float
    bytes: float

    def __add__(self, other: "Work") -> "Work":  # forward + backward
        return Work(self.flops + other.flops, self.bytes + other.bytes)


def _per_pass(forward: Work, backward: Work, pass_: str) -> Work:
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r} (one of {PASSES})")
    return forward if pass_ == "forward" else forward + backward


def layer_norm_work(rows: int, hidden: int, itemsize: int, pass_: str) -> Work:
    """LayerNorm(x + residual): x, residual, weight, bias in; y, mean and rstd (fp32) out.
    FLOPs: 8 per element forward (add, two-pass statistics, normalise, affine), 12 backward."""
    elements, params, stats = rows * hidden, 2 * hidden * itemsize, 2 * 4 * rows
    forward = Work(8 * elements, 3 * elements * itemsize + params + stats)
    # dy, x, residual, mean, rstd, weight in; dx, dweight, dbias out
    backward = Work(12 * elements, 4 * elements * itemsize + stats + hidden * itemsize + params)
    return _per_pass(forward, backward, pass_)


def dropout_add_layer_norm_work(rows: int, hidden: int, itemsize: int, pass_: str) -> Work:
    """LayerNorm(dropout(x + bias) + residual): x, residual, bias, weight, ln_bias in; y, mean and rstd
    (fp32) out; the mask is regenerated, never read or written. FLOPs: 10 per element forward (two
    adds, the dropout's scale, two-pass statistics, normalise, affine; Philox's integer work not
    counted), 14 backward (the LayerNorm's 12, the dropout's scale and the bias gradient's sum)."""
    elements, vector, stats = rows * hidden, hidden * itemsize, 2 * 4 * rows
    forward = Work(10 * elements, 3 * elements * itemsize + 3 * vector + stats)
    # dy, x, residual, mean, rstd, bias, weight in; dx, dresidual, dbias, dweight, dln_bias out
    backward = Work(14 * elements, 5 * elements * itemsize + stats + 2 * vector + 3 * vector)
    return _per_pass(forward, backward, pass_)


def bias_gelu_work(rows: int, cols: int, itemsize: int, pass_: str) -> Work:
    """gelu(x + bias), erf form: x, bias in; y out. FLOPs per element, erf and exp counted
    as one each: 6 forward, 13 backward (gelu' and the dbias sum)."""
    elements, bias = rows * cols, cols * itemsize
    forward = Work(6 * elements, 2 * elements * itemsize + bias)
    backward = Work(13 * elements, 3 * elements * itemsize + 2 * bias)  # dy, x, bias in; dx, dbias out
    return _per_pass(forward, backward, pass_)


def attention_work(lengths: list[int], heads: int, head_dim: int, itemsize: int, pass_: str) -> Work:
    """Unpadded attention over sequences of ``lengths``: q, k, v in, out and the fp32 log-sum-exp
    out. FLOPs: QK^T and PV (4 * nh * hd * L^2 per sequence) forward; the backward recomputes
    QK^T and does four more matmuls of the same size: 2.5x the forward."""
    tokens = sum(lengths)
    flops = 4 * heads * head_dim * sum(L * L for L in lengths)
    tensor, lse = tokens * heads * head_dim * itemsize, tokens * heads * 4
    forward = Work(flops, 4 * tensor + lse)
    backward = Work(2.5 * flops, 8 * tensor + lse)  # dout, q, k, v, out, lse in; dq, dk, dv out
    return _per_pass(forward, backward, pass_)


def lamb_update_work(elements: int) -> Work:
    """One LAMB step over fp32 state: g, m, v, w read, m, v, w written; ~16 FLOPs per element
    (the moments, the update, its square and the weight's)."""
    return Work(16 * elements, 7 * 4 * elements)


def roofline(work: Work, device: dict[str, Any]) -> dict[str, float | str]:
    """Milliseconds the work would take at the measured matmul peak and at the measured copy
    bandwidth; the larger is the bound, and what sets it ("compute" or "memory")."""
    compute_ms = work.flops / (device["matmul_tflops"] * 1e12) * 1e3
    memory_ms = work.bytes / (device["copy_gb_per_s"] * 1e9) * 1e3
    return {"compute_ms": compute_ms, "memory_ms": memory_ms, "bound_ms": max(compute_ms, memory_ms),
            "limit": "compute" if compute_ms >= memory_ms else "memory"}


# --------------------------------------------------------------------------- timing

def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 3, device: str = "cuda") -> float:
    """Milliseconds per call: best of three rounds of ``reps`` back-to-back calls (CUDA
    events on a GPU, the host clock on a CPU)."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(3):
        if device != "cuda":
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - t0) * 1e3 / reps)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def forward_backward(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor):
    """A callable running fn(*inputs) and its backward to every input."""
    return lambda: torch.autograd.grad(fn(*inputs), inputs, grad)


# --------------------------------------------------------------------------- cases

def loader_lengths(batch: int, seq_len: int, generator: torch.Generator) -> list[int]:
    """90% full-length sequences, the rest uniform in [2, seq_len): the pretraining loader's shape."""
    full = torch.rand(batch, generator=generator) < 0.9
    short = torch.randint(2, seq_len, (batch,), generator=generator)
    return torch.where(full, seq_len, short).tolist()


def layer_norm_cases(model: str, tokens: int, dtype: torch.dtype, device: str):
    hidden = MODELS[model]["hidden"]
    x, residual = (torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(2))
    weight, bias = torch.randn(hidden, device=device, dtype=dtype), torch.randn(hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    shape = f"({tokens}, {hidden}) +residual"
    impls = {"fused": lambda x, r, w, b: layer_norm(x, w, b, 1e-12, r, backend="cuda"),
             "torch eager": lambda x, r, w, b: layer_norm_ref(x, w, b, 1e-12, r)}
    work = {p: layer_norm_work(tokens, hidden, x.element_size(), p) for p in PASSES}
    return shape, impls, [x, residual, weight, bias], grad, work


def dropout_add_layer_norm_cases(model: str, tokens: int, dtype: torch.dtype, device: str):
    hidden = MODELS[model]["hidden"]
    x, residual = (torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(2))
    bias, weight, ln_bias = (torch.randn(hidden, device=device, dtype=dtype) for _ in range(3))
    grad = torch.randn_like(x)
    impls = {"fused": lambda x, r, b, w, lb: dropout_add_layer_norm(x, b, r, w, lb, 1e-12, 0.1, backend="cuda"),
             "torch eager": lambda x, r, b, w, lb: dropout_add_layer_norm_ref(x, b, r, w, lb, 1e-12, 0.1)}
    work = {p: dropout_add_layer_norm_work(tokens, hidden, x.element_size(), p) for p in PASSES}
    return f"({tokens}, {hidden}) +bias +residual, p=0.1", impls, [x, residual, bias, weight, ln_bias], grad, work


def bias_gelu_cases(model: str, tokens: int, dtype: torch.dtype, device: str):
    width = MODELS[model]["intermediate"]
    x = torch.randn(tokens, width, device=device, dtype=dtype)
    bias = torch.randn(width, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    impls = {"fused": lambda x, b: bias_gelu(x, b, "none", backend="cuda"),
             "torch eager": lambda x, b: bias_gelu_ref(x, b, "none")}
    work = {p: bias_gelu_work(tokens, width, x.element_size(), p) for p in PASSES}
    return f"({tokens}, {width}) erf", impls, [x, bias], grad, work


def lamb_update_cases(model: str, elements: int | None, device: str):
    """A flat fp32 tensor of ``elements`` (the model's parameter count by default) in fragments
    of the layer's weight shapes, as ZeRO lays out the parameters (``speed.lamb_timing_case``)."""
    shapes = MODELS[model]
    numel = elements or shapes["params"]
    layer = [shapes["hidden"] ** 2] * 4 + [shapes["hidden"] * shapes["intermediate"]] * 2
    pieces: list[int] = []
    while sum(pieces) < numel:
        pieces.append(min(layer[len(pieces) % len(layer)], numel - sum(pieces)))
    run = speed.lamb_timing_case(pieces, device)
    impls = {"fused": lambda: run(functools.partial(lamb_update, backend="cuda")),
             "torch eager": lambda: run(lamb_update_native)}
    return f"({numel},) fp32, {len(pieces)} fragments", impls, lamb_update_work(numel)


def _padded(x: torch.Tensor, lengths: list[int], seq_len: int) -> torch.Tensor:
    """(T, nh, hd) -> (B, nh, S, hd), zeros after each sequence."""
    out = x.new_zeros(len(lengths), seq_len, *x.shape[1:])
    for b, chunk in enumerate(torch.split(x, lengths)):
        out[b, :len(chunk)] = chunk
    return out.transpose(1, 2).contiguous()


def attention_cases(model: str, tokens: int, dtype: torch.dtype, seq_len: int, device: str):
    heads = MODELS[model]["heads"]
    generator = torch.Generator().manual_seed(0)
    batch = max(1, tokens // seq_len)
    lengths = [seq_len] * batch if seq_len == 128 else loader_lengths(batch, seq_len, generator)
    total, max_seqlen = sum(lengths), max(lengths)
    cu_seqlens = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(total, heads, HEAD_DIM, device=device, dtype=dtype) for _ in range(3))
    grad = torch.randn_like(q)
    impls: dict[str, tuple[Callable, list[torch.Tensor], torch.Tensor]] = {
        "fused": (lambda q, k, v: varlen_attention(q, k, v, cu_seqlens, max_seqlen, backend="cuda"), [q, k, v], grad),
        "torch eager": (lambda q, k, v: varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen), [q, k, v], grad),
    }
    # The SDPA backends themselves, on their preferred layouts.
    padded = [_padded(t, lengths, max_seqlen) for t in (q, k, v)]
    mask = (torch.arange(max_seqlen, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None])
    mask = None if min(lengths) == max_seqlen else mask[:, None, None, :]  # (B, 1, 1, S): keys only
    padded_grad = torch.randn_like(padded[0])
    for name, backend in (("sdpa math", "MATH"), ("sdpa mem-efficient", "EFFICIENT_ATTENTION"),
                          ("sdpa cuDNN", "CUDNN_ATTENTION")):
        impls[name] = (_sdpa(backend, mask), padded, padded_grad)
    impls["sdpa flash (nested)"] = (_nested_flash(cu_seqlens.long(), lengths), [q, k, v], grad)
    impls["varlen_attn"] = (_varlen_attn(cu_seqlens, max_seqlen), [q, k, v], grad)
    work = {p: attention_work(lengths, heads, HEAD_DIM, q.element_size(), p) for p in PASSES}
    shape = f"{batch} x S<={max_seqlen} ({total} tokens), {heads} heads"
    return shape, impls, work


def _sdpa(backend_name: str, mask: torch.Tensor | None) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return run


def _nested_flash(offsets: torch.Tensor, lengths: list[int]) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        # (T, nh, hd) -> jagged (B, j, nh, hd) -> (B, nh, j, hd); the bounds spare a device sync
        nested = [torch.nested.nested_tensor_from_jagged(t, offsets, min_seqlen=min(lengths),
                                                         max_seqlen=max(lengths)).transpose(1, 2)
                  for t in (q, k, v)]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(*nested)  # (B, nh, j, hd)
        return out.transpose(1, 2).values()  # (T, nh, hd)
    return run


def _varlen_attn(cu_seqlens: torch.Tensor, max_seqlen: int) -> Callable:
    def run(q, k, v):
        api = varlen_attn_api()
        if api is None:
            raise RuntimeError(f"torch {torch.__version__} has no varlen_attn")
        return api.fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return run


# --------------------------------------------------------------------------- the run

def measure(fn: Callable[[], Any], reps: int, device: str) -> tuple[float | None, str]:
    """(ms, "") or (None, why it could not run)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            return time_ms(fn, reps, device=device), ""
    except Exception as error:  # a backend that refuses the input: say why
        reasons = [str(w.message).splitlines()[0] for w in caught] + [str(error).splitlines()[0] if str(error) else ""]
        return None, "; ".join(r for r in reasons if r)[:200] or type(error).__name__


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    probed = probes.measure(torch.device(args.device))
    rows = []

    def add(op, model, shape, impl, pass_, ms, why, work, unit):
        rate = None if ms is None else work.bytes / ms / 1e6 if unit == "GB/s" else work.flops / ms / 1e9
        peak = probed["copy_gb_per_s"] if unit == "GB/s" else probed["matmul_tflops"]
        rows.append({"op": op, "model": model, "shape": shape, "impl": impl, "pass": pass_, "ms": ms,
                     "flops": work.flops, "bytes": work.bytes, "rate": rate, "unit": unit,
                     "fraction_of_peak": None if rate is None else rate / peak, "note": why})

    for model in args.models:
        for op in args.ops:
            if op == "lamb_update":
                shape, impls, work = lamb_update_cases(model, args.lamb_elements, args.device)
                for impl, fn in impls.items():
                    ms, why = measure(fn, args.reps, args.device)
                    add(op, model, shape, impl, "step", ms, why, work, "GB/s")
                continue
            if op == "varlen_attention":
                for seq_len in (128, 512):
                    shape, impls, work = attention_cases(model, args.tokens, dtype, seq_len, args.device)
                    if args.compile:
                        impls["torch.compile"] = (torch.compile(impls["torch eager"][0]), *impls["torch eager"][1:])
                    for impl, (fn, inputs, grad) in impls.items():
                        for pass_ in PASSES:
                            call = (lambda fn=fn, inputs=inputs: fn(*inputs)) if pass_ == "forward" else \
                                forward_backward(fn, [t.detach().requires_grad_() for t in inputs], grad)
                            ms, why = measure(call, args.reps, args.device)
                            add(op, model, shape, impl, pass_, ms, why, work[pass_], "TFLOP/s")
                continue
            cases = {"layer_norm": layer_norm_cases, "dropout_add_layer_norm": dropout_add_layer_norm_cases,
                     "bias_gelu": bias_gelu_cases}[op]
            shape, impls, inputs, grad, work = cases(model, args.tokens, dtype, args.device)
            if args.compile:
                impls["torch.compile"] = torch.compile(impls["torch eager"])
            for impl, fn in impls.items():
                for pass_ in PASSES:
                    call = functools.partial(fn, *inputs) if pass_ == "forward" else \
                        forward_backward(fn, [t.detach().requires_grad_() for t in inputs], grad)
                    ms, why = measure(call, args.reps, args.device)
                    add(op, model, shape, impl, pass_, ms, why, work[pass_], "GB/s")
    return {"environment": probes.environment(torch.device(args.device)), "dtype": args.dtype,
            "tokens": args.tokens, "device_probes": probed, "rows": rows}


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
    if args.device == "cpu":
        return _report(run(args), args.json)
    if not torch.cuda.is_available():
        print("bert_ds.kernels.bench: no CUDA device here; the kernels bench runs on a GPU only (--device cpu "
              "rehearses it)")
        return 0
    extension, reason = _build.load_extension()
    if extension is None:
        print(f"bert_ds.kernels.bench: the fused CUDA kernels cannot load: {reason}", file=sys.stderr)
        return 1
    return _report(run(args), args.json)


def _report(result: dict[str, Any], path: Path | None) -> int:
    print(markdown(result))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
