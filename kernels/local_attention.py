"""Bidirectional attention within a sliding window over unpadded ("varlen") sequences: the
local layers of a ModernBERT-class encoder.

Tokens are packed as in :mod:`bert_ds.kernels.attention` (sequence b is rows
``cu_seqlens[b]:cu_seqlens[b+1]``). Query i of a sequence attends to the keys j of the same
sequence with ``|i - j| <= window``: ``window`` tokens on each side, ``2 * window + 1`` in all
(ModernBERT's ``local_attention`` of 128 is a window of 64; transformers states the bound as
inclusive, as here). A window never crosses a sequence's edge: the sequences of a packed batch
see nothing of each other.

The reference (:func:`local_attention_ref`) is the global op's padded SDPA with the band added to
its key-padding mask: simple and obviously right, and it computes every (query, key) pair of the
padded batch. The other candidates, each with this op's signature, are PyTorch's own:

- ``varlen_attn``: torch's varlen FlashAttention-2 with ``window_size=(window, window)`` (CUDA,
  fp16/bf16, a torch whose ``varlen_attn`` takes ``window_size``), which skips the key tiles
  outside every query's window;
- ``flex``: FlexAttention over the packed tokens as one sequence, with a block mask of "same
  document and within the window" (CUDA: its backward has no CPU kernel), compiled once per process;
- ``sdpa_efficient``: the padded SDPA restricted to the memory-efficient backend, which takes
  the band as a mask;
- ``native``: ``varlen_attn`` where it takes the inputs, else the reference;
- ``flash_attn``: flash-attn's ``flash_attn_varlen_func`` with ``window_size``, where the package
  is installed (what transformers' ``flash_attention_2`` runs);
- ``fused``: the global op's fused kernels (``kernels/csrc/attention.cu``) with the window
  inside them: a CTA walks only the tiles within the window of one of its rows and masks only
  in the tiles that are not wholly within every row's window (the file's header). float16 and
  bfloat16, head_dim 32 or 64, no dropout, any window >= 0.

``kernels=auto`` races them at the model's shapes and window (``kernels/speed.py``), the fused
one where it passed its self-check (``kernels/selfcheck.py``); ``kernels=cuda`` runs the fused
one, or says why it cannot.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend

from bert_ds.kernels.attention import (
    FusedVarlenAttention, cuda_capability, flash_attn_problem, flash_attn_varlen, fused_problem, fused_scale, padded_sdpa,
    varlen_attn_api, varlen_attn_problem,
)
from bert_ds.kernels.dispatch import Backend, Impl, OpPlan, choose


def local_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    window: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """q, k, v: (T, nh, hd); cu_seqlens: (B+1,) int32; ``window`` >= 0; returns (T, nh, hd).

    ``dropout_p`` is applied as given (pass 0.0 in eval); ``softmax_scale`` defaults to 1/sqrt(hd)."""
    return padded_sdpa(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, window=window)


def local_attention_varlen_attn(q, k, v, cu_seqlens, max_seqlen, window, dropout_p=0.0, softmax_scale=None):
    """:func:`local_attention_ref` by torch's varlen_attn, or a ``ValueError`` saying why it cannot."""
    problem = _varlen_attn_problem(q, k, v, cu_seqlens, dropout_p, softmax_scale)
    if problem:
        raise ValueError(f"varlen_attn cannot take these inputs: {problem}")
    scale = {} if softmax_scale is None else {"scale": softmax_scale}
    return varlen_attn_api().fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                window_size=(window, window), **scale)


def local_attention_native(q, k, v, cu_seqlens, max_seqlen, window, dropout_p=0.0, softmax_scale=None):
    """:func:`local_attention_ref`'s result by the fastest PyTorch op that takes the inputs."""
    if not _varlen_attn_problem(q, k, v, cu_seqlens, dropout_p, softmax_scale):
        return local_attention_varlen_attn(q, k, v, cu_seqlens, max_seqlen, window, dropout_p, softmax_scale)
    return local_attention_ref(q, k, v, cu_seqlens, max_seqlen, window, dropout_p, softmax_scale)


def local_attention_flex(q, k, v, cu_seqlens, max_seqlen, window, dropout_p=0.0, softmax_scale=None):
    """:func:`local_attention_ref` by FlexAttention: the T packed tokens as one sequence of a batch
    of one, a block mask of "same sequence, within the window" (made for each batch's layout)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if dropout_p > 0.0:
        raise ValueError(f"FlexAttention has no attention dropout; got dropout_p={dropout_p}")
    total = q.shape[0]
    token = torch.arange(total, device=q.device)
    document = torch.searchsorted(cu_seqlens[1:].long(), token, right=True)  # (T,) each token's sequence

    def same_sequence_within_window(b, h, q_index, kv_index):
        return (document[q_index] == document[kv_index]) & ((q_index - kv_index).abs() <= window)

    mask = create_block_mask(same_sequence_within_window, None, None, total, total, device=q.device)
    packed = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # (1, nh, T, hd)
    out = _compiled_flex_attention()(*packed, block_mask=mask, scale=softmax_scale)  # (1, nh, T, hd)
    return out.squeeze(0).transpose(0, 1)  # (T, nh, hd)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once: uncompiled it runs the scores in full, as the reference does."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else flex_attention


def local_attention_sdpa_efficient(q, k, v, cu_seqlens, max_seqlen, window, dropout_p=0.0, softmax_scale=None):
    """:func:`local_attention_ref` on SDPA's memory-efficient backend alone."""
    return padded_sdpa(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                       backend=SDPBackend.EFFICIENT_ATTENTION, window=window)


def local_attention_flash_attn(q, k, v, cu_seqlens, max_seqlen, window, dropout_p=0.0, softmax_scale=None):
    """:func:`local_attention_ref` by flash-attn's varlen attention with ``window_size``, where the
    package is installed (what transformers' ``flash_attention_2`` runs for ModernBERT's local layers)."""
    if dropout_p > 0.0:
        raise ValueError(f"the race times flash-attn without dropout; got dropout_p={dropout_p}")
    return flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale, window)


def local_attention_fused(q, k, v, cu_seqlens, max_seqlen, window, dropout_p=0.0, softmax_scale=None):
    """:func:`local_attention_ref` on the fused kernels, the window inside them (no dropout)."""
    return FusedVarlenAttention.apply(q, k, v, cu_seqlens, max_seqlen, fused_scale(q, dropout_p, softmax_scale),
                                      window)


def local_pairs(lengths: torch.Tensor, window: int) -> torch.Tensor:
    """The (query, key) pairs within +-``window`` of one another in sequences of ``lengths``
    (elementwise): all ``len^2`` where the window spans the sequence, else ``len (2w + 1)`` less the
    ``w (w + 1)`` the two ends lack. The work the FLOPs accounting (bert_ds.model.flops) credits a
    local layer with."""
    return torch.where(lengths <= window + 1, lengths * lengths,
                       lengths * (2 * window + 1) - window * (window + 1))


IMPLEMENTATIONS: dict[Impl, Callable[..., torch.Tensor]] = {
    "native": local_attention_native,
    "fused": local_attention_fused,
    "varlen_attn": local_attention_varlen_attn,
    "flash_attn": local_attention_flash_attn,
    "flex": local_attention_flex,
    "sdpa_efficient": local_attention_sdpa_efficient,
}


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    window: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    *,
    backend: Backend,
) -> torch.Tensor:
    """:func:`local_attention_ref` on the resolved ``backend`` (a plan raced without local layers: the native op)."""
    if isinstance(backend, OpPlan) and not backend.has("local_attention"):
        backend = "torch"
    impl = choose("local_attention", backend, lambda name: _unsupported(name, q, k, v, cu_seqlens, dropout_p,
                                                                          softmax_scale))
    return IMPLEMENTATIONS[impl](q, k, v, cu_seqlens, max_seqlen, window, dropout_p, softmax_scale)


def _varlen_attn_problem(q, k, v, cu_seqlens, dropout_p, softmax_scale) -> str:
    """Why torch's varlen_attn cannot run these inputs with a window ("" if it can)."""
    problem = varlen_attn_problem(q, k, v, cu_seqlens, dropout_p, softmax_scale)
    if problem:
        return problem
    if "window_size" not in inspect.signature(varlen_attn_api().fn).parameters:
        return f"torch {torch.__version__}'s varlen_attn takes no window_size"
    return ""


def _unsupported(impl: Impl, q, k, v, cu_seqlens, dropout_p, softmax_scale) -> str:
    """Why candidate ``impl`` cannot take these inputs ("" if it can): every candidate declines
    attention dropout (the race timed and checked each without it) and inputs off a CUDA device."""
    if dropout_p > 0.0:
        return f"attention dropout (dropout_p={dropout_p}) is not supported; set attention_dropout=0"
    if impl == "varlen_attn":
        return _varlen_attn_problem(q, k, v, cu_seqlens, dropout_p, softmax_scale)
    if impl == "fused":
        return fused_problem(q, k, v, cu_seqlens, dropout_p)
    if impl == "flash_attn":
        return flash_attn_problem(q, k, v, cu_seqlens, dropout_p)
    if cuda_capability(q.device) is None:
        return "its inputs are not on a CUDA device"
    return ""
