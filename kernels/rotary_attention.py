"""Attention with rotary embeddings on q and k (RoPE), as a ModernBERT-class encoder runs it: the
fused kernels rotate q and k as they load them, so that no rotated copy of either is written.

Not an op of its own: a rotary layer's attention (:func:`rotary_attention`) runs the attention op
of its kind (``varlen_attention`` for the global layers, ``local_attention`` for the local ones),
chosen once per call as the op chooses (:func:`rotary_impl`): where that is the fused kernel
(``kernels=cuda``, or ``kernels=auto`` where it won the op's race), the kernel rotates q and k as
it loads them; anywhere else q and k are rotated in PyTorch first. A rotary model's race times
each candidate in the same form (:func:`rotary_form`): the fused kernel on the unrotated
projection, every other after the rotation, which it pays and the fused kernel does not.

The rotation is transformers' (ModernBERT's), defined here once (:func:`rotary_tables`,
:func:`apply_rotary`, which the model imports; :func:`rotary_ref` at positions from ``cu_seqlens``):
head dim d < hd/2 is paired with d + hd/2 and both are turned by the angle
``pos * theta ** (-2d / hd)``, where ``pos`` is the token's offset in its own sequence (each
sequence of the packed batch starts at 0), with cos and sin computed in fp32 and rounded to
q's dtype, the rotation in fp32. The kernels compute cos and sin in fp32 and do not round them;
their backward turns the gradients of the rotated q and k back, so that the gradient of the
packed projection is that of q and k as the projection made them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bert_ds.kernels import attention, local_attention
from bert_ds.kernels.attention import GLOBAL, fused_scale, packed_fused, varlen_attention_ref
from bert_ds.kernels.dispatch import Backend, Impl, OpPlan, choose
from bert_ds.kernels.local_attention import local_attention_ref


def sequence_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each of the ``total`` packed tokens' offset in its own sequence (T,) int64: 0 at every start."""
    starts = cu_seqlens.long()
    token = torch.arange(total, device=cu_seqlens.device)
    sequence = torch.searchsorted(starts[1:], token, right=True)  # (T,) which sequence each token is in
    return token - starts[sequence]


def rotary_tables(position_ids: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, hd) of the tokens at ``position_ids`` (T,), in fp32 rounded to ``dtype``;
    the frequencies of pair i are ``theta ** (-2i / hd)``, each half of hd taking one copy."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device)
                                / head_dim))  # (hd/2,)
    freqs = position_ids.float()[:, None] * inv_freq  # (T, hd/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, nh, hd) rotated by the angles of cos, sin (T, hd): element d paired with d + hd/2, in
    fp32 (in x's dtype where that is wider: float64, for a reference's truth), rounded back to x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    wide, cos, sin = x.to(compute), cos[:, None, :].to(compute), sin[:, None, :].to(compute)  # cos, sin: (T, 1, hd)
    first, second = wide.chunk(2, dim=-1)
    return (wide * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)


def rotary_ref(x: torch.Tensor, cu_seqlens: torch.Tensor, rope_theta: float) -> torch.Tensor:
    """x (T, nh, hd) rotated: pair (d, d + hd/2) of token t turned by ``pos(t) * rope_theta ** (-2d / hd)``,
    ``pos(t)`` its offset in its own sequence; the model's rotation (:func:`rotary_tables`,
    :func:`apply_rotary`) at positions taken from ``cu_seqlens`` alone."""
    return apply_rotary(x, *rotary_tables(sequence_positions(cu_seqlens, x.shape[0]), x.shape[-1], rope_theta,
                                          x.dtype))


def rotary_attention_ref(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    rope_theta: float,
    window: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """qkv (T, 3, nh, hd), the unrotated projection; returns (T, nh, hd): q and k rotated by
    :func:`rotary_ref`, then the global op's reference (``window`` None) or the local one's."""
    q, k, v = qkv.unbind(1)
    q, k = rotary_ref(q, cu_seqlens, rope_theta), rotary_ref(k, cu_seqlens, rope_theta)
    if window is None:
        return varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale)
    return local_attention_ref(q, k, v, cu_seqlens, max_seqlen, window, dropout_p, softmax_scale)


def rotary_attention_fused(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    rope_theta: float,
    window: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`rotary_attention_ref` on the fused kernels, q, k and v read in place from ``qkv``; the
    gradient of ``qkv`` comes back in one piece (no dropout)."""
    if not rope_theta > 0.0:
        raise ValueError(f"rope_theta must be a positive rotary base, got {rope_theta}")
    return packed_fused(qkv, cu_seqlens, max_seqlen, fused_scale(qkv, dropout_p, softmax_scale),
                        GLOBAL if window is None else window, rope_theta)


# The candidates that rotate q and k themselves, in the rotary form of the race (:func:`rotary_form`);
# a table, as attention.PACKED_IMPLEMENTATIONS is, so that the race's tests can stand in for them.
ROTARY_IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {"fused": rotary_attention_fused}


def rotary_form(impl: str, fn: Callable[..., torch.Tensor], window: int | None, rope_theta: float,
                tables: tuple[torch.Tensor, torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Candidate ``impl`` of an attention op as a rotary model's layer runs it (:func:`rotary_attention`)
    and the race times it, on the unrotated projection: ``(qkv, cu_seqlens, max_seqlen, dropout_p=0.0)``
    with qkv (T, 3, nh, hd). The fused kernels rotate
    q and k as they load them (:data:`ROTARY_IMPLEMENTATIONS`); any other candidate (``fn``, the op's
    form with q, k and v, the local op's taking ``window`` after max_seqlen) runs on q and k rotated
    in PyTorch by ``tables`` (cos, sin (T, hd), :func:`rotary_tables`, which the model makes once a
    forward for all its layers)."""
    own = ROTARY_IMPLEMENTATIONS.get(impl)
    if own is not None:
        return lambda qkv, cu_seqlens, max_seqlen, dropout_p=0.0: own(qkv, cu_seqlens, max_seqlen, rope_theta,
                                                                      window, dropout_p)
    cos, sin = tables
    windowed = () if window is None else (window,)

    def rotated(qkv, cu_seqlens, max_seqlen, dropout_p=0.0):
        q, k, v = qkv.unbind(1)
        return fn(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, cu_seqlens, max_seqlen, *windowed,
                  dropout_p)
    return rotated


def rotary_impl(qkv: torch.Tensor, cu_seqlens: torch.Tensor, window: int | None, dropout_p: float,
                backend: Backend) -> Impl:
    """Which implementation the attention op of a layer with this ``window`` (None: global) runs under
    ``backend`` for these inputs: the op's own choice, made once for the layer (:func:`rotary_attention`).
    Under ``kernels=cuda`` inputs the kernel cannot take are an error that says why, as the op's."""
    op = "varlen_attention" if window is None else "local_attention"
    if isinstance(backend, OpPlan) and not backend.has(op):
        return "native"  # a plan raced without local layers: the op runs its native path
    q, k, v = qkv.unbind(1)
    module = attention if window is None else local_attention  # the op's own rule of what each candidate takes
    return choose(op, backend, lambda impl: module._unsupported(impl, q, k, v, cu_seqlens, dropout_p, None))


def rotary_attention(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    rope_theta: float,
    tables: tuple[torch.Tensor, torch.Tensor],
    window: int | None = None,
    dropout_p: float = 0.0,
    *,
    backend: Backend,
) -> torch.Tensor:
    """A rotary layer's attention on ``backend``: :func:`rotary_attention_ref` of the unrotated
    projection qkv (T, 3, nh, hd) in the form the race timed (:func:`rotary_form`), the fused
    kernels rotating q and k as they load them, any other implementation after PyTorch's rotation
    by ``tables`` (cos, sin (T, hd) of the layer's base at the tokens' positions)."""
    impl = rotary_impl(qkv, cu_seqlens, window, dropout_p, backend)
    implementations = (attention if window is None else local_attention).IMPLEMENTATIONS
    return rotary_form(impl, implementations[impl], window, rope_theta, tables)(qkv, cu_seqlens, max_seqlen,
                                                                                dropout_p)
