"""The kernels bench's cases at BERT shapes (ModernBERT's for GeGLU and the local attention) and
their timing, on torch (see :mod:`.bench`).

:mod:`.bench` imports this module once its command line is read.
"""

import argparse
import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bert_ds.kernels import probes, speed
from bert_ds.kernels import local_attention as local
from bert_ds.kernels.bench_work import (
    DTYPES, HEAD_DIM, LOCAL_WINDOW, MASKED_SHARE, MODELS, PASSES, attention_work, bias_gelu_work,
    dropout_add_layer_norm_work, geglu_work, lamb_update_work, layer_norm_work, mlm_cross_entropy_work,
)
from bert_ds.kernels.ops import (
    bias_gelu, bias_gelu_ref, dropout_add_layer_norm, dropout_add_layer_norm_ref, geglu, geglu_native, geglu_ref,
    layer_norm, layer_norm_ref, mlm_cross_entropy, mlm_cross_entropy_native, mlm_cross_entropy_ref, varlen_attention,
    varlen_attention_ref,
)
from bert_ds.kernels.attention import varlen_attn_api
from bert_ds.kernels.lamb import lamb_update, lamb_update_native


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


def geglu_cases(model: str, tokens: int, dtype: torch.dtype, device: str):
    """ModernBERT's MLP activation on its Wi projection [input | gate]; "torch native" is the model's
    ``F.gelu(input) * gate`` on the chunks."""
    width = MODELS[model]["geglu"]
    x = torch.randn(tokens, 2 * width, device=device, dtype=dtype)
    grad = torch.randn(tokens, width, device=device, dtype=dtype)
    impls = {"fused": lambda x: geglu(x, "none", backend="cuda"),
             "torch eager": lambda x: geglu_ref(x, "none"),
             "torch native": lambda x: geglu_native(x, "none")}
    work = {p: geglu_work(tokens, width, x.element_size(), p) for p in PASSES}
    return f"({tokens}, 2 x {width}) erf", impls, [x], grad, work


def mlm_cross_entropy_cases(model: str, tokens: int, dtype: torch.dtype, device: str):
    """The masked share of ``tokens`` as rows of the decoder's logits, its vocabulary padded to a
    multiple of 8 with -inf (the model's layout); "torch native" is what the model ran before the op."""
    vocab = MODELS[model]["vocab"]
    rows, width = max(1, int(tokens * MASKED_SHARE)), -(-vocab // 8) * 8
    logits = torch.randn(rows, width, device=device, dtype=dtype)
    logits[:, vocab:] = float("-inf")
    labels = torch.randint(0, vocab, (rows,), device=device)
    grad = torch.ones((), device=device)
    impls = {"fused": lambda x: mlm_cross_entropy(x, labels, backend="cuda")[0],
             "torch eager": lambda x: mlm_cross_entropy_ref(x, labels)[0],
             "torch native": lambda x: mlm_cross_entropy_native(x, labels)[0]}
    work = {p: mlm_cross_entropy_work(rows, width, logits.element_size(), p) for p in PASSES}
    return f"({rows}, {width}), {width - vocab} -inf columns", impls, [logits], grad, work


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


def local_attention_cases(model: str, tokens: int, dtype: torch.dtype, seq_len: int, device: str):
    """ModernBERT's local layers: a window of LOCAL_WINDOW tokens on each side, every candidate of the
    op (kernels/local_attention.py) on the packed tokens; FLOPs of the pairs within the window."""
    heads = MODELS[model]["heads"]
    lengths = loader_lengths(max(1, tokens // seq_len), seq_len, torch.Generator().manual_seed(0))
    total, max_seqlen = sum(lengths), max(lengths)
    cu_seqlens = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(total, heads, HEAD_DIM, device=device, dtype=dtype) for _ in range(3))
    grad = torch.randn_like(q)
    # not "native": varlen_attn where it runs, else the reference, both timed here already
    named = {"torch eager": local.local_attention_ref,
             **{name: fn for name, fn in local.IMPLEMENTATIONS.items() if name != "native"}}
    options = dict(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=LOCAL_WINDOW)
    impls = {name: (functools.partial(fn, **options), [q, k, v], grad) for name, fn in named.items()}
    pairs = int(local.local_pairs(torch.tensor(lengths), LOCAL_WINDOW).sum())  # counted as done: those within the window
    work = {p: attention_work(lengths, heads, HEAD_DIM, q.element_size(), p, pairs) for p in PASSES}
    return f"{len(lengths)} x S<={max_seqlen} ({total} tokens), {heads} heads, window +-{LOCAL_WINDOW}", impls, work


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
    dtype = getattr(torch, DTYPES[args.dtype])
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
            if op in ("varlen_attention", "local_attention"):
                # the local layers at ModernBERT's sequence length, or the whole of --tokens if shorter
                for seq_len in ((128, 512) if op == "varlen_attention" else (min(1024, args.tokens),)):
                    cases = attention_cases if op == "varlen_attention" else local_attention_cases
                    shape, impls, work = cases(model, args.tokens, dtype, seq_len, args.device)
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
                     "bias_gelu": bias_gelu_cases, "geglu": geglu_cases, "mlm_cross_entropy": mlm_cross_entropy_cases}[op]
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


