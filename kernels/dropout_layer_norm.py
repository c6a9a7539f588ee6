"""The end of a post-LN sublayer in one op: ``LayerNorm(dropout(x + bias) + residual)``.

Post-LN BERT ends every sublayer with ``LayerNorm(dropout(dense(h) + b) + h_in)``. Run as PyTorch
ops, that is the GEMM's bias add, a dropout kernel (and its mask, kept for the backward), the
fused LayerNorm, and in the backward the dropout's gradient and a separate reduction for the
bias gradient. Here the model runs the GEMM without its bias and hands ``x = h W^T``, the bias
and the residual to one op.

Design choices, and why:

- **One kernel each way** (``kernels/csrc/dropout_layer_norm.cu``): the forward adds the bias,
  drops, adds the residual, computes fp32 two-pass statistics and normalises; it saves the
  per-row mean and rstd (fp32) only. The backward recomputes ``dropout(x + bias) + residual``
  and gives the gradients of x and the residual, and, from the same pass, the column sums of
  the LayerNorm's weight and bias gradients and of dx, which is the bias gradient: no separate
  reduction kernel. The column sums go through the deterministic two-stage reduction
  ``layer_norm.cu`` uses (each CTA's sum over its rows in fp32, added in warp order into one row
  of a small workspace, then one column sum over those rows; no atomics).
- **The mask is regenerated, not stored.** Element e of the (rows, hidden) tensor is kept iff
  word e % 4 of Philox4x32-10 (key: the seed; counter: the offset / 4 and e / 4) is below
  ``(1 - p) 2^24`` in its top 24 bits; kept elements are scaled by ``1 / (1 - p)``. Philox is
  counter-based, so the backward computes the forward's decisions again from ``(seed, offset)``
  and no mask is written or read. ``tests/kernels/helpers.py`` holds an independent Python
  Philox that the kernel's mask is tested against.
- **torch's generator governs it.** On a CUDA device the fused op takes ``(seed, offset)`` from
  torch's default CUDA generator and advances its offset by 4 (the 128-bit block of words each
  counter subsequence reads), torch's own convention for its Philox streams: seeding, saving
  and restoring torch's RNG state (checkpoints, activation recomputation) governs this dropout
  as it governs ``F.dropout``. Not capturable in a CUDA graph (the offset is read on the host).
  The mask differs from ``F.dropout``'s for the same state: another generator, the same law.
- **p = 0 draws nothing**: evaluation, or dropout off, takes a kernel branch without Philox or
  scaling, exactly ``LayerNorm(x + bias + residual)``.
- **dtypes** as :func:`~bert_ds.kernels.layer_norm.layer_norm`: x of float32, float16 or bfloat16;
  a residual of x's dtype or float32; weight, ln_bias and bias of one dtype, x's or float32
  (autocast over fp32 parameters: a bf16 GEMM output, fp32 biases and weights). Output in x's dtype.

Implementations (one signature, :func:`dropout_add_layer_norm_ref`'s without ``keep``):

- :func:`dropout_add_layer_norm_ref`: the definition in plain PyTorch, in fp32, with the mask as
  an explicit boolean tensor, so that a test gives it the kernel's mask.
- :func:`dropout_add_layer_norm_native` (``kernels=torch``): ``F.dropout(x + bias)`` then
  :func:`~bert_ds.kernels.layer_norm.layer_norm_native` with the residual, the ops the model ran
  before this op existed, so that with ``bias=None`` (the bias added by the GEMM) it computes
  bit for bit what they did.
- :func:`dropout_add_layer_norm_fused`: the kernels, through :class:`FusedDropoutAddLayerNorm`;
  takes an explicit ``seed``/``offset`` and a ``keep_out`` tensor for the mask it used (tests).
- :data:`dropout_add_layer_norm_compiled`: the reference under ``torch.compile`` (its mask drawn
  by Inductor's generator), a candidate of ``kernels=auto``.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bert_ds.kernels.compiled import CompiledReference
from bert_ds.kernels.dispatch import Backend, Impl, choose, fused_extension
from bert_ds.kernels.layer_norm import layer_norm_native, layer_norm_ref

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PHILOX_INCREMENT = 4  # generator offset reserved per call: one 128-bit Philox block per counter subsequence


def dropout_add_layer_norm_ref(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """x, residual: (..., H); bias (or None), weight, ln_bias: (H,); keep: (..., H) bool, the
    elements dropout keeps (scaled by 1 / (1 - dropout_p)), or None: drawn from torch's generator,
    each kept with probability 1 - dropout_p (none dropped at 0). Returns (..., H) in x.dtype."""
    summed = x.float() if bias is None else x.float() + bias.float()
    if keep is None and dropout_p > 0:
        keep = torch.rand_like(summed) < 1 - dropout_p
    if keep is not None:
        summed = summed * keep / (1 - dropout_p)
    return layer_norm_ref(summed, weight, ln_bias, eps, residual).to(x.dtype)


def dropout_add_layer_norm_native(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float,
) -> torch.Tensor:
    """:func:`dropout_add_layer_norm_ref` as PyTorch ops: ``F.dropout`` (none at p = 0, where it would
    return its input) and the native LayerNorm with the residual. A bias of another dtype than x
    (fp32 under autocast) is added in fp32, the output cast back to x's dtype."""
    if bias is None:
        summed = x
    else:
        summed = x + bias if bias.dtype == x.dtype else x.float() + bias.float()
    dropped = F.dropout(summed, dropout_p) if dropout_p > 0 else summed
    return layer_norm_native(dropped, weight, ln_bias, eps, residual).to(x.dtype)


def dropout_add_layer_norm_fused(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float,
    *,
    seed: int | None = None,
    offset: int | None = None,
    keep_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`dropout_add_layer_norm_ref` on the fused kernels.

    ``seed``, ``offset`` (a multiple of 4): the Philox stream of the mask; by default drawn from
    torch's generator for x's device (:func:`philox_seed_offset`) when ``dropout_p > 0``.
    ``keep_out``: a contiguous bool tensor of x's shape the forward writes its mask into (True:
    kept), for tests that hand the same mask to the reference.
    """
    if (seed is None) != (offset is None):
        raise ValueError("pass both seed and offset, or neither")
    if seed is None:
        seed, offset = philox_seed_offset(x.device) if dropout_p > 0 else (0, 0)
    return FusedDropoutAddLayerNorm.apply(x, bias, residual, weight, ln_bias, eps, dropout_p, seed, offset, keep_out)


def philox_seed_offset(device: torch.device) -> tuple[int, int]:
    """One call's Philox (seed, offset): on a CUDA device the default generator's seed and offset,
    the offset then advanced by :data:`PHILOX_INCREMENT` (as torch's own dropout kernels reserve
    theirs), so that torch's RNG state decides the mask; elsewhere (the kernels' CPU emulation)
    a seed drawn from torch's default generator, offset 0."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        offset = generator.get_offset()
        generator.set_offset(offset + PHILOX_INCREMENT)
        return generator.initial_seed(), offset
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64)), 0


# x and residual: (T, H), T the batch's token count
dropout_add_layer_norm_compiled = CompiledReference(dropout_add_layer_norm_ref, rows=(0, 2))

IMPLEMENTATIONS: dict[Impl, Callable[..., torch.Tensor]] = {
    "native": dropout_add_layer_norm_native, "fused": dropout_add_layer_norm_fused,
    "compiled": dropout_add_layer_norm_compiled}


def dropout_add_layer_norm(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float,
    *,
    backend: Backend,
) -> torch.Tensor:
    """:func:`dropout_add_layer_norm_ref` on the resolved ``backend`` (pass ``dropout_p=0`` outside training)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    impl = choose("dropout_add_layer_norm", backend,
                  lambda name: _unsupported(name, x, bias, residual, weight, ln_bias))
    return IMPLEMENTATIONS[impl](x, bias, residual, weight, ln_bias, eps, dropout_p)


def _unsupported(impl: Impl, x, bias, residual, weight, ln_bias) -> str:
    """Why candidate ``impl`` ("fused" or "compiled") cannot take these inputs ("" if it can)."""
    on_cuda = all(t.is_cuda for t in (x, bias, residual, weight, ln_bias) if t is not None)
    if impl == "compiled":  # the reference, which takes any input; raced on a CUDA device
        return "" if on_cuda else "its inputs are not all on a CUDA device"
    if x.dtype not in FUSED_DTYPES:
        return f"{x.dtype} input (it takes {', '.join(map(str, FUSED_DTYPES))})"
    if weight.dtype not in (x.dtype, torch.float32) or ln_bias.dtype != weight.dtype:
        return f"{weight.dtype}/{ln_bias.dtype} weight/ln_bias for {x.dtype} input (they must be {x.dtype} or float32)"
    if bias is not None and bias.dtype != weight.dtype:
        return f"a {bias.dtype} bias beside {weight.dtype} LayerNorm weights (it takes one dtype for the three)"
    if residual.dtype not in (x.dtype, torch.float32):
        return f"a {residual.dtype} residual for {x.dtype} input (it must be {x.dtype} or float32)"
    if not on_cuda:
        return "its inputs are not all on a CUDA device"
    return ""


class FusedDropoutAddLayerNorm(torch.autograd.Function):
    """``LayerNorm(dropout(x + bias) + residual)`` on the fused kernels: the arguments of
    :func:`dropout_add_layer_norm_fused`, with the Philox ``seed`` and ``offset`` given."""

    @staticmethod
    def forward(ctx, x, bias, residual, weight, ln_bias, eps, dropout_p, seed, offset, keep_out):
        y, mean, rstd = fused_extension().dropout_layer_norm_fwd(x, bias, residual, weight, ln_bias, eps, dropout_p,
                                                                 seed, offset, keep_out)
        ctx.save_for_backward(x, bias, residual, weight, mean, rstd)
        ctx.philox = (dropout_p, seed, offset)  # the backward regenerates the mask from these
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias, residual, weight, mean, rstd = ctx.saved_tensors
        dx, dbias, dresidual, dweight, dln_bias = fused_extension().dropout_layer_norm_bwd(
            dy, x, bias, residual, weight, mean, rstd, *ctx.philox)
        return dx, dbias, dresidual, dweight, dln_bias, None, None, None, None, None
