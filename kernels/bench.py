"""Speed of the fused kernels against PyTorch, at BERT-Base and BERT-Large shapes (GPU only).

    python -m kernels.bench [--ops layer_norm,bias_gelu,varlen_attention] [--dtype bf16]
                            [--tokens 16384] [--reps 30] [--no-compile] [--json FILE]

Prints a markdown table; ``--json FILE`` also writes every figure with the device,
driver, torch, CUDA and git commit. On a machine without a CUDA device it says so in
one line and exits 0.

Design choices, and why:

- **What each op is compared with.** "torch eager" is the op's ``<op>_ref`` (what
  ``kernels=torch`` runs in the model) and "torch.compile" the same reference compiled
  (default mode). For attention also every SDPA backend that takes the input: math,
  memory-efficient and cuDNN on the padded (B, nh, S, hd) batch with a key-padding
  mask (timed on tensors already padded: their best case, padding not charged), and
  flash on a nested (jagged) tensor, which needs no padding. A backend that refuses
  the input is listed with its reason instead of a time.
- **Shapes.** ``--tokens`` real tokens (default 16,384, e.g. 128 x 128) at hidden
  768/3072/12 heads (Base) and 1024/4096/16 heads (Large); attention at S=128 with
  every sequence full, and at S=512 with lengths like the pretraining loader's (90%
  full, the rest uniform), where padding costs the padded backends.
- **Figures.** Memory-bound ops (layer_norm, bias_gelu): GB/s of the bytes the op
  must move (each input read once, each output written once; the same count for every
  implementation, so a slower one shows a lower figure) and the fraction of a
  device-to-device copy measured in the same run. Attention: useful TFLOP/s
  (4 * nh * hd * sum of L^2 forward, 2.5x that backward; padded work not counted) and
  the fraction of a bf16 8192^3 matmul measured in the same run.
- **Timing.** CUDA events around ``--reps`` back-to-back calls after warm-up (which
  also triggers compilation and autotuning), best of three such rounds.
"""

import argparse
import json
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels import _build, probes
from kernels.attention import varlen_attention, varlen_attention_ref
from kernels.bias_gelu import bias_gelu, bias_gelu_ref
from kernels.layer_norm import layer_norm, layer_norm_ref

MODELS = {"base": dict(hidden=768, intermediate=3072, heads=12),
          "large": dict(hidden=1024, intermediate=4096, heads=16)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OPS = ("layer_norm", "bias_gelu", "varlen_attention")
HEAD_DIM = 64


# --------------------------------------------------------------------------- timing

def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Milliseconds per call: best of three rounds of ``reps`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(3):
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


def layer_norm_cases(model: str, tokens: int, dtype: torch.dtype):
    hidden = MODELS[model]["hidden"]
    x, residual = (torch.randn(tokens, hidden, device="cuda", dtype=dtype) for _ in range(2))
    weight, bias = torch.randn(hidden, device="cuda", dtype=dtype), torch.randn(hidden, device="cuda", dtype=dtype)
    grad = torch.randn_like(x)
    e = x.element_size()
    shape = f"({tokens}, {hidden}) +residual"
    impls = {"fused": lambda x, r, w, b: layer_norm(x, w, b, 1e-12, r, backend="cuda"),
             "torch eager": lambda x, r, w, b: layer_norm_ref(x, w, b, 1e-12, r)}
    fwd_bytes = 3 * tokens * hidden * e + 8 * tokens
    bwd_bytes = 4 * tokens * hidden * e + 8 * tokens
    nbytes = {"forward": fwd_bytes, "forward+backward": fwd_bytes + bwd_bytes}
    return shape, impls, [x, residual, weight, bias], grad, nbytes


def bias_gelu_cases(model: str, tokens: int, dtype: torch.dtype):
    width = MODELS[model]["intermediate"]
    x = torch.randn(tokens, width, device="cuda", dtype=dtype)
    bias = torch.randn(width, device="cuda", dtype=dtype)
    grad = torch.randn_like(x)
    e = x.element_size()
    impls = {"fused": lambda x, b: bias_gelu(x, b, "none", backend="cuda"),
             "torch eager": lambda x, b: bias_gelu_ref(x, b, "none")}
    return f"({tokens}, {width}) erf", impls, [x, bias], grad, {"forward": 2 * tokens * width * e,
                                                               "forward+backward": 5 * tokens * width * e}


def _padded(x: torch.Tensor, lengths: list[int], seq_len: int) -> torch.Tensor:
    """(T, nh, hd) -> (B, nh, S, hd), zeros after each sequence."""
    out = x.new_zeros(len(lengths), seq_len, *x.shape[1:])
    for b, chunk in enumerate(torch.split(x, lengths)):
        out[b, :len(chunk)] = chunk
    return out.transpose(1, 2).contiguous()


def attention_cases(model: str, tokens: int, dtype: torch.dtype, seq_len: int):
    heads = MODELS[model]["heads"]
    generator = torch.Generator().manual_seed(0)
    batch = max(1, tokens // seq_len)
    lengths = [seq_len] * batch if seq_len == 128 else loader_lengths(batch, seq_len, generator)
    total, max_seqlen = sum(lengths), max(lengths)
    cu_seqlens = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(total, heads, HEAD_DIM, device="cuda", dtype=dtype) for _ in range(3))
    grad = torch.randn_like(q)
    impls: dict[str, tuple[Callable, list[torch.Tensor], torch.Tensor]] = {
        "fused": (lambda q, k, v: varlen_attention(q, k, v, cu_seqlens, max_seqlen, backend="cuda"), [q, k, v], grad),
        "torch eager": (lambda q, k, v: varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen), [q, k, v], grad),
    }
    # The SDPA backends themselves, on their preferred layouts.
    padded = [_padded(t, lengths, max_seqlen) for t in (q, k, v)]
    mask = (torch.arange(max_seqlen, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None])
    mask = None if min(lengths) == max_seqlen else mask[:, None, None, :]  # (B, 1, 1, S): keys only
    padded_grad = torch.randn_like(padded[0])
    for name, backend in (("sdpa math", "MATH"), ("sdpa mem-efficient", "EFFICIENT_ATTENTION"),
                          ("sdpa cuDNN", "CUDNN_ATTENTION")):
        impls[name] = (_sdpa(backend, mask), padded, padded_grad)
    impls["sdpa flash (nested)"] = (_nested_flash(cu_seqlens.long(), lengths), [q, k, v], grad)
    flops = 4 * heads * HEAD_DIM * sum(L * L for L in lengths)
    shape = f"{batch} x S<={max_seqlen} ({total} tokens), {heads} heads"
    return shape, impls, {"forward": flops, "forward+backward": 3.5 * flops}


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


# --------------------------------------------------------------------------- the run

def measure(fn: Callable[[], Any], reps: int) -> tuple[float | None, str]:
    """(ms, "") or (None, why it could not run)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            return time_ms(fn, reps), ""
    except Exception as error:  # a backend that refuses the input: say why
        reasons = [str(w.message).splitlines()[0] for w in caught] + [str(error).splitlines()[0] if str(error) else ""]
        return None, "; ".join(r for r in reasons if r)[:200] or type(error).__name__


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    device = probes.measure(torch.device("cuda"))
    rows = []

    def add(op, model, shape, impl, pass_, ms, why, amount, unit):
        rate = None if ms is None else amount / ms / 1e6 if unit == "GB/s" else amount / ms / 1e9
        peak = device["copy_gb_per_s"] if unit == "GB/s" else device["matmul_tflops"]
        rows.append({"op": op, "model": model, "shape": shape, "impl": impl, "pass": pass_, "ms": ms,
                     "rate": rate, "unit": unit, "fraction_of_peak": None if rate is None else rate / peak,
                     "note": why})

    for model in ("base", "large"):
        for op in args.ops:
            if op == "varlen_attention":
                for seq_len in (128, 512):
                    shape, impls, flops = attention_cases(model, args.tokens, dtype, seq_len)
                    if args.compile:
                        impls["torch.compile"] = (torch.compile(impls["torch eager"][0]), *impls["torch eager"][1:])
                    for impl, (fn, inputs, grad) in impls.items():
                        for pass_ in ("forward", "forward+backward"):
                            call = (lambda fn=fn, inputs=inputs: fn(*inputs)) if pass_ == "forward" else \
                                forward_backward(fn, [t.detach().requires_grad_() for t in inputs], grad)
                            ms, why = measure(call, args.reps)
                            add(op, model, shape, impl, pass_, ms, why, flops[pass_], "TFLOP/s")
                continue
            shape, impls, inputs, grad, nbytes = (layer_norm_cases if op == "layer_norm" else bias_gelu_cases)(
                model, args.tokens, dtype)
            if args.compile:
                impls["torch.compile"] = torch.compile(impls["torch eager"])
            for impl, fn in impls.items():
                for pass_ in ("forward", "forward+backward"):
                    call = (lambda fn=fn: fn(*inputs)) if pass_ == "forward" else \
                        forward_backward(fn, [t.detach().requires_grad_() for t in inputs], grad)
                    ms, why = measure(call, args.reps)
                    add(op, model, shape, impl, pass_, ms, why, nbytes[pass_], "GB/s")
    return {"environment": probes.environment(torch.device("cuda")), "dtype": args.dtype, "tokens": args.tokens, "device_probes": device,
            "rows": rows}


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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tokens", type=int, default=16384, help="real tokens per call")
    parser.add_argument("--reps", type=int, default=30, help="calls per timed round")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile rows")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = set(args.ops) - set(OPS)
    if unknown:
        parser.error(f"unknown ops: {', '.join(sorted(unknown))}")
    if not torch.cuda.is_available():
        print("kernels.bench: no CUDA device here; the kernels bench runs on a GPU only")
        return 0
    extension, reason = _build.load_extension()
    if extension is None:
        print(f"kernels.bench: the fused CUDA kernels cannot load: {reason}", file=sys.stderr)
        return 1
    result = run(args)
    print(markdown(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
