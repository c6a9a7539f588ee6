"""The fused attention's options, its own source run on the CPU emulator (tests/kernels/emulation.py):
a sliding window (kernels/local_attention.py's fused candidate) against ``local_attention_ref``,
and q, k rotated as their tiles load (kernels/rotary_attention.py) against the model's rotary
then the attention's reference; and copies of attention.cu with one planted mistake in either,
which must fail those comparisons.

The cases cover windows smaller and larger than the kernels' tiles (forward: 64 keys at head dim
64, 128 at 32; backward: 128 keys, 64 or 32 queries), sequences shorter than the window, ragged
batches whose later sequences start mid-tile (their rotary positions restart at 0), and both
backward paths (every sequence within one key tile, or not). Skipped without g++ or the CUDA
headers.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from bert_ds.kernels.local_attention import local_attention_ref
from bert_ds.kernels.rotary_attention import rotary_attention_ref
from tests.kernels import emulation
from tests.kernels.helpers import ATOL, assert_close_to_reference, cu_seqlens_of, rand
from tests.kernels.test_cuda_emulated import Emulated, run_ops_on


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if reason := emulation.unavailable():
        pytest.skip(reason)
    library = emulation.build_library(emulation.csrc_sources(), tmp_path_factory.mktemp("emu"))
    return Emulated(ctypes.CDLL(str(library)))


@pytest.fixture
def emulated_cuda(emu, monkeypatch):
    """``backend="cuda"`` runs the ops' fused path on this module's emulated library (test_cuda_emulated's)."""
    return run_ops_on(emu, monkeypatch)


def _grads(fn, leaves: dict, grad_out: torch.Tensor, dtype: torch.dtype | None = None) -> dict:
    """fn(**leaves) (in ``dtype`` where given) and the gradient of every leaf."""
    leaves = {name: (t.to(dtype) if dtype else t).detach().requires_grad_() for name, t in leaves.items()}
    out = fn(**leaves)
    out.backward(grad_out.to(out.dtype))
    return {"out": out.detach(), **{f"d{name}": t.grad for name, t in leaves.items()}}


def _assert_like_the_reference(ours: dict, reference, leaves: dict, grad_out: torch.Tensor, dtype) -> None:
    """Each of ``ours`` (out and every gradient) at most 2x as far from the reference's fp64 result
    as the reference run in ``dtype`` is, plus a small atol scaled to the values."""
    truth = _grads(reference, leaves, grad_out, torch.float64)
    same = _grads(reference, leaves, grad_out)
    for name, value in ours.items():
        atol = ATOL[dtype] * max(1.0, truth[name].abs().max().item())
        assert_close_to_reference(name, value, same[name], truth[name], atol)


# --------------------------------------------------------------------------- the sliding window

LOCAL_CASES = [  # (lengths, heads, head_dim, window)
    ([1, 200, 70, 5], 2, 64, 3),  # a window far inside one tile; several key tiles (general backward)
    ([300, 17], 1, 64, 100),  # wider than the forward's key tile, narrower than the backward's; 17 < window
    ([513, 3], 1, 32, 130),  # wider than every tile; 3 < window
    ([40, 9, 128], 2, 64, 64),  # ModernBERT's window; every sequence one key tile (one-tile backward)
    ([150, 2], 1, 32, 0),  # each query sees itself alone
    ([17, 390, 129], 1, 64, 64),  # ModernBERT's window over 4 key tiles: dQ in the parity slots
    ([260, 33], 1, 32, 64),  # the same at head dim 32
    # A window whose first needed key sits alone at the edge of the key tile before (the query tile's
    # first row, less the window, a multiple of the tile): a span one key short skips that tile, which
    # none of the windows above shows (forward's key tile 64 at head dim 64, 128 at 32).
    ([200, 70], 1, 64, 1),
    ([300, 40], 1, 64, 65),
    ([300, 9], 1, 32, 1),
    ([400, 50], 1, 32, 129),
]


def check_local_attention(emu, dtype, lengths, heads, head_dim, window) -> None:
    """The kernels' out, lse and gradients against ``local_attention_ref`` (lse against its
    definition: the log-sum-exp of the scaled scores over the keys within the window)."""
    total, max_seqlen, scale = sum(lengths), max(lengths), 1.0 / math.sqrt(head_dim)
    leaves = {name: rand(total, heads, head_dim, dtype=dtype, seed=seed) for name, seed in (("q", 1), ("k", 2), ("v", 3))}
    grad_out = rand(total, heads, head_dim, dtype=dtype, seed=4)
    cu_seqlens = cu_seqlens_of(lengths)
    q, k, v = leaves.values()
    out, lse = emu.varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, 0.0, scale, window)
    dq, dk, dv = emu.varlen_attention_bwd(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window)

    def reference(q, k, v):
        return local_attention_ref(q, k, v, cu_seqlens, max_seqlen, window, 0.0, scale)
    _assert_like_the_reference({"out": out, "dq": dq, "dk": dk, "dv": dv}, reference, leaves, grad_out, dtype)

    expected, start = [], 0
    for length in lengths:
        qs, ks = (leaves[n][start:start + length].double().transpose(0, 1) for n in ("q", "k"))  # (nh, L, hd)
        position = torch.arange(length)
        band = (position[:, None] - position[None, :]).abs() <= window
        scores = (scale * qs @ ks.transpose(1, 2)).masked_fill(~band, -math.inf)
        expected.append(torch.logsumexp(scores, dim=-1))  # (nh, L)
        start += length
    torch.testing.assert_close(lse.double(), torch.cat(expected, dim=1), rtol=0, atol=1e-4)


@pytest.mark.parametrize("lengths,heads,head_dim,window", LOCAL_CASES)
def test_windowed_attention_is_local_attention_ref(emu, lengths, heads, head_dim, window):
    check_local_attention(emu, torch.bfloat16, lengths, heads, head_dim, window)


def test_windowed_attention_in_float16(emu):
    check_local_attention(emu, torch.float16, [130, 7], 1, 64, 20)


@pytest.mark.parametrize("head_dim", [64, 32])
def test_windowed_one_tile_path_equals_the_general_path(emu, head_dim):
    """As without a window: max_seqlen 128 takes the one-tile backward, 129 the general one (its second
    key tile past every sequence); the same products in the same order make the same bits."""
    lengths, window = [1, 5, 70, 128], 5
    total, scale = sum(lengths), 1.0 / math.sqrt(head_dim)
    q, k, v, dout = (rand(total, 2, head_dim, dtype=torch.bfloat16, seed=seed) for seed in range(4))
    cu_seqlens = cu_seqlens_of(lengths)
    out, lse = emu.varlen_attention_fwd(q, k, v, cu_seqlens, 128, 0.0, scale, window)
    one_tile = emu.varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, 128, scale, window)
    general = emu.varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, 129, scale, window)
    for name, a, b in zip(("dq", "dk", "dv"), one_tile, general):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("head_dim", [64, 32])
def test_the_backward_sums_dq_in_parity_slots_where_the_window_allows(emu, head_dim):
    """The fp32 workspaces the backward sums dQ in: none where every sequence fits one key tile;
    two (each key tile stores to its parity's, no atomics) with a window of at most 64, whose
    key tiles t and t + 2 never share a dQ row; else one, which every key tile adds to atomically."""
    slots = emu.lib.bds_varlen_attention_bwd_dq_slots
    assert [slots(head_dim, 128, window) for window in (-1, 0, 64, 1000)] == [0, 0, 0, 0]
    assert [slots(head_dim, 8192, window) for window in (0, 1, 63, 64)] == [2, 2, 2, 2]
    assert [slots(head_dim, 129, window) for window in (-1, 65, 128, 2**31 - 1)] == [1, 1, 1, 1]

    # The backward's atomic adds (the emulator counts them): none with the slots, some with one workspace.
    lengths, scale = [300, 17], 1.0 / math.sqrt(head_dim)
    q, k, v, dout = (rand(sum(lengths), 1, head_dim, dtype=torch.bfloat16, seed=seed) for seed in range(4))
    cu_seqlens = cu_seqlens_of(lengths)
    atomic_adds = emu.lib.bds_emu_atomic_adds
    atomic_adds.restype = ctypes.c_longlong
    for window, atomics in ((64, False), (65, True)):
        out, lse = emu.varlen_attention_fwd(q, k, v, cu_seqlens, 300, 0.0, scale, window)
        before = atomic_adds()
        emu.varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, 300, scale, window)
        assert (atomic_adds() > before) == atomics, (window, atomic_adds() - before)


def test_a_window_wider_than_every_sequence_is_the_global_attention(emu):
    """The window's kernels with nothing outside the window compute what the global ones do, bit for bit."""
    lengths = [1, 130, 64, 17]
    total, max_seqlen = sum(lengths), max(lengths)
    q, k, v, dout = (rand(total, 2, 64, dtype=torch.bfloat16, seed=seed) for seed in range(4))
    cu_seqlens = cu_seqlens_of(lengths)
    results = []
    for window in (-1, max_seqlen):
        out, lse = emu.varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, 0.0, 0.125, window)
        results.append((out, lse, *emu.varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, 0.125,
                                                            window)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- rotary embeddings

ROTARY_CASES = [  # (lengths, heads, head_dim, window, rope_theta)
    ([1, 130, 64, 17], 2, 64, None, 160000.0),  # global, several key tiles
    ([70, 5, 33], 1, 32, None, 10000.0),  # global, one key tile
    ([200, 9], 2, 64, 64, 10000.0),  # a local layer of ModernBERT's
    ([40, 3], 1, 32, 8, 10000.0),  # local, one key tile
]


def check_rotary_attention(emu, lengths, heads, head_dim, window, rope_theta, dtype=torch.bfloat16) -> None:
    """The kernels on an unrotated packed projection, rotating q and k as they load them, against the
    model's rotary then the attention's reference: the output and the projection's gradient."""
    total, max_seqlen, scale = sum(lengths), max(lengths), 1.0 / math.sqrt(head_dim)
    qkv = rand(total, 3, heads, head_dim, dtype=dtype, seed=5)
    grad_out = rand(total, heads, head_dim, dtype=dtype, seed=6)
    cu_seqlens = cu_seqlens_of(lengths)
    window_arg = -1 if window is None else window
    out, lse = emu.varlen_attention_fwd_packed(qkv, cu_seqlens, max_seqlen, scale, window_arg, rope_theta)
    dqkv = emu.varlen_attention_bwd_packed(grad_out, qkv, out, lse, cu_seqlens, max_seqlen, scale, window_arg,
                                           rope_theta)

    def reference(qkv):
        return rotary_attention_ref(qkv, cu_seqlens, max_seqlen, rope_theta, window, 0.0, scale)
    _assert_like_the_reference({"out": out, "dqkv": dqkv}, reference, {"qkv": qkv}, grad_out, dtype)


@pytest.mark.parametrize("lengths,heads,head_dim,window,rope_theta", ROTARY_CASES)
def test_rotary_attention_is_the_model_s_rotary_then_the_reference(emu, lengths, heads, head_dim, window, rope_theta):
    check_rotary_attention(emu, lengths, heads, head_dim, window, rope_theta)


def test_rotary_attention_in_float16(emu):
    check_rotary_attention(emu, [130, 7], 1, 64, 20, 10000.0, torch.float16)


# --------------------------------------------------------------------------- the ops' fused paths

def test_the_local_attention_op_runs_the_emulated_kernels_through_autograd(emulated_cuda):
    """kernels=cuda's local attention: the fused candidate (the autograd Function, the binding's API)."""
    from bert_ds.kernels.ops import local_attention

    lengths, window = [3, 70, 1], 16
    cu_seqlens = cu_seqlens_of(lengths)
    leaves = {name: rand(sum(lengths), 2, 64, dtype=torch.bfloat16, seed=seed) for name, seed in (("q", 7), ("k", 8),
                                                                                                  ("v", 9))}
    grad_out = rand(sum(lengths), 2, 64, dtype=torch.bfloat16, seed=10)
    ours = _grads(lambda **t: local_attention(**t, cu_seqlens=cu_seqlens, max_seqlen=70, window=window,
                                              backend="cuda"), leaves, grad_out)
    _assert_like_the_reference(ours, lambda **t: local_attention_ref(**t, cu_seqlens=cu_seqlens, max_seqlen=70,
                                                                     window=window), leaves, grad_out, torch.bfloat16)


@pytest.mark.parametrize("window", [None, 8])
def test_rotary_attention_runs_the_emulated_kernels_through_autograd(emulated_cuda, window):
    """What a ModernBERT layer runs under kernels=cuda: the unrotated projection to the fused kernels
    (the eager autograd Function), its gradient in one piece."""
    from bert_ds.kernels.ops import rotary_attention_fused
    from bert_ds.kernels.rotary_attention import rotary_impl

    lengths = [3, 70, 1]
    cu_seqlens = cu_seqlens_of(lengths)
    qkv = rand(sum(lengths), 3, 2, 32, dtype=torch.bfloat16, seed=11)
    grad_out = rand(sum(lengths), 2, 32, dtype=torch.bfloat16, seed=12)
    assert rotary_impl(qkv, cu_seqlens, window, 0.0, "cuda") == "fused"
    assert rotary_impl(qkv, cu_seqlens, window, 0.0, "torch") == "native"
    ours = _grads(lambda qkv: rotary_attention_fused(qkv, cu_seqlens, 70, 10000.0, window), {"qkv": qkv}, grad_out)
    _assert_like_the_reference(ours, lambda qkv: rotary_attention_ref(qkv, cu_seqlens, 70, 10000.0, window),
                               {"qkv": qkv}, grad_out, torch.bfloat16)


@pytest.mark.parametrize("window", [None, 8])
def test_kernels_cuda_names_the_head_dim_the_kernels_do_not_take(emulated_cuda, window):
    """One error, naming the setting and the head dim; the same inputs run the native op under torch."""
    from bert_ds.kernels.dispatch import KernelUnavailable
    from bert_ds.kernels.rotary_attention import rotary_impl

    qkv, cu_seqlens = rand(9, 3, 2, 48, dtype=torch.bfloat16), cu_seqlens_of([4, 5])
    op = "varlen_attention" if window is None else "local_attention"
    with pytest.raises(KernelUnavailable, match=rf"^kernels=cuda: {op} cannot run fused: head_dim 48 \(it takes 32 "
                                                rf"or 64\)$"):
        rotary_impl(qkv, cu_seqlens, window, 0.0, "cuda")
    assert rotary_impl(qkv, cu_seqlens, window, 0.0, "torch") == "native"


def test_the_local_attention_kernels_pass_the_self_check(emulated_cuda):
    """The GPU's self-check of the op on the emulated kernels: windows inside a tile, 64 and wider than
    every tile, both dtypes, and the windowed rotary path."""
    from bert_ds.kernels import selfcheck
    from bert_ds.kernels.local_attention import local_attention_fused
    from bert_ds.kernels.rotary_attention import rotary_attention_fused

    assert selfcheck.check_local_attention(local_attention_fused, torch.device("cpu"),
                                           rotary=rotary_attention_fused) == []


# --------------------------------------------------------------------------- planted mistakes

# Copies of attention.cu with one planted mistake: (after this anchor, this text, becomes this, the
# check that must then fail). Each runs in a child interpreter: a mistake may also make the
# emulator end the run (a read of dS^T rows no warp wrote), which fails it as well.
PLANTED = {
    "forward: the window's edge off by one": (
        "attention_fwd_kernel(", "(row - key > w || key - row > w)", "(row - key >= w || key - row >= w)", "window"),
    "window_span: the first key one too far right": (
        "Span window_span(", "const int lo = first - window, hi", "const int lo = first - window + 1, hi", "window"),
    "backward: the window's edge off by one": (
        "attention_bwd_kernel(", "(apart <= w && apart >= -w)", "(apart < w && apart > -w)", "window"),
    "forward: the first key tile it needs skipped": (
        "attention_fwd_kernel(", "const int first_n0 = keys.lo / kBlockN * kBlockN;",
        "const int first_n0 = (keys.lo / kBlockN + 1) * kBlockN;", "window"),
    "backward: the first query tile it needs skipped": (
        "attention_bwd_kernel(", "const int first_m0 = rows.lo;", "const int first_m0 = rows.lo + kBlockM;",
        "window"),
    "backward: a warp skips a query tile it sees": (
        "attention_bwd_kernel(", "within_window(n0 + key0, n0 + key0 + 16 * MT - 1, m0, last_query, w)",
        "within_window(n0 + key0, n0 + key0 + 16 * MT - 1, m0, m0, w)", "window"),
    "backward: every key tile's dQ in the slot of parity 0": (
        "attention_bwd_kernel(", "dq_accum + (int64_t)(blockIdx.x % 2) * total * row_stride", "dq_accum", "window"),
    "dQ's slots: the key tile before a row's own not summed": (
        "dq_slots_kernel(", "for (int t = p / kBlockN > 0 ? p / kBlockN - 1 : 0;", "for (int t = p / kBlockN;",
        "window"),
    "launcher: slots for windows up to 128, whose key tiles t and t + 2 share rows": (
        "int bwd_dq_slots(", "window <= kBlockN / 2 ?", "window <= kBlockN ?", "window"),
    "rotary: pairs (2i, 2i + 1) instead of (d, d + hd/2)": (
        "void rotate_own_pairs(",
        """      const float a = to_float(x1[e]), b = to_float(x2[e]);
      x1[e] = from_float<T>(a * co - b * s);
      x2[e] = from_float<T>(b * co + a * s);""",
        """      T* const x = e < 4 ? x1 : x2;  // element pairs within a chunk, as GPT-J's rotary has them
      const int i = 2 * (e % 4);
      const float a = to_float(x[i]), b = to_float(x[i + 1]);
      x[i] = from_float<T>(a * co - b * s);
      x[i + 1] = from_float<T>(b * co + a * s);""", "rotary"),
    "rotary: q's positions counted in the batch, not per sequence": (
        "attention_fwd_kernel(", "rotate_own_pairs<T, HD, kFwdBlockM, kFwdThreads>(q_stage, len - m0, m0, freqs)",
        "rotate_own_pairs<T, HD, kFwdBlockM, kFwdThreads>(q_stage, len - m0, start + m0, freqs)", "rotary"),
    "rotary: dK turned back at positions counted in the batch": (
        "attention_bwd_kernel(", "unrotate(dk_acc[mt][dt][2 * i + c], dk_acc[mt][dt + HD / 16][2 * i + c], key,",
        "unrotate(dk_acc[mt][dt][2 * i + c], dk_acc[mt][dt + HD / 16][2 * i + c], start + key,", "rotary"),
}

_RUN_CHECK = """
import ctypes
import torch
from tests.kernels.test_attention_options_emulated import check_local_attention, check_rotary_attention
from tests.kernels.test_cuda_emulated import Emulated

emu = Emulated(ctypes.CDLL({library!r}))
try:
    if {check!r} == "window":
        check_local_attention(emu, torch.bfloat16, [300, 17], 1, 64, 100)
        check_local_attention(emu, torch.bfloat16, [40, 9, 128], 1, 64, 64)
        check_local_attention(emu, torch.bfloat16, [17, 300], 1, 64, 64)
        check_local_attention(emu, torch.bfloat16, [300, 40], 1, 64, 65)  # a needed key alone at a tile's edge
    else:
        check_rotary_attention(emu, [200, 9], 1, 64, 64, 10000.0)
except AssertionError as error:
    print("comparison failed:", str(error).splitlines()[0])
else:
    print("every comparison passed")
"""


def _run_check(library: str, check: str) -> emulation.Outcome:
    return emulation.run_python(_RUN_CHECK.format(library=library, check=check))


@pytest.mark.parametrize("check", ["window", "rotary"])
def test_the_checks_for_the_planted_mistakes_pass_on_the_real_source(emu, check):
    outcome = _run_check(emu.lib._name, check)
    assert outcome.returncode == 0 and "every comparison passed" in outcome.stdout, outcome.stdout + outcome.stderr[-2000:]


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_planted_mistake_fails_the_window_or_rotary_comparison(tmp_path, planted):
    if reason := emulation.unavailable():
        pytest.skip(reason)
    anchor, old, new, check = PLANTED[planted]
    source = (emulation.CSRC / "attention.cu").read_text()
    at = source.index(old, source.index(anchor, source.index("namespace bds")))  # in the definition named
    sources = {"attention.cu": source[:at] + new + source[at + len(old):],
               "common.cuh": (emulation.CSRC / "common.cuh").read_text()}  # it launches a kernel too: rewritten
    # the check's one configuration alone: bf16, head dim 64, windowed, rotary or not (3 of 48 kernels)
    library = emulation.build_library(sources, tmp_path, dtype="BDS_BFLOAT16", defines={
        "BDS_EMULATE_HEAD_DIM": 64, "BDS_EMULATE_WINDOWED": 1, "BDS_EMULATE_ROTARY": int(check == "rotary")})
    outcome = _run_check(str(library), check)
    assert "every comparison passed" not in outcome.stdout, f"{planted}: the planted mistake went unnoticed"
    assert "comparison failed" in outcome.stdout or outcome.emu_error, outcome.stdout + outcome.stderr[-2000:]
