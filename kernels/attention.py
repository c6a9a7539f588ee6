"""Bidirectional attention over unpadded ("varlen") sequences.

The model keeps only real tokens, packed along one axis of length T = total
tokens; sequence b is rows ``cu_seqlens[b]:cu_seqlens[b+1]`` (the
flash-attention varlen convention). A fused kernel attends within those bounds
directly. The reference scatters the tokens back into a padded
(B, nh, Smax, hd) batch, runs ``F.scaled_dot_product_attention`` with a
key-padding mask, and gathers the real rows again: simple and obviously right,
at the cost of computing (and discarding) the pad query rows.

Every sequence must have at least one token: a pad query row of an empty
sequence would see no valid key and produce NaN.

The native path (:func:`varlen_attention_native`, what ``kernels=torch`` and a fused
kernel that is not used run) is PyTorch's own varlen FlashAttention-2,
``torch.nn.attention.varlen.varlen_attn``, wherever it takes the inputs: a CUDA
device of compute capability 8.0 or newer, float16/bfloat16, a head dim it has
kernels for, no dropout. Anything else (CPU, float32, attention dropout) runs the
reference's padded SDPA. The function is looked up, never inferred from the torch
version: it appeared in torch 2.10, and its first form took no ``scale``. Importing it
costs about 2.5 s (its module pulls in torch's compiler stack), so a process without
CUDA looks it up only when asked (:func:`varlen_attn_api`): every CPU start of a
``bert_ds`` command would pay it for nothing.

The fused path (``kernels/csrc/attention.cu``, FlashAttention-2 style) takes float16
and bfloat16, head_dim 32 or 64, no dropout; it never forms the (S, S) scores, saves
the per-row logsumexp for the backward and recomputes the probabilities there. Like
the reference it trusts ``max_seqlen`` to bound every sequence: it sizes the grid, and
it picks the backward's path. Where ``max_seqlen`` fits one key tile (128: BERT's phase 1)
one CTA per (sequence, head) writes dq directly; longer sequences add dq up over key
tiles in an fp32 workspace with atomics, which the binding allocates only then. The
tiles, their shared memory and their occupancy are derived in the file's header
(docs/kernels.md has their speed on an H100), and ``kernels=auto`` uses them only where
its race on the device says they are the fastest. :func:`varlen_attention_packed` takes
q, k and v as one (T, 3, nh, hd) projection, which the kernels read in place. The same
kernels take a sliding window (``kernels/local_attention.py``'s fused candidate) and rotate q
and k as they load them (``kernels/rotary_attention.py``): :func:`packed_fused`.

``kernels=auto`` races these too (:data:`IMPLEMENTATIONS`), each with this op's signature,
so that what it costs to bring the tokens to a backend's layout and back is inside what
is timed:

- ``varlen_attn``: torch's varlen FlashAttention-2 alone (an error where it cannot take the
  inputs, instead of the native op's fallback);
- ``flash_attn``: flash-attn's ``flash_attn_varlen_func``, what transformers' ``flash_attention_2``
  runs, where the package is installed and imports (:func:`flash_attn_api`; the same input rules
  as ``varlen_attn``, :func:`flash_layout_problem`);
- ``sdpa_efficient``, ``sdpa_cudnn``: the reference's padding around SDPA restricted to the
  memory-efficient or the cuDNN backend (:func:`padded_sdpa`);
- ``sdpa_flash``: SDPA's flash backend on a nested (jagged) batch, which needs no padding
  (:func:`nested_sdpa`; flash takes no key-padding mask);
- ``compiled``: the reference under ``torch.compile`` (``kernels/compiled.py``).

They decline attention dropout: the race timed and checked them without it (:func:`_unsupported`).
"""

import functools
import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bert_ds.kernels.compiled import CompiledReference
from bert_ds.kernels.dispatch import Backend, Impl, choose, fused_extension

FUSED_DTYPES = (torch.float16, torch.bfloat16)
FUSED_HEAD_DIMS = (32, 64)
GLOBAL = -1  # the fused kernels' window for every key of the sequence (kernels/local_attention.py takes one)
# Where torch has kept its varlen FlashAttention entry point, newest first.
VARLEN_ATTN_LOCATIONS = (("torch.nn.attention.varlen", "varlen_attn"), ("torch.nn.attention", "varlen_attn"))
# FlashAttention-2's head dims: multiples of 8 up to 256; above 192 its backward runs
# only on sm80 and sm90 (A100/H100), whose shared memory is large enough.
VARLEN_MAX_HEAD_DIM = 256
VARLEN_LARGE_HEAD_DIM = 192
VARLEN_LARGE_HEAD_DIM_DEVICES = ((8, 0), (9, 0))
# What the SDPA candidates take beyond the reference (PyTorch's sdp_utils): flash and cuDNN
# half precision only; every fused backend a head dim in multiples of 8, at most these.
SDPA_DTYPES = {"sdpa_flash": (torch.float16, torch.bfloat16), "sdpa_cudnn": (torch.float16, torch.bfloat16),
               "sdpa_efficient": (torch.float32, torch.float16, torch.bfloat16)}
SDPA_MAX_HEAD_DIM = {"sdpa_flash": 256, "sdpa_cudnn": 128, "sdpa_efficient": 256}


@dataclass(frozen=True)
class VarlenAttnApi:
    """torch's varlen_attn as this torch has it."""

    fn: Callable[..., torch.Tensor]
    takes_scale: bool  # the first release (2.10) always scaled by 1/sqrt(head_dim)


def find_varlen_attn() -> VarlenAttnApi | None:
    """torch's varlen FlashAttention-2 entry point, or None where this torch has none."""
    for module_name, name in VARLEN_ATTN_LOCATIONS:
        try:
            fn = getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            continue
        if callable(fn):
            return VarlenAttnApi(fn, "scale" in inspect.signature(fn).parameters)
    return None


_UNRESOLVED = object()
# Resolved at import where CUDA is there, so that a compiled forward finds it resolved and never
# traces the import; elsewhere on the first call of varlen_attn_api().
_varlen_attn: object = find_varlen_attn() if torch.cuda.is_available() else _UNRESOLVED


def varlen_attn_api() -> VarlenAttnApi | None:
    """torch's varlen_attn (:func:`find_varlen_attn`), looked up once."""
    global _varlen_attn
    if _varlen_attn is _UNRESOLVED:
        _varlen_attn = find_varlen_attn()
    return _varlen_attn


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device, None for any other device."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def varlen_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """q, k, v: (T, nh, hd); cu_seqlens: (B+1,) int32; returns (T, nh, hd).

    ``dropout_p`` is applied as given (pass 0.0 in eval); ``softmax_scale``
    defaults to 1/sqrt(hd).
    """
    return padded_sdpa(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale)


def padded_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    *,
    backend: SDPBackend | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """:func:`varlen_attention_ref`'s arguments and result, through a padded batch: the tokens
    scattered into (B, nh, Smax, hd), SDPA with a key-padding mask (on ``backend`` alone when
    given, else on the one SDPA picks), the real rows gathered back. ``window``: each query sees
    only the keys at most this many positions away (``kernels/local_attention.py``)."""
    total, num_heads, head_dim = q.shape
    batch = cu_seqlens.numel() - 1
    starts = cu_seqlens.long()
    token = torch.arange(total, device=q.device)
    seq = torch.searchsorted(starts[1:], token, right=True)  # (T,) which sequence each token is in
    slot = seq * max_seqlen + (token - starts[seq])  # (T,) its row in the (B*Smax) grid

    def to_padded(x: torch.Tensor) -> torch.Tensor:
        grid = x.new_zeros(batch * max_seqlen, num_heads, head_dim).index_copy(0, slot, x)
        return grid.view(batch, max_seqlen, num_heads, head_dim).transpose(1, 2)  # (B, nh, Smax, hd)

    key_is_real = torch.zeros(batch * max_seqlen, dtype=torch.bool, device=q.device)
    key_is_real[slot] = True
    attn_mask = key_is_real.view(batch, 1, 1, max_seqlen)  # broadcast over heads and queries
    if window is not None:
        position = torch.arange(max_seqlen, device=q.device)
        band = (position[:, None] - position[None, :]).abs() <= window  # (Smax, Smax): query, key
        attn_mask = attn_mask & band  # (B, 1, Smax, Smax)

    def attend() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            to_padded(q), to_padded(k), to_padded(v),
            attn_mask=attn_mask, dropout_p=dropout_p, scale=softmax_scale,
        )  # (B, nh, Smax, hd)

    if backend is None:
        out = attend()
    else:
        with sdpa_kernel([backend]):
            out = attend()
    out = out.transpose(1, 2).reshape(batch * max_seqlen, num_heads, head_dim)  # (B*Smax, nh, hd)
    return out[slot]  # (T, nh, hd)


def nested_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    *,
    backend: SDPBackend,
) -> torch.Tensor:
    """:func:`varlen_attention_ref`'s arguments and result, through SDPA's ``backend`` on a
    nested (jagged) batch, which holds the tokens as they are: no padding, no mask."""
    offsets = cu_seqlens.long()
    # The bounds are given, so that SDPA does not read them back from the device: max_seqlen
    # bounds every sequence and none is empty (this op's contract, module docstring).
    # contiguous: a jagged tensor's values are (T, nh, hd) rows (q, k, v may be views of one packed projection)
    nested = [torch.nested.nested_tensor_from_jagged(t.contiguous(), offsets, min_seqlen=1, max_seqlen=max_seqlen)
              .transpose(1, 2) for t in (q, k, v)]  # (T, nh, hd) -> jagged (B, j, nh, hd) -> (B, nh, j, hd)
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(*nested, dropout_p=dropout_p, scale=softmax_scale)  # (B, nh, j, hd)
    return out.transpose(1, 2).values()  # (T, nh, hd)


def varlen_attention_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`varlen_attention_ref`'s result by the fastest PyTorch op that takes the inputs."""
    if takes_varlen_attn(q, k, v, cu_seqlens, dropout_p, softmax_scale):
        return _call_varlen_attn(q, k, v, cu_seqlens, max_seqlen, softmax_scale)
    return varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale)


def varlen_attention_varlen_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`varlen_attention_ref` by torch's varlen_attn, or a ``ValueError`` saying why it cannot."""
    problem = varlen_attn_problem(q, k, v, cu_seqlens, dropout_p, softmax_scale)
    if problem:
        raise ValueError(f"varlen_attn cannot take these inputs: {problem}")
    return _call_varlen_attn(q, k, v, cu_seqlens, max_seqlen, softmax_scale)


def _call_varlen_attn(q, k, v, cu_seqlens, max_seqlen, softmax_scale) -> torch.Tensor:
    scale = {} if softmax_scale is None else {"scale": softmax_scale}
    return varlen_attn_api().fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **scale)


def takes_varlen_attn(q, k, v, cu_seqlens, dropout_p, softmax_scale) -> bool:
    """Whether torch's varlen_attn runs these inputs, forward and backward (:func:`varlen_attn_problem`)."""
    return not varlen_attn_problem(q, k, v, cu_seqlens, dropout_p, softmax_scale)


def varlen_attn_problem(q, k, v, cu_seqlens, dropout_p, softmax_scale) -> str:
    """Why torch's varlen_attn cannot run these inputs, forward and backward ("" if it can).

    Decided from dtypes, shapes, strides and the device only, never from tensor
    values, so that the model's forward compiles without graph breaks.
    """
    capability = cuda_capability(q.device)  # first: off CUDA, the API is never looked up
    if capability is None or capability < (8, 0):
        return "its inputs are not on a CUDA device of compute capability 8.0 or newer"
    api = varlen_attn_api()
    if api is None:
        return f"torch {torch.__version__} has no varlen_attn"
    if dropout_p > 0.0:
        return f"attention dropout (dropout_p={dropout_p})"
    if softmax_scale is not None and not api.takes_scale:
        return "a softmax_scale (this torch's varlen_attn takes none)"
    return flash_layout_problem(q, k, v, cu_seqlens, capability)


def flash_layout_problem(q, k, v, cu_seqlens, capability: tuple[int, int]) -> str:
    """What of the dtypes, the head dim, cu_seqlens and the devices FlashAttention-2's varlen kernels
    cannot take ("" if they can): torch's varlen_attn and flash-attn's share these rules."""
    head_dim = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"{q.dtype}/{k.dtype}/{v.dtype} inputs (it takes float16 or bfloat16, all alike)"
    if q.dim() != 3 or head_dim % 8 != 0 or head_dim > VARLEN_MAX_HEAD_DIM:
        return f"head_dim {head_dim} (it takes multiples of 8 up to {VARLEN_MAX_HEAD_DIM})"
    if cu_seqlens.dtype != torch.int32 or any(t.stride(-1) != 1 for t in (q, k, v)):
        return "int64 cu_seqlens or a strided last dimension"
    if any(t.device != q.device for t in (k, v, cu_seqlens)):
        return "its inputs are not all on one device"
    if head_dim > VARLEN_LARGE_HEAD_DIM and capability not in VARLEN_LARGE_HEAD_DIM_DEVICES:
        return f"head_dim {head_dim} on compute capability {capability} (above {VARLEN_LARGE_HEAD_DIM}: sm80, sm90)"
    return ""


@functools.cache
def flash_attn_api() -> Callable[..., torch.Tensor] | str:
    """flash-attn's ``flash_attn_varlen_func`` (the package transformers' ``flash_attention_2`` runs),
    or why it cannot be used: not installed, or not importable (a build for another torch or CUDA)."""
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed"
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as error:  # its extension built for another torch: say so, as a reason
        lines = str(error).strip().splitlines()
        return f"flash-attn does not import: {lines[0] if lines else type(error).__name__}"
    return flash_attn_varlen_func


def flash_attn_problem(q, k, v, cu_seqlens, dropout_p) -> str:
    """Why flash-attn's varlen attention cannot run these inputs, forward and backward ("" if it can)."""
    capability = cuda_capability(q.device)  # first: off CUDA, the package is never imported
    if capability is None or capability < (8, 0):
        return "its inputs are not on a CUDA device of compute capability 8.0 or newer"
    api = flash_attn_api()
    if isinstance(api, str):
        return api
    if dropout_p > 0.0:
        return f"attention dropout (dropout_p={dropout_p})"
    return flash_layout_problem(q, k, v, cu_seqlens, capability)


def flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale=None, window: int = GLOBAL) -> torch.Tensor:
    """flash-attn's varlen attention of the packed tokens (no dropout): every key of a query's sequence,
    or with a ``window`` those at most that far away (flash-attn's ``window_size``, whose -1 is
    :data:`GLOBAL`'s "no limit"). Raises a ``ValueError`` saying why where it cannot take the inputs."""
    problem = flash_attn_problem(q, k, v, cu_seqlens, 0.0)
    if problem:
        raise ValueError(f"flash-attn cannot take these inputs: {problem}")
    return flash_attn_api()(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=softmax_scale,
                            window_size=(window, window))


def varlen_attention_flash_attn(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None):
    """:func:`varlen_attention_ref` by flash-attn, where the package is installed (:func:`flash_attn_varlen`)."""
    if dropout_p > 0.0:
        raise ValueError(f"the race times flash-attn without dropout; got dropout_p={dropout_p}")
    return flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale)


def varlen_attention_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`varlen_attention_ref` on the fused kernels (no dropout: see :func:`_unsupported`)."""
    return FusedVarlenAttention.apply(q, k, v, cu_seqlens, max_seqlen, fused_scale(q, dropout_p, softmax_scale))


def varlen_attention_packed_fused(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`varlen_attention_fused` of ``qkv.unbind(1)``, read in place (:func:`varlen_attention_packed`).

    Compiled, it is the custom op :func:`packed_attention_fwd`, one node of the graph; eager, the
    same two kernel calls through :class:`FusedVarlenAttentionPacked`, whose dispatch costs less
    host time: 110-140 against 260 us per forward and backward on a CPU host (2026-11-28), 12
    of each per BERT-Base micro-batch, and the bench loop is host-bound."""
    return packed_fused(qkv, cu_seqlens, max_seqlen, fused_scale(qkv, dropout_p, softmax_scale))


def packed_fused(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, softmax_scale: float,
                 window: int = GLOBAL, rope_theta: float = 0.0) -> torch.Tensor:
    """The fused kernels on a packed ``qkv`` (T, 3, nh, hd), read in place: ``window`` tokens seen on
    each side (:data:`GLOBAL`: all), q and k rotated as they load where ``rope_theta`` > 0
    (``kernels/rotary_attention.py``); (T, nh, hd). The custom op compiled, the autograd Function eager."""
    if torch.compiler.is_compiling():
        return packed_attention_fwd(qkv, cu_seqlens, max_seqlen, softmax_scale, window, rope_theta)[0]
    return FusedVarlenAttentionPacked.apply(qkv, cu_seqlens, max_seqlen, softmax_scale, window, rope_theta)


def fused_scale(q: torch.Tensor, dropout_p: float, softmax_scale: float | None) -> float:
    """The softmax scale the fused kernels take (default 1/sqrt(head_dim)); they have no dropout."""
    if dropout_p > 0.0:
        raise ValueError(f"the fused attention kernel has no dropout; got dropout_p={dropout_p}")
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


# Every size is dynamic: the token count, the batch (cu_seqlens' length) and max_seqlen all
# change from batch to batch (kernels/compiled.py).
varlen_attention_compiled = CompiledReference(varlen_attention_ref, dynamic=True)

IMPLEMENTATIONS: dict[Impl, Callable[..., torch.Tensor]] = {
    "native": varlen_attention_native,
    "fused": varlen_attention_fused,
    "compiled": varlen_attention_compiled,
    "varlen_attn": varlen_attention_varlen_attn,
    "flash_attn": varlen_attention_flash_attn,
    "sdpa_flash": functools.partial(nested_sdpa, backend=SDPBackend.FLASH_ATTENTION),
    "sdpa_efficient": functools.partial(padded_sdpa, backend=SDPBackend.EFFICIENT_ATTENTION),
    "sdpa_cudnn": functools.partial(padded_sdpa, backend=SDPBackend.CUDNN_ATTENTION),
}


# The candidates that take a packed (T, 3, nh, hd) projection as it is; the others are handed its
# three views (:func:`packed_form`).
PACKED_IMPLEMENTATIONS: dict[Impl, Callable[..., torch.Tensor]] = {"fused": varlen_attention_packed_fused}


def packed_form(impl: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Candidate ``impl`` (``fn``: its form with q, k and v) on a packed projection ``qkv`` (T, 3, nh, hd):
    its packed kernel where it has one, else ``fn`` on the three views of ``qkv``. What the model
    runs (:func:`varlen_attention_packed`), and so what ``kernels=auto`` times."""
    packed = PACKED_IMPLEMENTATIONS.get(impl)
    if packed is not None:
        return packed

    def on_views(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None):
        return fn(*qkv.unbind(1), cu_seqlens, max_seqlen, dropout_p, softmax_scale)
    return on_views


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    *,
    backend: Backend,
) -> torch.Tensor:
    """:func:`varlen_attention_ref` on the resolved ``backend``."""
    impl = choose("varlen_attention", backend,
                  lambda name: _unsupported(name, q, k, v, cu_seqlens, dropout_p, softmax_scale))
    return IMPLEMENTATIONS[impl](q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale)


def varlen_attention_packed(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    *,
    backend: Backend,
) -> torch.Tensor:
    """:func:`varlen_attention` of ``q, k, v = qkv.unbind(1)``, for ``qkv`` (T, 3, nh, hd): the
    three projections of the tokens made by one GEMM. The same implementation runs as for
    :func:`varlen_attention`; the fused kernels read q, k and v in place, at the projection's
    token stride, and return the gradient of ``qkv`` in one piece, so that the GEMM's backward
    reads it as it is (no copy of q, k, v, no sum of three input gradients)."""
    q, k, v = qkv.unbind(1)
    impl = choose("varlen_attention", backend,
                  lambda name: _unsupported(name, q, k, v, cu_seqlens, dropout_p, softmax_scale))
    return packed_form(impl, IMPLEMENTATIONS[impl])(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale)


def _unsupported(impl: Impl, q, k, v, cu_seqlens, dropout_p, softmax_scale) -> str:
    """Why candidate ``impl`` cannot take these inputs ("" if it can).

    Every candidate declines attention dropout (the race timed and checked each without it)
    and, varlen_attn aside (its own rules), inputs off a CUDA device, where the race ran.
    """
    if dropout_p > 0.0:
        return f"attention dropout (dropout_p={dropout_p}) is not supported; set attention_dropout=0"
    if impl == "varlen_attn":
        return varlen_attn_problem(q, k, v, cu_seqlens, dropout_p, softmax_scale)
    if impl == "flash_attn":
        return flash_attn_problem(q, k, v, cu_seqlens, dropout_p)
    problem = "" if impl == "compiled" else _layout_problem(impl, q, k, v, cu_seqlens)  # compiled: any input
    if problem:
        return problem
    if not all(t.is_cuda for t in (q, k, v, cu_seqlens)):
        return "its inputs are not all on a CUDA device"
    return ""


def fused_problem(q, k, v, cu_seqlens, dropout_p) -> str:
    """Why the fused kernels cannot take these inputs ("" if they can), windowed or rotary alike:
    what :func:`varlen_attention` says of its fused candidate."""
    return _unsupported("fused", q, k, v, cu_seqlens, dropout_p, None)


def _layout_problem(impl: Impl, q, k, v, cu_seqlens) -> str:
    """What of the dtypes, the head dim and cu_seqlens the fused kernel or an SDPA backend cannot take."""
    dtypes = FUSED_DTYPES if impl == "fused" else SDPA_DTYPES[impl]
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"{q.dtype}/{k.dtype}/{v.dtype} inputs (it takes {' or '.join(map(str, dtypes))}, all alike)"
    head_dim = q.shape[-1]
    if impl != "fused":
        if q.dim() != 3 or head_dim % 8 or head_dim > SDPA_MAX_HEAD_DIM[impl]:
            return f"head_dim {head_dim} (it takes multiples of 8 up to {SDPA_MAX_HEAD_DIM[impl]})"
        return ""
    if q.dim() != 3 or head_dim not in FUSED_HEAD_DIMS:
        return f"head_dim {head_dim} (it takes {' or '.join(map(str, FUSED_HEAD_DIMS))})"
    if cu_seqlens.dtype != torch.int32:
        return f"{cu_seqlens.dtype} cu_seqlens (it takes int32)"
    return ""


class FusedVarlenAttention(torch.autograd.Function):
    """Varlen attention on the fused kernels: q, k, v (T, nh, hd), cu_seqlens (B+1,) int32; each
    query sees the keys at most ``window`` positions away (:data:`GLOBAL`: all of its sequence)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, softmax_scale, window=GLOBAL):
        out, lse = fused_extension().varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, 0.0, softmax_scale,
                                                          window)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.softmax_scale, ctx.window = max_seqlen, softmax_scale, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = fused_extension().varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen,
                                                            ctx.softmax_scale, ctx.window)
        return dq, dk, dv, None, None, None, None


# The packed fused attention, compiled, is a torch.library custom op, forward and backward,
# with their output shapes declared (register_fake) and the backward registered as the
# forward's gradient: torch.compile then keeps it as one opaque node of its graph, with
# symbolic token counts, and compiles what lies around it (the model's ``compile_layers``).
# An autograd.Function around the extension would break the graph in two at every layer; in
# eager mode it dispatches faster, and both make the same two calls (_packed_forward,
# _packed_backward). The extension is called on whatever device the inputs are on; off CUDA
# it does not load.

def _packed_forward(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, softmax_scale: float,
                    window: int, rope_theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``qkv`` (T, 3, nh, hd) -> (out (T, nh, hd), lse (nh, T) float32), q, k, v read in place."""
    q, k, v = qkv.unbind(1)
    return tuple(fused_extension().varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, 0.0, softmax_scale,
                                                        window, rope_theta))


def _packed_backward(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     cu_seqlens: torch.Tensor, max_seqlen: int, softmax_scale: float, window: int,
                     rope_theta: float) -> torch.Tensor:
    """The gradient of ``qkv`` (T, 3, nh, hd), in one contiguous piece laid out like it (of q and k
    as given: before the kernels rotated them)."""
    return fused_extension().varlen_attention_bwd_packed(dout, qkv, out, lse, cu_seqlens, max_seqlen, softmax_scale,
                                                         window, rope_theta)


class FusedVarlenAttentionPacked(torch.autograd.Function):
    """:class:`FusedVarlenAttention` of a packed projection ``qkv`` (T, 3, nh, hd), in eager mode."""

    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, softmax_scale, window, rope_theta):
        inputs = (qkv, cu_seqlens, max_seqlen, softmax_scale, window, rope_theta)
        out, lse = _packed_forward(*inputs)
        _save_for_packed_backward(ctx, inputs, (out, lse))
        return out

    @staticmethod
    def backward(ctx, dout):
        return _packed_gradient(ctx, dout, _packed_backward)


packed_attention_fwd = torch.library.custom_op("bert_ds::packed_attention_fwd", _packed_forward, mutates_args=())


@packed_attention_fwd.register_fake
def _packed_attention_fwd_shapes(qkv, cu_seqlens, max_seqlen, softmax_scale, window, rope_theta):
    total, _, heads, head_dim = qkv.shape
    return qkv.new_empty(total, heads, head_dim), qkv.new_empty(heads, total, dtype=torch.float32)


packed_attention_bwd = torch.library.custom_op("bert_ds::packed_attention_bwd", _packed_backward, mutates_args=())


@packed_attention_bwd.register_fake
def _packed_attention_bwd_shapes(dout, qkv, out, lse, cu_seqlens, max_seqlen, softmax_scale, window, rope_theta):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _save_for_packed_backward(ctx, inputs, output) -> None:
    """What both forms keep for the backward (the custom op's ``setup_context``)."""
    qkv, cu_seqlens, max_seqlen, softmax_scale, window, rope_theta = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse, cu_seqlens)
    ctx.options = max_seqlen, softmax_scale, window, rope_theta


def _packed_gradient(ctx, dout, backward):
    """The gradients of (qkv, cu_seqlens, max_seqlen, softmax_scale, window, rope_theta) by
    ``backward``, the kernel call itself (eager) or its custom op (compiled)."""
    qkv, out, lse, cu_seqlens = ctx.saved_tensors
    return backward(dout, qkv, out, lse, cu_seqlens, *ctx.options), None, None, None, None, None


packed_attention_fwd.register_autograd(  # lse is saved for the backward, never differentiated: its gradient unused
    lambda ctx, dout, dlse: _packed_gradient(ctx, dout, packed_attention_bwd), setup_context=_save_for_packed_backward)
