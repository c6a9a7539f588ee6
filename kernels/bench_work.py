"""The kernels bench's shapes and the work one op call must do: FLOPs and bytes, one
definition per op, the same for every implementation, and the roofline bound they set.

Plain arithmetic, no torch: the bench's command line (:mod:`.bench`) and its report read it
without importing torch; the timed cases (:mod:`.bench_cases`) import torch and this.
"""

from dataclasses import dataclass
from typing import Any

# params: BertForPreTraining's parameter count at BERT's 30,522-token vocabulary (bert_ds.model)
# geglu: the GeGLU MLP's width of ModernBERT-base/large, which have BERT-base/large's hidden size and heads;
# window: ModernBERT's local layers' (128 tokens: 64 on each side)
MODELS = {"base": dict(hidden=768, intermediate=3072, heads=12, params=110_106_428, vocab=30522, geglu=1152),
          "large": dict(hidden=1024, intermediate=4096, heads=16, params=336_226_108, vocab=30522, geglu=2624)}
LOCAL_WINDOW = 64
MASKED_SHARE = 0.15  # BERT's masking rate: the MLM loss's rows per token
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # --dtype: torch's name of each
PASSES = ("forward", "forward+backward")
HEAD_DIM = 64


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


def geglu_work(rows: int, cols: int, itemsize: int, pass_: str) -> Work:
    """gelu(input) * gate over a (rows, 2 cols) projection, erf form: x in, y (rows, cols) out.
    FLOPs per output element, erf and exp counted as one each: 7 forward, 11 backward (gelu,
    gelu' and the two products)."""
    elements = rows * cols
    forward = Work(7 * elements, 3 * elements * itemsize)
    backward = Work(11 * elements, 5 * elements * itemsize)  # dy, x in; dx out
    return _per_pass(forward, backward, pass_)


def attention_work(lengths: list[int], heads: int, head_dim: int, itemsize: int, pass_: str,
                   pairs: int | None = None) -> Work:
    """Unpadded attention over sequences of ``lengths``: q, k, v in, out and the fp32 log-sum-exp
    out. FLOPs: QK^T and PV (4 * nh * hd per (query, key) pair: every pair of a sequence, or the
    ``pairs`` a window leaves, local_attention.local_pairs) forward; the backward recomputes
    QK^T and does four more matmuls of the same size: 2.5x the forward."""
    tokens = sum(lengths)
    flops = 4 * heads * head_dim * (sum(L * L for L in lengths) if pairs is None else pairs)
    tensor, lse = tokens * heads * head_dim * itemsize, tokens * heads * 4
    forward = Work(flops, 4 * tensor + lse)
    backward = Work(2.5 * flops, 8 * tensor + lse)  # dout, q, k, v, out, lse in; dq, dk, dv out
    return _per_pass(forward, backward, pass_)


def mlm_cross_entropy_work(rows: int, width: int, itemsize: int, pass_: str) -> Work:
    """The MLM loss over (rows, width) logits: logits and int64 labels in, the summed loss and the
    count out (8 bytes each); the backward reads the logits, labels, the fp32 gradient of the sum and
    the forward's fp32 log-sum-exp per row, and writes the logits' gradient. FLOPs per logit: 4
    forward (compare, subtract, exp, add), 4 backward (subtract, exp, the one-hot's subtract, scale)."""
    logits, labels = rows * width, 8 * rows
    forward = Work(4 * logits, logits * itemsize + labels + 16)
    backward = Work(4 * logits, 2 * logits * itemsize + labels + 4 * rows + 4)
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
