"""The CUDA kernels' own source, run on the CPU: logic tests without a GPU.

``kernels/csrc/*.cu`` are compiled as C++ against ``tests/kernels/emu/cuda_runtime.h``
(threads as fibers, warp shuffles, ldmatrix and mma.sync by the PTX fragment layouts)
by ``tests/kernels/emulation.py`` into a shared library whose ``extern "C"`` launchers
are called through ctypes on CPU tensors, and compared with the references as the GPU
tests do. This covers indexing, tiling, masking, barriers and the fast/general path
choice on every CI run. The attention's shared memory is checked on every access: a
cp.async copy lands only at the wait that covers it, and a read of bytes in flight or a
cross-warp access with no barrier between ends the run with an ``emu:`` report, which
copies of the kernel with a wait or a barrier removed must produce. It cannot cover
timing, real concurrency or the hardware itself (tests/kernels/test_cuda_ops.py does, on
a GPU). Skipped without g++ or the CUDA headers.
"""

import contextlib
import ctypes
import dataclasses
import importlib
import math
import re

import pytest
import torch

from bert_ds.kernels import ops as kernels
from bert_ds.model.padding import IGNORE_INDEX
from tests.kernels import emulation
from bert_ds.kernels.selfcheck import mlm_rows
from tests.kernels.helpers import (
    ATOL, assert_close_to_reference, attention_per_sequence, cu_seqlens_of, dropout_keep, dropout_layer_norm_fp64,
    dropout_layer_norm_same_dtype, geglu_fp64, geglu_same_dtype, gelu_fp64, gelu_same_dtype, layer_norm_fp64,
    layer_norm_same_dtype, misaligned, mlm_cross_entropy_fp64, rand, scaled_atol,
)

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if reason := emulation.unavailable():
        pytest.skip(reason)
    library = emulation.build_library(emulation.csrc_sources(), tmp_path_factory.mktemp("emu"))
    return Emulated(ctypes.CDLL(str(library)))


GUARD = 64  # guard elements before and after every float buffer the kernels see
SENTINEL = -7777.0  # the guard value of outputs: a stray write of anything (NaN included) changes it


class Emulated:
    """The launchers behind the API of the extension module (kernels/csrc/bindings.cpp):
    same functions, arguments and results, inputs made contiguous the same way.

    Every float buffer handed to a kernel sits between two guard zones: NaN around inputs,
    so that a read out of bounds poisons the result (the tests check that outputs are
    finite); a finite sentinel around outputs and workspaces (which start as NaN), so
    that a write out of bounds shows when the guards are checked after the launch.
    Deliberately misaligned inputs are passed as they are, to keep their misalignment.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float  # noqa: E741 (as in C: I is int)
        U = ctypes.c_uint64
        signatures = {
            "bds_layer_norm_fwd": [P, P, P, P, P, P, P, L, I, F, I, I, I, P],
            "bds_layer_norm_bwd_parts": [L, I],
            "bds_layer_norm_bwd": [P, P, P, P, P, P, P, P, P, P, P, I, L, I, I, I, I, P],
            "bds_dropout_layer_norm_fwd": [P, P, P, P, P, P, P, P, P, L, I, F, F, U, U, I, I, I, P],
            "bds_dropout_layer_norm_bwd_parts": [L, I],
            "bds_dropout_layer_norm_bwd": [P, P, P, P, P, P, P, P, P, P, P, I, L, I, F, U, U, I, I, I, P],
            "bds_bias_gelu_fwd": [P, P, P, L, I, I, I, I, P],
            "bds_bias_gelu_bwd_parts": [L, I],
            "bds_bias_gelu_bwd": [P, P, P, P, P, P, I, L, I, I, I, I, P],
            "bds_geglu_fwd": [P, P, L, I, I, I, P],
            "bds_geglu_bwd": [P, P, P, L, I, I, I, P],
            "bds_varlen_attention_fwd": [P, P, P, P, P, P, I, L, L, I, I, I, I, F, F, I, P],
            "bds_varlen_attention_bwd": [P, P, P, P, P, P, P, P, P, P, P, P, I, L, L, L, I, I, I, I, F, F, I, P],
            "bds_varlen_attention_bwd_dq_slots": [I, I, I],
            "bds_mlm_cross_entropy_fwd": [P, P, P, P, P, L, I, L, I, P],
            "bds_mlm_cross_entropy_bwd": [P, P, P, P, P, L, I, L, I, P],
            "bds_lamb_moments": [P, P, P, P, P, P, P, P, L, F, F, F, F, F, P],
            "bds_lamb_apply": [P, P, P, P, P, P, P, F, L, F, F, F, F, F, P],
        }
        for name, argtypes in signatures.items():
            if not hasattr(lib, name):  # a library of some of the sources (an edited copy of one kernel)
                continue
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        self.lib = lib
        self.guards: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, its guard value)

    def _guarded(self, t: torch.Tensor | None, guard: float = float("nan")) -> torch.Tensor | None:
        """``t`` (made contiguous) between guard zones; misaligned tensors stay where they are."""
        if t is None:
            return None
        t = t.contiguous()
        if not t.is_floating_point() or t.data_ptr() % 16 != 0:
            return t
        buffer = torch.full((t.numel() + 2 * GUARD,), guard, dtype=t.dtype)
        self.guards.append((buffer, buffer[:1].clone()))
        return buffer[GUARD:GUARD + t.numel()].view(t.shape).copy_(t)

    def _empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return self._guarded(torch.full(shape, float("nan"), dtype=dtype), guard=SENTINEL)

    def _flags(self, n: int) -> torch.Tensor:
        """n output bytes between guards of 7, each 7 until written: a kernel must leave 0 or 1 in every one."""
        buffer = torch.full((n + 2 * GUARD,), 7, dtype=torch.uint8)
        self.guards.append((buffer, buffer[:1].clone()))
        return buffer[GUARD:GUARD + n]

    def _call(self, name, *args):
        err = getattr(self.lib, name)(*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])
        assert err == 0, f"{name} returned cudaError {err}"
        for buffer, value in self.guards:
            zones = torch.cat([buffer[:GUARD], buffer[-GUARD:]])
            intact = zones.isnan().all() if value.isnan().all() else (zones == value).all()
            assert intact, f"{name} wrote out of bounds"
        self.guards.clear()

    def layer_norm_fwd(self, x, weight, bias, residual, eps):
        x, weight, bias, residual = map(self._guarded, (x, weight, bias, residual))
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        y = self._empty(*x.shape, dtype=x.dtype)
        mean, rstd = self._empty(rows, dtype=torch.float32), self._empty(rows, dtype=torch.float32)
        self._call("bds_layer_norm_fwd", x, residual, weight, bias, y, mean, rstd, rows, hidden, eps,
                   CODES[x.dtype], CODES[(residual if residual is not None else x).dtype], CODES[weight.dtype], None)
        return y, mean, rstd

    def layer_norm_bwd(self, dy, x, residual, weight, mean, rstd, with_bias=True):
        dy, x, residual, weight, mean, rstd = map(self._guarded, (dy, x, residual, weight, mean, rstd))
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        parts = self.lib.bds_layer_norm_bwd_parts(rows, hidden)
        # every part must be written; without a bias the binding's workspace is half as large
        workspace = self._empty((2 if with_bias else 1) * parts * hidden, dtype=torch.float32)
        dx = self._empty(*x.shape, dtype=x.dtype)
        dw = self._empty(hidden, dtype=weight.dtype)
        db = self._empty(hidden, dtype=weight.dtype) if with_bias else None
        separate = residual is not None and residual.dtype != x.dtype
        dresidual = self._empty(*residual.shape, dtype=residual.dtype) if separate else None
        self._call("bds_layer_norm_bwd", dy, x, residual, weight, mean, rstd, dx, dresidual, dw, db, workspace, parts,
                   rows, hidden, CODES[x.dtype], CODES[(residual if residual is not None else x).dtype],
                   CODES[weight.dtype], None)
        return dx, dw, db, (dresidual if separate else dx if residual is not None else None)

    def dropout_layer_norm_fwd(self, x, bias, residual, weight, ln_bias, eps, dropout_p, seed, offset, keep_out):
        x, bias, residual, weight, ln_bias = map(self._guarded, (x, bias, residual, weight, ln_bias))
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        y = self._empty(*x.shape, dtype=x.dtype)
        mean, rstd = self._empty(rows, dtype=torch.float32), self._empty(rows, dtype=torch.float32)
        keep = None if keep_out is None else self._flags(keep_out.numel())
        self._call("bds_dropout_layer_norm_fwd", x, bias, residual, weight, ln_bias, y, mean, rstd, keep, rows, hidden,
                   eps, dropout_p, seed, offset, CODES[x.dtype], CODES[residual.dtype], CODES[weight.dtype], None)
        if keep is not None:
            assert int(keep.max()) <= 1, "the forward left keep_out bytes unwritten or wrote other values"
            keep_out.copy_(keep.view(keep_out.shape).bool())
        return y, mean, rstd

    def dropout_layer_norm_bwd(self, dy, x, bias, residual, weight, mean, rstd, dropout_p, seed, offset):
        dy, x, bias, residual, weight, mean, rstd = map(self._guarded, (dy, x, bias, residual, weight, mean, rstd))
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        parts = self.lib.bds_dropout_layer_norm_bwd_parts(rows, hidden)
        workspace = self._empty(3 * parts * hidden, dtype=torch.float32)  # every part must be written
        dx, dresidual = self._empty(*x.shape, dtype=x.dtype), self._empty(*residual.shape, dtype=residual.dtype)
        dparams = self._empty(3, hidden, dtype=weight.dtype)
        self._call("bds_dropout_layer_norm_bwd", dy, x, bias, residual, weight, mean, rstd, dx, dresidual, dparams,
                   workspace, parts, rows, hidden, dropout_p, seed, offset, CODES[x.dtype], CODES[residual.dtype],
                   CODES[weight.dtype], None)
        return dx, (dparams[2] if bias is not None else None), dresidual, dparams[0], dparams[1]

    def bias_gelu_fwd(self, x, bias, tanh_approx):
        x, bias = self._guarded(x), self._guarded(bias)
        y = self._empty(*x.shape, dtype=x.dtype)
        self._call("bds_bias_gelu_fwd", x, bias, y, x.numel() // x.shape[-1], x.shape[-1], int(tanh_approx),
                   CODES[x.dtype], CODES[bias.dtype], None)
        return y

    def bias_gelu_bwd(self, dy, x, bias, tanh_approx):
        dy, x, bias = map(self._guarded, (dy, x, bias))
        rows, cols = x.numel() // x.shape[-1], x.shape[-1]
        parts = self.lib.bds_bias_gelu_bwd_parts(rows, cols)
        workspace = self._empty(parts * cols, dtype=torch.float32)
        dx, db = self._empty(*x.shape, dtype=x.dtype), self._empty(cols, dtype=bias.dtype)
        self._call("bds_bias_gelu_bwd", dy, x, bias, dx, db, workspace, parts, rows, cols, int(tanh_approx),
                   CODES[x.dtype], CODES[bias.dtype], None)
        return dx, db

    def geglu_fwd(self, x, tanh_approx):
        x = self._guarded(x)
        cols = x.shape[-1] // 2
        y = self._empty(*x.shape[:-1], cols, dtype=x.dtype)
        self._call("bds_geglu_fwd", x, y, y.numel() // cols, cols, int(tanh_approx), CODES[x.dtype], None)
        return y

    def geglu_bwd(self, dy, x, tanh_approx):
        dy, x = self._guarded(dy), self._guarded(x)
        cols = x.shape[-1] // 2
        dx = self._empty(*x.shape, dtype=x.dtype)
        self._call("bds_geglu_bwd", dy, x, dx, dy.numel() // cols, cols, int(tanh_approx), CODES[x.dtype], None)
        return dx

    # window: < 0 every key, else the tokens seen on each side; rope_theta: 0, or the rotary base of q and k
    def varlen_attention_fwd(self, q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, window=-1,
                             rope_theta=0.0):
        assert dropout_p == 0.0, "the binding refuses dropout"
        q, k, v = map(self._guarded, (q, k, v))
        return self._attention_fwd(q, k, v, q.shape[1] * q.shape[2], cu_seqlens, max_seqlen, softmax_scale, window,
                                   rope_theta)

    def varlen_attention_fwd_packed(self, qkv, cu_seqlens, max_seqlen, softmax_scale, window=-1, rope_theta=0.0):
        """q, k, v read in place from one (total, 3, heads, head_dim) projection, as the binding does."""
        qkv = self._guarded(qkv)
        return self._attention_fwd(*qkv.unbind(1), qkv.stride(0), cu_seqlens, max_seqlen, softmax_scale, window,
                                   rope_theta)

    def _attention_fwd(self, q, k, v, qkv_stride, cu_seqlens, max_seqlen, softmax_scale, window, rope_theta):
        total, heads, head_dim = q.shape
        out = self._empty(total, heads, head_dim, dtype=q.dtype)
        lse = self._empty(heads, total, dtype=torch.float32)
        self._call("bds_varlen_attention_fwd", q, k, v, cu_seqlens, out, lse, cu_seqlens.numel() - 1, total,
                   qkv_stride, heads, head_dim, max_seqlen, max(window, -1), rope_theta, softmax_scale,
                   CODES[q.dtype], None)
        return out, lse

    def varlen_attention_bwd(self, dout, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, window=-1,
                             rope_theta=0.0):
        q, k, v = map(self._guarded, (q, k, v))
        grads = [self._empty(*q.shape, dtype=q.dtype) for _ in range(3)]
        stride = q.shape[1] * q.shape[2]
        self._attention_bwd(dout, q, k, v, stride, out, lse, cu_seqlens, max_seqlen, softmax_scale, window,
                            rope_theta, grads, stride)
        return tuple(grads)

    def varlen_attention_bwd_packed(self, dout, qkv, out, lse, cu_seqlens, max_seqlen, softmax_scale, window=-1,
                                    rope_theta=0.0):
        """dq, dk, dv written into one (total, 3, heads, head_dim) gradient, as the binding does."""
        qkv = self._guarded(qkv)
        dqkv = self._empty(*qkv.shape, dtype=qkv.dtype)
        self._attention_bwd(dout, *qkv.unbind(1), qkv.stride(0), out, lse, cu_seqlens, max_seqlen, softmax_scale,
                            window, rope_theta, dqkv.unbind(1), dqkv.stride(0))
        return dqkv

    def _attention_bwd(self, dout, q, k, v, qkv_stride, out, lse, cu_seqlens, max_seqlen, softmax_scale, window,
                       rope_theta, grads, dqkv_stride):
        dout, out, lse = map(self._guarded, (dout, out, lse))
        total, heads, head_dim = q.shape
        slots = self.lib.bds_varlen_attention_bwd_dq_slots(head_dim, max_seqlen, max(window, -1))
        dq_accum = self._empty(slots, total, heads, head_dim, dtype=torch.float32) if slots else None
        dsum = self._empty(heads, total, dtype=torch.float32)
        self._call("bds_varlen_attention_bwd", dout, q, k, v, out, lse, cu_seqlens, *grads, dq_accum, dsum,
                   cu_seqlens.numel() - 1, total, qkv_stride, dqkv_stride, heads, head_dim, max_seqlen,
                   max(window, -1), rope_theta, softmax_scale, CODES[q.dtype], None)

    def mlm_cross_entropy_fwd(self, logits, labels, ignore_index):
        logits, labels = self._guarded(logits), labels.contiguous()
        rows, cols = logits.shape
        loss, lse = self._empty(rows, dtype=torch.float32), self._empty(rows, dtype=torch.float32)
        correct = self._flags(rows)
        self._call("bds_mlm_cross_entropy_fwd", logits, labels, loss, lse, correct, rows, cols, ignore_index,
                   CODES[logits.dtype], None)
        assert rows == 0 or int(correct.max()) <= 1, "the forward left correct bytes unwritten or wrote other values"
        return loss, lse, correct.bool()

    def mlm_cross_entropy_bwd(self, dloss, logits, labels, lse, ignore_index):
        scale, logits, lse = map(self._guarded, (dloss.float().reshape(1), logits, lse))
        dlogits = self._empty(*logits.shape, dtype=logits.dtype)
        self._call("bds_mlm_cross_entropy_bwd", scale, logits, labels.contiguous(), lse, dlogits, *logits.shape,
                   ignore_index, CODES[logits.dtype], None)
        return dlogits

    def lamb_moments(self, grad, exp_avg, exp_avg_sq, param, offsets, lengths, beta1, beta2, step_size, eps_hat,
                     weight_decay, norms, skip=None):
        grad, m, v, param, skip = map(self._guarded, (grad, exp_avg, exp_avg_sq, param, skip))
        squares = self._empty(offsets.numel() if norms else 0, 2, dtype=torch.float32)
        self._call("bds_lamb_moments", grad, m, v, param, offsets, lengths, squares if norms else None, skip,
                   offsets.numel(), beta1, beta2, step_size, eps_hat, weight_decay, None)
        exp_avg.copy_(m), exp_avg_sq.copy_(v)  # in place, as the binding: the kernel wrote the guarded copies
        return squares

    def lamb_apply(self, param, exp_avg, exp_avg_sq, offsets, lengths, scales, uniform_scale, beta1, beta2,
                   step_size, eps_hat, weight_decay, skip=None):
        w, m, v, scales_g, skip = map(self._guarded, (param, exp_avg, exp_avg_sq, scales, skip))
        self._call("bds_lamb_apply", m, v, w, offsets, lengths, scales_g, skip, uniform_scale, offsets.numel(), beta1,
                   beta2, step_size, eps_hat, weight_decay, None)
        param.copy_(w)


def _fp64_grads(fn, inputs: dict, grad_out: torch.Tensor) -> dict:
    leaves = {name: t.double().requires_grad_() for name, t in inputs.items()}
    fn(**leaves).backward(grad_out.double())
    return {name: t.grad for name, t in leaves.items()}


def _same_dtype_grads(fn, inputs: dict, grad_out: torch.Tensor) -> dict:
    leaves = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
    fn(**leaves).backward(grad_out)
    return {name: t.grad for name, t in leaves.items()}


# --------------------------------------------------------------------------- layer norm

LN_CASES = [  # (rows, hidden, aligned): 768/1024 aligned take the register path, the rest the general one
    (6, 768, True), (5, 1024, True), (3, 1023, True), (4, 7, True), (3, 768, False), (2, 64, True),
    (37, 1024, True), (37, 1023, True),  # more rows than the emulated device holds warps: the grid strides
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,aligned", LN_CASES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_layer_norm(emu, dtype, rows, hidden, aligned, with_residual):
    eps = 1e-5
    inputs = {
        "x": rand(rows, hidden, dtype=dtype, seed=1, scale=2.0, shift=0.3),
        "weight": rand(hidden, dtype=dtype, seed=3, shift=1.0),
        "bias": rand(hidden, dtype=dtype, seed=4),
    }
    if with_residual:
        inputs["residual"] = rand(rows, hidden, dtype=dtype, seed=2)
    if not aligned:
        inputs = {name: misaligned(t) if t.dim() == 2 else t for name, t in inputs.items()}
    grad_out = rand(rows, hidden, dtype=dtype, seed=5)

    y, mean, rstd = emu.layer_norm_fwd(inputs["x"], inputs["weight"], inputs["bias"], inputs.get("residual"), eps)
    dx, dw, db, dres = emu.layer_norm_bwd(grad_out, inputs["x"], inputs.get("residual"), inputs["weight"], mean, rstd)

    def truth_fn(**t):
        return layer_norm_fp64(eps=eps, **t)

    def torch_fn(**t):
        return layer_norm_same_dtype(eps=eps, **{k: v.float() if dtype == torch.float32 else v for k, v in t.items()})

    atol = ATOL[dtype]
    assert_close_to_reference("y", y, torch_fn(**inputs), truth_fn(**inputs), atol)
    truth, same = _fp64_grads(truth_fn, inputs, grad_out), _same_dtype_grads(torch_fn, inputs, grad_out)
    ours = {"x": dx, "weight": dw, "bias": db, "residual": dres}
    for name in inputs:
        assert_close_to_reference(f"d{name}", ours[name], same[name], truth[name], atol * rows)


def check_layer_norm_without_bias(emu, dtype, rows, hidden, aligned):
    """ModernBERT's LayerNorm (no bias, no residual): the output, dx and dweight against fp64; the
    backward writes no bias gradient (its dbias is NULL) and its partial sums fit the bias-free
    workspace, half the size (a row written past it hits the guards). Raises AssertionError on
    the first difference."""
    inputs = {"x": rand(rows, hidden, dtype=dtype, seed=1, scale=2.0, shift=0.3),
              "weight": rand(hidden, dtype=dtype, seed=3, shift=1.0)}
    if not aligned:
        inputs["x"] = misaligned(inputs["x"])
    grad_out = rand(rows, hidden, dtype=dtype, seed=5)
    y, mean, rstd = emu.layer_norm_fwd(inputs["x"], inputs["weight"], None, None, 1e-5)
    dx, dw, db, _ = emu.layer_norm_bwd(grad_out, inputs["x"], None, inputs["weight"], mean, rstd, with_bias=False)
    assert db is None

    def truth_fn(**t):
        return layer_norm_fp64(bias=None, eps=1e-5, **t)

    def torch_fn(**t):
        return layer_norm_same_dtype(bias=None, eps=1e-5, **t)

    assert_close_to_reference("y", y, torch_fn(**inputs), truth_fn(**inputs), ATOL[dtype])
    truth, same = _fp64_grads(truth_fn, inputs, grad_out), _same_dtype_grads(torch_fn, inputs, grad_out)
    for name, ours in (("x", dx), ("weight", dw)):
        assert_close_to_reference(f"d{name}", ours, same[name], truth[name], scaled_atol(dtype, truth[name]))


# 768 and 1024 aligned: the register path (more rows than the emulated device's 16 warps: the grid
# strides); 1023, 100 and a misaligned 768: the general path
LN_WITHOUT_BIAS_CASES = [(6, 768, True), (37, 1024, True), (37, 1023, True), (5, 100, True), (3, 768, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,aligned", LN_WITHOUT_BIAS_CASES)
def test_layer_norm_without_bias(emu, dtype, rows, hidden, aligned):
    check_layer_norm_without_bias(emu, dtype, rows, hidden, aligned)


def test_layer_norm_without_bias_equals_one_with_a_zero_bias_bit_for_bit(emu):
    """Bit for bit: a zero bias adds 0 to every output, and the weight's gradient is summed in the same
    order with or without the bias's beside it."""
    x, weight, dy = rand(37, 768, seed=1, scale=2.0), rand(768, seed=2, shift=1.0), rand(37, 768, seed=3)
    y, mean, rstd = emu.layer_norm_fwd(x, weight, torch.zeros(768), None, 1e-5)
    y_free, mean_free, rstd_free = emu.layer_norm_fwd(x, weight, None, None, 1e-5)
    assert torch.equal(y, y_free) and torch.equal(mean, mean_free) and torch.equal(rstd, rstd_free)
    dx, dw, _, _ = emu.layer_norm_bwd(dy, x, None, weight, mean, rstd)
    dx_free, dw_free, _, _ = emu.layer_norm_bwd(dy, x, None, weight, mean, rstd, with_bias=False)
    assert torch.equal(dx, dx_free) and torch.equal(dw, dw_free)


# Copies of layer_norm.cu whose bias-free backward lays its workspace rows out as with a bias (two
# rows a CTA or a warp): (after this anchor, this text, becomes this). The rows then land past the
# half-size workspace and where the column sum does not read. Run in a child: a row written past the
# guards corrupts the process's memory.
LN_WITHOUT_BIAS_PLANTED = {
    "register path: a CTA's row at a bias's stride": (
        "ln_bwd_registers(", "(int64_t)blockIdx.x * (with_bias ? 2 : 1) * H", "(int64_t)blockIdx.x * 2 * H"),
    "general path: a warp's row at a bias's stride": (
        "ln_bwd_general(", "const int grads = with_bias ? 2 : 1;", "const int grads = 2;"),
}

_RUN_LAYER_NORM_WITHOUT_BIAS = """
import ctypes
import torch
from tests.kernels.test_cuda_emulated import Emulated, check_layer_norm_without_bias

emu = Emulated(ctypes.CDLL({library!r}))
for rows, hidden in ((37, 768), (5, 100)):
    try:
        check_layer_norm_without_bias(emu, torch.float32, rows, hidden, True)
    except AssertionError as error:
        print("comparison failed:", str(error).splitlines()[0], flush=True)
        break
else:
    print("every comparison passed", flush=True)
"""


def test_the_bias_free_layer_norm_checks_pass_on_the_real_source_in_a_child(emu):
    outcome = emulation.run_python(_RUN_LAYER_NORM_WITHOUT_BIAS.format(library=emu.lib._name))
    assert outcome.returncode == 0 and "every comparison passed" in outcome.stdout, outcome.stderr[-2000:]


@pytest.mark.parametrize("planted", sorted(LN_WITHOUT_BIAS_PLANTED))
def test_a_planted_mistake_fails_the_bias_free_layer_norm(tmp_path, planted):
    if reason := emulation.unavailable():
        pytest.skip(reason)
    anchor, old, new = LN_WITHOUT_BIAS_PLANTED[planted]
    sources = {name: (emulation.CSRC / name).read_text() for name in ("layer_norm.cu", "common.cuh")}
    source = sources["layer_norm.cu"]
    at = source.index(old, source.index(anchor, source.index("namespace bds")))  # in the definition named
    sources["layer_norm.cu"] = source[:at] + new + source[at + len(old):]
    library = emulation.build_library(sources, tmp_path, dtype="BDS_FLOAT32")
    outcome = emulation.run_python(_RUN_LAYER_NORM_WITHOUT_BIAS.format(library=str(library)))
    assert "every comparison passed" not in outcome.stdout, f"{planted}: the planted bug went unnoticed"
    # the guards' finding, or the process ended by the memory the rows overwrote past them
    found = re.search(r"comparison failed: .*(wrote out of bounds|dweight: non-finite)", outcome.stdout)
    assert found or outcome.returncode < 0, outcome.stdout + outcome.stderr[-2000:]


@pytest.mark.parametrize("hidden", [1024, 1023])
def test_layer_norm_fp32_residual_and_weights_with_bf16_input(emu, hidden):
    """What autocast over fp32 parameters passes: bf16 x, fp32 residual and weights."""
    dtype = torch.bfloat16
    inputs = {"x": rand(4, hidden, dtype=dtype, seed=1), "residual": rand(4, hidden, seed=5),
              "weight": rand(hidden, seed=2, shift=1.0), "bias": rand(hidden, seed=3)}
    grad_out = rand(4, hidden, dtype=dtype, seed=4)
    y, mean, rstd = emu.layer_norm_fwd(inputs["x"], inputs["weight"], inputs["bias"], inputs["residual"], 1e-12)
    dx, dw, db, dres = emu.layer_norm_bwd(grad_out, inputs["x"], inputs["residual"], inputs["weight"], mean, rstd)
    assert y.dtype == dx.dtype == dtype and dw.dtype == db.dtype == dres.dtype == torch.float32

    def reference(**t):
        return kernels.layer_norm_ref(eps=1e-12, **t)

    truth = _fp64_grads(lambda **t: layer_norm_fp64(eps=1e-12, **t), inputs, grad_out)
    same = _same_dtype_grads(reference, inputs, grad_out)
    expected = layer_norm_fp64(eps=1e-12, **inputs)
    assert_close_to_reference("y", y, reference(**inputs), expected, ATOL[dtype])
    for name, ours in (("x", dx), ("residual", dres), ("weight", dw), ("bias", db)):
        assert_close_to_reference(f"d{name}", ours, same[name], truth[name],
                                  ATOL[dtype] * max(1.0, truth[name].abs().max().item()))


def test_layer_norm_zero_rows_gives_zero_parameter_grads(emu):
    x, weight = torch.empty(0, 768), rand(768, seed=1)
    dx, dw, db, _ = emu.layer_norm_bwd(torch.empty(0, 768), x, None, weight, torch.empty(0), torch.empty(0))
    assert dx.shape == (0, 768) and torch.equal(dw, torch.zeros(768)) and torch.equal(db, torch.zeros(768))


# --------------------------------------------------------------------------- dropout + residual + layer norm

# (rows, hidden, aligned): 768 and 1024 aligned take the register path; 1 row, 7 and 129 (more rows
# than the emulated device's 16 warps: the grid strides) ragged; odd widths take the general path.
DLN_CASES = [(1, 768, True), (7, 768, True), (129, 768, True), (7, 1024, True), (3, 768, False),
             (7, 100, True), (1, 1023, True), (129, 1023, True)]


def check_dropout_add_layer_norm(emu, dtype, rows, hidden, aligned, dropout_p, seed=1234, offset=4 * 1031):
    """The forward and backward against the fp64 reference given the kernel's own mask, and that mask
    against the independent Philox of tests/kernels/helpers.py; the backward's (regenerated) mask
    against the forward's. Raises AssertionError on the first difference."""
    eps = 1e-5
    inputs = {"x": rand(rows, hidden, dtype=dtype, seed=1, scale=2.0, shift=0.3),
              "bias": rand(hidden, dtype=dtype, seed=6, scale=0.5),
              "residual": rand(rows, hidden, dtype=dtype, seed=2),
              "weight": rand(hidden, dtype=dtype, seed=3, shift=1.0),
              "ln_bias": rand(hidden, dtype=dtype, seed=4)}
    if not aligned:
        inputs = {name: misaligned(t) if t.dim() == 2 else t for name, t in inputs.items()}
    grad_out = rand(rows, hidden, dtype=dtype, seed=5)
    keep = torch.zeros(rows, hidden, dtype=torch.bool)
    args = (inputs["x"], inputs["bias"], inputs["residual"], inputs["weight"])
    y, mean, rstd = emu.dropout_layer_norm_fwd(*args, inputs["ln_bias"], eps, dropout_p, seed, offset, keep)
    dx, dbias, dres, dw, dlb = emu.dropout_layer_norm_bwd(grad_out, *args, mean, rstd, dropout_p, seed, offset)

    assert torch.equal(keep, dropout_keep((rows, hidden), dropout_p, seed, offset)), "the mask is not Philox's"
    # dx = dh * keep / (1 - p), dh almost surely nonzero: zero exactly where the backward dropped
    assert torch.equal(dx != 0, keep), "the backward's mask is not the forward's"

    def truth_fn(**t):
        return dropout_layer_norm_fp64(eps=eps, dropout_p=dropout_p, keep=keep, **t)

    def torch_fn(**t):
        return dropout_layer_norm_same_dtype(eps=eps, dropout_p=dropout_p, keep=keep, **t)

    assert_close_to_reference("y", y, torch_fn(**inputs), truth_fn(**inputs), ATOL[dtype])
    truth, same = _fp64_grads(truth_fn, inputs, grad_out), _same_dtype_grads(torch_fn, inputs, grad_out)
    ours = {"x": dx, "bias": dbias, "residual": dres, "weight": dw, "ln_bias": dlb}
    for name in inputs:
        assert_close_to_reference(f"d{name}", ours[name], same[name], truth[name], scaled_atol(dtype, truth[name]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,aligned", DLN_CASES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_dropout_add_layer_norm(emu, dtype, rows, hidden, aligned, dropout_p):
    check_dropout_add_layer_norm(emu, dtype, rows, hidden, aligned, dropout_p)


@pytest.mark.parametrize("hidden", [1024, 1023])
def test_dropout_add_layer_norm_fp32_parameters_and_residual_with_bf16_input(emu, hidden):
    """What autocast over fp32 parameters passes: a bf16 GEMM output, fp32 biases, weights and residual."""
    dtype, rows, dropout_p, seed, offset = torch.bfloat16, 9, 0.1, 77, 4
    inputs = {"x": rand(rows, hidden, dtype=dtype, seed=1), "bias": rand(hidden, seed=6),
              "residual": rand(rows, hidden, seed=5), "weight": rand(hidden, seed=2, shift=1.0),
              "ln_bias": rand(hidden, seed=3)}
    grad_out = rand(rows, hidden, dtype=dtype, seed=4)
    keep = torch.zeros(rows, hidden, dtype=torch.bool)
    args = (inputs["x"], inputs["bias"], inputs["residual"], inputs["weight"])
    y, mean, rstd = emu.dropout_layer_norm_fwd(*args, inputs["ln_bias"], 1e-12, dropout_p, seed, offset, keep)
    dx, dbias, dres, dw, dlb = emu.dropout_layer_norm_bwd(grad_out, *args, mean, rstd, dropout_p, seed, offset)
    assert y.dtype == dx.dtype == dtype and dbias.dtype == dres.dtype == dw.dtype == dlb.dtype == torch.float32
    assert torch.equal(keep, dropout_keep((rows, hidden), dropout_p, seed, offset))

    def reference(**t):
        return kernels.dropout_add_layer_norm_ref(eps=1e-12, dropout_p=dropout_p, keep=keep, **t)

    truth = _fp64_grads(lambda **t: dropout_layer_norm_fp64(eps=1e-12, dropout_p=dropout_p, keep=keep, **t),
                        inputs, grad_out)
    same = _same_dtype_grads(reference, inputs, grad_out)
    expected = dropout_layer_norm_fp64(eps=1e-12, dropout_p=dropout_p, keep=keep, **inputs)
    assert_close_to_reference("y", y, reference(**inputs), expected, ATOL[dtype])
    for name, ours in (("x", dx), ("bias", dbias), ("residual", dres), ("weight", dw), ("ln_bias", dlb)):
        assert_close_to_reference(f"d{name}", ours, same[name], truth[name], scaled_atol(dtype, truth[name]))


@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_dropout_keep_rate_is_binomial(emu, dropout_p):
    """The kernel's mask over 256 x 1024 elements keeps 1 - p of them within 5 standard deviations,
    in every column block of 128 too (no structure by position); a stream at the next offset is
    another mask (agreeing where two independent ones would: (1 - p)^2 + p^2)."""
    rows, hidden = 256, 1024
    x, residual = rand(rows, hidden, seed=1), rand(rows, hidden, seed=2)
    weight, bias = rand(hidden, seed=3), rand(hidden, seed=4)
    masks = []
    for offset in (0, 4):
        keep = torch.zeros(rows, hidden, dtype=torch.bool)
        emu.dropout_layer_norm_fwd(x, bias, residual, weight, bias, 1e-5, dropout_p, 2024, offset, keep)
        masks.append(keep)

    def within_binomial(kept: torch.Tensor, n: int, probability: float) -> bool:
        return abs(kept.sum().item() - n * probability) <= 5 * math.sqrt(n * probability * (1 - probability))
    n, keep_p = rows * hidden, 1 - dropout_p
    assert within_binomial(masks[0], n, keep_p), masks[0].float().mean()
    assert all(within_binomial(block, block.numel(), keep_p) for block in masks[0].split(128, dim=1))
    agree = keep_p ** 2 + dropout_p ** 2
    assert within_binomial(masks[0] == masks[1], n, agree), (masks[0] == masks[1]).float().mean()


@pytest.mark.parametrize("hidden", [768, 1023])
def test_dropout_off_draws_nothing_and_is_the_fused_layer_norm_of_the_sum(emu, hidden):
    """p = 0 keeps every element whatever the stream, and computes bit for bit what layer_norm.cu
    does on (x + bias) rounded to fp32: the kernels sum, normalise and scale in the same order."""
    x, residual = rand(9, hidden, seed=1, scale=2.0), rand(9, hidden, seed=2)
    bias, weight, ln_bias = rand(hidden, seed=3), rand(hidden, seed=4, shift=1.0), rand(hidden, seed=5)
    outputs = []
    for seed, offset in ((99, 8), (12345, 4096)):
        keep = torch.zeros(9, hidden, dtype=torch.bool)
        outputs.append(emu.dropout_layer_norm_fwd(x, bias, residual, weight, ln_bias, 1e-12, 0.0, seed, offset, keep))
        assert keep.all()
    expected = emu.layer_norm_fwd(x + bias, weight, ln_bias, residual, 1e-12)
    for ours in outputs:
        for name, a, b in zip(("y", "mean", "rstd"), ours, expected):
            assert torch.equal(a, b), name


# Copies of the sources with one planted mistake: (file, after this anchor, this text, becomes
# this, what the comparison must then report). Between them they fail each of its checks: the
# mask against the independent Philox (a counter one block on in the stream itself, which the
# reference given the kernel's own mask cannot see), the backward's mask against the forward's,
# the output and the gradients, the bias's included (its column sum is this kernel's own work),
# and the two-stage sum of the parameter gradients (a warp's sums left out of its CTA's row, a
# CTA's row written where another CTA's goes, the column sum one row short).
PLANTED_MISTAKES = {
    "Philox counter one block on (the stream)": (
        "common.cuh", "uint32_t keep_bits(", "keep4((uint64_t)(e / 4) + t)", "keep4((uint64_t)(e / 4) + t + 1)",
        "the mask is not Philox's"),
    "forward counter one element on (general path)": (
        "dropout_layer_norm.cu", "dln_fwd_general(", "dropout.keep(offset + j) ? v", "dropout.keep(offset + j + 1) ? v",
        "y: error"),
    "backward counter one vector on (register path)": (
        "dropout_layer_norm.cu", "dln_bwd_registers(", "dropout.keep_bits<kVec>(offset + col)",
        "dropout.keep_bits<kVec>(offset + col + kVec)", "the backward's mask is not the forward's"),
    "backward column loop to <= hidden (general path)": (
        "dropout_layer_norm.cu", "dln_bwd_general(", "for (int j = lane; j < hidden; j += 32) {\n      const bool kept",
        "for (int j = lane; j <= hidden; j += 32) {\n      const bool kept", "non-finite values|wrote out of bounds"),
    "kept elements scaled by 1 - p instead of 1 / (1 - p)": (
        "common.cuh", "static Dropout make(", "d.scale = 1.f / keep_p;", "d.scale = keep_p;", "y: error"),
    "backward's dx not scaled (register path)": (
        "dropout_layer_norm.cu", "dln_bwd_registers(", "out[j] * dropout.scale : 0.f", "out[j] : 0.f",
        "dx: error"),
    "bias gradient's term dropped (register path)": (
        "dropout_layer_norm.cu", "dln_bwd_registers(", "db[i][j] += out[j];", "", "dbias: error"),
    "bias gradient summed before the dropout (general path)": (
        "dropout_layer_norm.cu", "dln_bwd_general(", "dbp[j] += dxv;", "dbp[j] += dh;", "dbias: error"),
    "a warp's sums left out of its CTA's row": (
        "common.cuh", "void block_column_sum(", "for (int w = 1; w < kRowWarpsPerBlock; ++w)",
        "for (int w = 2; w < kRowWarpsPerBlock; ++w)", "dbias: error"),
    "a CTA's row written at the next CTA's offset": (
        "dropout_layer_norm.cu", "dln_bwd_registers(", "parts + (int64_t)blockIdx.x * 3 * H",
        "parts + (int64_t)(blockIdx.x + 1) * 3 * H", "dbias: non-finite values"),
    "the column sum one workspace row short": (
        "dropout_layer_norm.cu", "bds_dropout_layer_norm_bwd(", "(int)grid.x * rows_per_block, 3 * hidden",
        "(int)grid.x * rows_per_block - 1, 3 * hidden", "dbias: error"),
}

_RUN_DROPOUT_CHECKS = """
import ctypes
import torch
from tests.kernels.test_cuda_emulated import Emulated, check_dropout_add_layer_norm

emu = Emulated(ctypes.CDLL({library!r}))
for rows, hidden in ((7, 100), (7, 768), (5, 1024), (37, 768)):
    try:
        check_dropout_add_layer_norm(emu, torch.float32, rows, hidden, True, 0.1)
    except AssertionError as error:
        print("comparison failed:", str(error).splitlines()[0])
        break
else:
    print("every comparison passed")
"""


def test_dropout_checks_pass_on_the_real_source_in_a_child(emu):
    outcome = emulation.run_python(_RUN_DROPOUT_CHECKS.format(library=emu.lib._name))
    assert outcome.returncode == 0 and "every comparison passed" in outcome.stdout, outcome.stderr[-2000:]


def _dropout_library_with(tmp_path, file: str, anchor: str, old: str, new: str) -> str:
    """A library of dropout_layer_norm.cu and common.cuh (which it includes and which launches a
    kernel too, column_sum) with ``old`` replaced by ``new`` once, after ``anchor`` in ``file``: in
    the definition named. fp32 kernels only: the checks' one dtype."""
    sources = {name: (emulation.CSRC / name).read_text() for name in ("dropout_layer_norm.cu", "common.cuh")}
    source = sources[file]
    at = source.index(old, source.index(anchor, source.index("namespace bds")))
    sources[file] = source[:at] + new + source[at + len(old):]
    return str(emulation.build_library(sources, tmp_path, dtype="BDS_FLOAT32"))


@pytest.mark.parametrize("planted", sorted(PLANTED_MISTAKES))
def test_a_planted_mistake_fails_the_dropout_comparison(tmp_path, planted):
    if reason := emulation.unavailable():
        pytest.skip(reason)
    file, anchor, old, new, report = PLANTED_MISTAKES[planted]
    outcome = emulation.run_python(_RUN_DROPOUT_CHECKS.format(library=_dropout_library_with(tmp_path, file, anchor,
                                                                                           old, new)))
    assert outcome.returncode == 0, outcome.stderr[-2000:]
    assert "every comparison passed" not in outcome.stdout, f"{planted}: the planted bug went unnoticed"
    assert re.search(rf"comparison failed: .*({report})", outcome.stdout), outcome.stdout


# block_column_sum (common.cuh) with one of its barriers removed: the warps' sums are then read
# before every warp has written them, or overwritten by the next gradient's while another warp
# still reads them. The emulator sees it on the shared memory (an `emu:` report, and the run
# ends), whatever values the race would have left.
UNSYNCHRONISED_SUMS = {
    "no barrier between the warps' writes and the CTA's sum": (
        "  __syncthreads();\n#pragma unroll\n  for (int k = 0;", "#pragma unroll\n  for (int k = 0;"),
    "no barrier before the next gradient overwrites the stage": (
        "  __syncthreads();  // before the next gradient", "  // before the next gradient"),
}


@pytest.mark.parametrize("broken", sorted(UNSYNCHRONISED_SUMS))
def test_a_missing_barrier_in_the_cta_sum_fails_in_the_emulator(tmp_path, broken):
    if reason := emulation.unavailable():
        pytest.skip(reason)
    old, new = UNSYNCHRONISED_SUMS[broken]
    library = _dropout_library_with(tmp_path, "common.cuh", "void block_column_sum(", old, new)
    outcome = emulation.run_python(_RUN_DROPOUT_CHECKS.format(library=library))
    assert outcome.aborted, f"{broken}: not reported (exit {outcome.returncode}): {outcome.stdout[-500:]}"
    assert re.match(r"emu: (race|uninitialised read) .*shared address", outcome.emu_error), outcome.stderr[-2000:]


def test_the_backward_keeps_a_workspace_row_per_cta_on_the_register_path(emu):
    """The emulated device holds 4 blocks of 4 warps: the register path's partial sums take a
    row per CTA (4), the general path's a row per warp (16); a grid of one block still leaves
    room for a misaligned call's general kernel (a block's warps)."""
    for parts in (emu.lib.bds_dropout_layer_norm_bwd_parts, emu.lib.bds_layer_norm_bwd_parts):
        assert [parts(1000, 768), parts(1000, 1024), parts(1000, 1023), parts(1000, 100)] == [4, 4, 16, 16]
        assert [parts(1, 768), parts(1, 100), parts(0, 768)] == [4, 4, 4]


# --------------------------------------------------------------------------- bias + gelu

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows,cols,aligned", [(9, 1031, True), (70, 256, True), (3, 256, False), (5, 13, True)])
@pytest.mark.parametrize("bias_fp32", [False, True])
def test_bias_gelu(emu, dtype, approximate, rows, cols, aligned, bias_fp32):
    if bias_fp32 and dtype == torch.float32:
        pytest.skip("same case as bias_fp32=False")
    x = rand(rows, cols, dtype=dtype, seed=1, scale=3.0)
    if not aligned:
        x = misaligned(x)
    bias = rand(cols, dtype=torch.float32 if bias_fp32 else dtype, seed=2)
    grad_out = rand(rows, cols, dtype=dtype, seed=3)
    tanh = approximate == "tanh"

    y = emu.bias_gelu_fwd(x, bias, tanh)
    dx, dbias = emu.bias_gelu_bwd(grad_out, x, bias, tanh)
    assert y.dtype == dx.dtype == dtype and dbias.dtype == bias.dtype

    inputs = {"x": x, "bias": bias}
    atol = ATOL[dtype]
    assert_close_to_reference("y", y, gelu_same_dtype(x, bias, approximate), gelu_fp64(x, bias, approximate), atol)
    truth = _fp64_grads(lambda x, bias: gelu_fp64(x, bias, approximate), inputs, grad_out)
    same = _same_dtype_grads(lambda x, bias: gelu_same_dtype(x, bias, approximate), inputs, grad_out)
    assert_close_to_reference("dx", dx, same["x"], truth["x"], atol)
    assert_close_to_reference("dbias", dbias, same["bias"], truth["bias"], atol * rows)


# --------------------------------------------------------------------------- GeGLU

# (rows, cols, aligned), cols the width of each half. 1031: scalar accesses; 40: 16-byte vectors in
# every dtype, and more vectors than the emulated device's 1,024 threads, whose stride (in rows and
# columns) wraps past a row's end; 12: vectors in fp32 alone; misaligned: scalar.
GEGLU_CASES = [(9, 1031, True), (300, 40, True), (5, 12, True), (3, 256, False)]


def check_geglu(emu, dtype, approximate, rows, cols, aligned):
    """The kernels against fp64 on a (rows, 2 x cols) projection [input | gate]: the output, and the
    input half's and the gate half's gradients each. Raises AssertionError on the first difference."""
    x = rand(rows, 2 * cols, dtype=dtype, seed=1, scale=3.0)
    if not aligned:
        x = misaligned(x)
    grad_out = rand(rows, cols, dtype=dtype, seed=2)
    y = emu.geglu_fwd(x, approximate == "tanh")
    dx = emu.geglu_bwd(grad_out, x, approximate == "tanh")
    assert y.dtype == dx.dtype == dtype and dx.shape == x.shape

    atol = ATOL[dtype]
    assert_close_to_reference("y", y, geglu_same_dtype(x, approximate), geglu_fp64(x, approximate), atol)
    truth = _fp64_grads(lambda x: geglu_fp64(x, approximate), {"x": x}, grad_out)["x"]
    same = _same_dtype_grads(lambda x: geglu_same_dtype(x, approximate), {"x": x}, grad_out)["x"]
    for name, half in (("dinput", slice(None, cols)), ("dgate", slice(cols, None))):
        assert_close_to_reference(name, dx[:, half], same[:, half], truth[:, half], atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows,cols,aligned", GEGLU_CASES)
def test_geglu(emu, dtype, approximate, rows, cols, aligned):
    check_geglu(emu, dtype, approximate, rows, cols, aligned)


def test_geglu_of_no_rows_launches_nothing(emu):
    x, dy = rand(0, 16, dtype=torch.bfloat16), rand(0, 8, dtype=torch.bfloat16)
    assert emu.geglu_fwd(x, False).shape == (0, 8) and emu.geglu_bwd(dy, x, True).shape == (0, 16)


# Copies of the sources with one planted mistake: (file, after this anchor, this text, becomes this,
# what check_geglu then reports, for the GELU form it shows in). Built and run in this process: the
# guards turn a stray write into an assertion.
GEGLU_PLANTED = {
    "input and gate halves swapped in the forward": (
        "geglu.cu", "geglu_fwd_kernel(", "load_floats(input, a);\n    load_floats(input + cols, g);",
        "load_floats(input + cols, a);\n    load_floats(input, g);", "y: error", "none"),
    "the backward's halves written the wrong way round": (
        "geglu.cu", "geglu_bwd_kernel(", "store_floats(dx + input, a);\n    store_floats(dx + input + cols, g);",
        "store_floats(dx + input, g);\n    store_floats(dx + input + cols, a);", "dinput: error", "none"),
    "the erf form's derivative with 1 / sqrt(2) for 1 / sqrt(2 pi)": (
        "common.cuh", "GeluAt gelu_at(", "h * kInvSqrt2Pi * expf", "h * kInvSqrt2 * expf", "dinput: error", "none"),
    "the tanh form's derivative without the cubic's factor 3": (
        "common.cuh", "GeluAt gelu_at(", "(1.f + 3.f * kTanhCubic * h * h)", "(1.f + kTanhCubic * h * h)",
        "dinput: error", "tanh"),
}


@pytest.mark.parametrize("planted", sorted(GEGLU_PLANTED))
def test_a_planted_mistake_fails_the_geglu_comparison(emu, tmp_path, planted):
    file, anchor, old, new, report, approximate = GEGLU_PLANTED[planted]
    sources = {name: (emulation.CSRC / name).read_text() for name in ("geglu.cu", "common.cuh")}
    source = sources[file]
    at = source.index(old, source.index(anchor, source.index("namespace bds")))  # in the definition named
    sources[file] = source[:at] + new + source[at + len(old):]
    broken = Emulated(ctypes.CDLL(str(emulation.build_library(sources, tmp_path, dtype="BDS_FLOAT32"))))
    check_geglu(emu, torch.float32, approximate, 300, 40, True)  # the real source passes this very case
    with pytest.raises(AssertionError, match=report):
        check_geglu(broken, torch.float32, approximate, 300, 40, True)


# --------------------------------------------------------------------------- MLM cross-entropy

# (dtype, rows, vocab, width, aligned). The first is the model's layout (-inf padding to a multiple
# of 8) with more rows than the emulated device's 4 resident blocks (the grid strides); 37 columns
# and misaligned logits take the scalar path; fp32 takes 4-wide vectors.
CE_CASES = [(torch.bfloat16, 9, 1000, 1008, True), (torch.bfloat16, 6, 37, 37, True),
            (torch.bfloat16, 5, 64, 64, False), (torch.float16, 5, 61, 64, True), (torch.float32, 6, 30, 36, True)]


def check_mlm_cross_entropy(emu, dtype, rows, vocab, width, aligned):
    """The kernels on selfcheck.mlm_rows' rows (ties for the maximum, ignored rows, -inf padding, a
    row shifted by +100) against fp64: the summed loss, the per-row lse, the count exactly, and the
    gradient for a dloss of 0.7; ignored rows and padding columns give exactly 0. Raises
    AssertionError on the first difference."""
    logits, labels = mlm_rows(rows, vocab, width, dtype, torch.device("cpu"))
    if not aligned:
        logits = misaligned(logits)
    dloss = torch.tensor(0.7)
    loss, lse, correct = emu.mlm_cross_entropy_fwd(logits, labels, IGNORE_INDEX)
    dlogits = emu.mlm_cross_entropy_bwd(dloss, logits, labels, lse, IGNORE_INDEX)

    truth_leaf, same_leaf = logits.double().requires_grad_(), logits.clone().requires_grad_()
    truth_loss, truth_correct = mlm_cross_entropy_fp64(truth_leaf, labels)
    truth_loss.backward(dloss.double())
    same_loss, same_correct = kernels.mlm_cross_entropy_ref(same_leaf, labels)  # fp32 math, as the kernel's
    same_loss.backward(dloss)
    scored = labels != IGNORE_INDEX
    assert int(correct.sum()) == int(truth_correct) == int(same_correct), \
        f"correct: {int(correct.sum())} rows, where the argmax gives {int(truth_correct)}"
    assert not correct[~scored].any() and not loss[~scored].any(), "an ignored row has a loss or is counted"
    atol = ATOL[torch.float32] * max(1.0, truth_loss.abs().item())
    assert_close_to_reference("loss", loss.sum(), same_loss.detach(), truth_loss.detach(), atol)
    assert_close_to_reference("lse", lse[scored], torch.logsumexp(logits.float(), 1)[scored],
                              torch.logsumexp(logits.double(), 1)[scored], ATOL[torch.float32] * 200)
    assert_close_to_reference("dlogits", dlogits, same_leaf.grad, truth_leaf.grad, ATOL[dtype])
    assert not dlogits[:, vocab:].any() and not dlogits[~scored].any(), "padding or an ignored row has a gradient"


@pytest.mark.parametrize("dtype,rows,vocab,width,aligned", CE_CASES)
def test_mlm_cross_entropy(emu, dtype, rows, vocab, width, aligned):
    check_mlm_cross_entropy(emu, dtype, rows, vocab, width, aligned)


def test_mlm_cross_entropy_of_no_rows_and_of_ignored_rows_only(emu):
    logits = rand(3, 16, dtype=torch.bfloat16, seed=1)
    loss, lse, correct = emu.mlm_cross_entropy_fwd(logits[:0], torch.zeros(0, dtype=torch.int64), IGNORE_INDEX)
    assert loss.shape == lse.shape == correct.shape == (0,)
    ignored = torch.full((3,), IGNORE_INDEX)
    loss, lse, correct = emu.mlm_cross_entropy_fwd(logits, ignored, IGNORE_INDEX)
    assert not loss.any() and not correct.any()
    assert not emu.mlm_cross_entropy_bwd(torch.tensor(1.0), logits, ignored, lse, IGNORE_INDEX).any()


# Copies of cross_entropy.cu with one planted mistake: (after this anchor, this text, becomes this,
# what check_mlm_cross_entropy then reports). Built and run in this process: none of them can
# end it (the guards turn a stray write into an assertion).
CE_PLANTED = {
    "the row's max not subtracted from the terms summed": (
        "void add_vector(", "p.sum += exp_of_difference(x[j], p.max);", "p.sum += exp2f(x[j] * kLog2e);", "loss"),
    "argmax ties to the later column across threads": (
        "Partial merge(", "b.column < a.column", "b.column > a.column", "correct"),
    "backward column loop one vector past the row": (
        "cross_entropy_bwd_kernel(", "for (int v = threadIdx.x; v < vecs; v += kThreads) {\n      float x",
        "for (int v = threadIdx.x; v <= vecs; v += kThreads) {\n      float x", "wrote out of bounds|dlogits"),
}


@pytest.mark.parametrize("planted", sorted(CE_PLANTED))
def test_a_planted_mistake_fails_the_cross_entropy_comparison(emu, tmp_path, planted):
    anchor, old, new, report = CE_PLANTED[planted]
    source = (emulation.CSRC / "cross_entropy.cu").read_text()
    at = source.index(old, source.index(anchor, source.index("namespace bds")))  # in the definition named
    sources = {"cross_entropy.cu": source[:at] + new + source[at + len(old):],
               "common.cuh": (emulation.CSRC / "common.cuh").read_text()}  # it launches a kernel too: rewritten
    library = emulation.build_library(sources, tmp_path, dtype="BDS_BFLOAT16")  # CE_CASES[0]'s dtype
    broken = Emulated(ctypes.CDLL(str(library)))
    with pytest.raises(AssertionError, match=report):
        check_mlm_cross_entropy(broken, *CE_CASES[0])


def test_mlm_cross_entropy_kernels_pass_the_self_check(emulated_cuda):
    """The GPU's self-check of the op on the emulated kernels, through the fused path's Python (the
    autograd Function, the sum and the count, dloss handed to the kernel as a tensor): BERT's padded
    vocabulary among its widths, every dtype."""
    from bert_ds.kernels import selfcheck
    from bert_ds.kernels.cross_entropy import mlm_cross_entropy_fused

    assert selfcheck.check_mlm_cross_entropy(mlm_cross_entropy_fused, torch.device("cpu")) == []


# --------------------------------------------------------------------------- attention

# One batch from 1 to 513 tokens: full and partial tiles of every size the kernels use
# (forward: 128 queries, 64 keys at head dim 64 and 128 at 32; backward: 128 keys, 64
# queries at head dim 64 and 32 at 32), a last key tile of one key (the backward's warps
# past it skip their products), and 513 cycles both cp.async stages several times. Batches
# whose longest sequence fits one key tile (128) take the backward's one-tile path.
LENGTHS_1_TO_513 = [513, 1, 129, 64, 255, 17, 5, 70]
ATTENTION_CASES = [  # (lengths, heads, head_dim)
    ([1, 130, 64, 17], 2, 64),
    ([1, 5, 70, 128], 2, 64),  # one tile
    ([65, 3], 1, 32),  # one tile
    ([200], 1, 64),
    (LENGTHS_1_TO_513, 1, 64),
    (LENGTHS_1_TO_513, 2, 32),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths,heads,head_dim", ATTENTION_CASES)
def test_varlen_attention(emu, dtype, lengths, heads, head_dim):
    total, max_seqlen = sum(lengths), max(lengths)
    scale = 1.0 / math.sqrt(head_dim)
    inputs = {name: rand(total, heads, head_dim, dtype=dtype, seed=seed)
              for name, seed in (("q", 1), ("k", 2), ("v", 3))}
    grad_out = rand(total, heads, head_dim, dtype=dtype, seed=4)
    cu_seqlens = cu_seqlens_of(lengths)

    out, lse = emu.varlen_attention_fwd(inputs["q"], inputs["k"], inputs["v"], cu_seqlens, max_seqlen, 0.0, scale)
    dq, dk, dv = emu.varlen_attention_bwd(grad_out, inputs["q"], inputs["k"], inputs["v"], out, lse, cu_seqlens,
                                   max_seqlen, scale)

    def truth_fn(q, k, v):
        return attention_per_sequence(q, k, v, lengths, scale, upcast=True)

    def torch_fn(q, k, v):
        return attention_per_sequence(q, k, v, lengths, scale, upcast=False)

    atol = ATOL[dtype]
    assert_close_to_reference("out", out, torch_fn(**inputs), truth_fn(**inputs), atol)
    # lse against its definition, per head and token
    expected_lse, start = [], 0
    for length in lengths:
        qs, ks = (inputs[n][start:start + length].double().transpose(0, 1) for n in ("q", "k"))
        expected_lse.append(torch.logsumexp(scale * qs @ ks.transpose(1, 2), dim=-1))  # (nh, L)
        start += length
    torch.testing.assert_close(lse.double(), torch.cat(expected_lse, dim=1), rtol=0, atol=1e-4)
    truth, same = _fp64_grads(truth_fn, inputs, grad_out), _same_dtype_grads(torch_fn, inputs, grad_out)
    for name, ours in (("q", dq), ("k", dk), ("v", dv)):
        assert_close_to_reference(f"d{name}", ours, same[name], truth[name], atol)


@pytest.mark.parametrize("lengths,heads,head_dim", [([1, 130, 64, 17], 2, 64), ([1, 5, 70, 128], 2, 64),
                                                     ([65, 3], 1, 32), ([200, 7], 2, 32)])
def test_attention_reads_and_writes_a_packed_projection_in_place(emu, lengths, heads, head_dim):
    """q, k, v read from one (total, 3, heads, head_dim) projection at its token stride, and dq,
    dk, dv written into one gradient laid out alike (the model's fused QKV GEMM): the same
    products in the same order as on contiguous copies, so the same bits, on the general and
    the one-tile backward. Every element of dqkv is written (it starts as NaN)."""
    total, max_seqlen, scale = sum(lengths), max(lengths), 1.0 / math.sqrt(head_dim)
    qkv = rand(total, 3, heads, head_dim, dtype=torch.bfloat16, seed=1)
    dout = rand(total, heads, head_dim, dtype=torch.bfloat16, seed=2)
    cu_seqlens = cu_seqlens_of(lengths)
    q, k, v = (t.contiguous() for t in qkv.unbind(1))
    out, lse = emu.varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, 0.0, scale)
    grads = emu.varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale)

    packed_out, packed_lse = emu.varlen_attention_fwd_packed(qkv, cu_seqlens, max_seqlen, scale)
    dqkv = emu.varlen_attention_bwd_packed(dout, qkv, packed_out, packed_lse, cu_seqlens, max_seqlen, scale)
    assert torch.equal(packed_out, out) and torch.equal(packed_lse, lse)
    assert torch.equal(dqkv, torch.stack(grads, dim=1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_attention_one_tile_path_equals_the_general_path(emu, dtype, head_dim):
    """Every sequence fits one key tile; max_seqlen 128 takes the one-tile backward (dQ stored
    by the kernel), 129 the general one (dQ added in fp32 to zeros, then converted), whose
    second key tile is past every sequence. One key tile adds to each dQ row either way, and
    the same products in the same order make the same bits."""
    lengths = [1, 5, 70, 128]
    total, scale = sum(lengths), 1.0 / math.sqrt(head_dim)
    q, k, v, dout = (rand(total, 2, head_dim, dtype=dtype, seed=seed) for seed in range(4))
    cu_seqlens = cu_seqlens_of(lengths)
    assert emu.lib.bds_varlen_attention_bwd_dq_slots(head_dim, 128, -1) == 0
    assert emu.lib.bds_varlen_attention_bwd_dq_slots(head_dim, 129, -1) == 1
    out, lse = emu.varlen_attention_fwd(q, k, v, cu_seqlens, 128, 0.0, scale)
    one_tile = emu.varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, 128, scale)
    general = emu.varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, 129, scale)
    for name, a, b in zip(("dq", "dk", "dv"), one_tile, general):
        assert torch.equal(a, b), name


# Copies of attention.cu with one synchronisation removed, and the emulator's report each must
# cause, on the backward's one-tile path ([70, 5]) and its general path ([130, 3]). The
# forward's wait is the only one covering key tile 0, and the backward's loop-top wait the
# only one covering query tile 0, so the first ldmatrix of each reads copies in flight;
# without the barrier after dS^T, a warp reads the dS^T rows of the others for dQ before they
# are written (in the first query tile no thread of the block has written them yet; later,
# another warp's rows of the previous tile), or they overwrite rows it read, whichever order
# the warps run.
IN_FLIGHT = r"race .* reads bytes .*cp\.async|read before cp\.async wait"
BROKEN_ATTENTION = {
    "forward: missing cp_async_wait": (
        "    cp_async_wait<0>();  // this thread's copies of tile j have landed (the only group in flight)\n",
        IN_FLIGHT),
    "backward: missing cp_async_wait": (
        "    cp_async_wait<0>();  // this thread's copies of query tile j have landed\n", IN_FLIGHT),
    "backward: missing __syncthreads": (
        "    __syncthreads();  // barrier: every warp's dS^T rows are written\n",
        r"race .* with no __syncthreads between|uninitialised read .* no thread of this block wrote"),
}
BATCHES = {"one tile": [70, 5], "general": [130, 3]}

_RUN_ATTENTION = """
import ctypes
import torch
from tests.kernels.helpers import cu_seqlens_of, rand
from tests.kernels.test_cuda_emulated import Emulated

emu = Emulated(ctypes.CDLL({library!r}))
lengths = {lengths!r}
q, k, v, dout = (rand(sum(lengths), 1, 64, dtype=torch.bfloat16, seed=seed) for seed in range(4))
cu_seqlens = cu_seqlens_of(lengths)
assert emu.lib.bds_varlen_attention_bwd_dq_slots(64, max(lengths), -1) == {slots!r}
out, lse = emu.varlen_attention_fwd(q, k, v, cu_seqlens, max(lengths), 0.0, 0.125)
emu.varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, max(lengths), 0.125)
print("ran to the end")
"""


def _run_attention(library: str, batch: str) -> emulation.Outcome:
    return emulation.run_python(_RUN_ATTENTION.format(library=library, lengths=BATCHES[batch],
                                                      slots=int(batch == "general")))


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_attention_run_for_the_broken_copies_passes_on_the_real_source(emu, batch):
    outcome = _run_attention(emu.lib._name, batch)
    assert outcome.returncode == 0 and "ran to the end" in outcome.stdout, outcome.stderr[-2000:]


@pytest.fixture(scope="module")
def broken_attention(tmp_path_factory):
    """broken -> the emulated library of attention.cu without that line, each built once for the module."""
    if reason := emulation.unavailable():
        pytest.skip(reason)
    built: dict[str, str] = {}

    def library(broken: str) -> str:
        if broken not in built:
            removed, _ = BROKEN_ATTENTION[broken]
            source = (emulation.CSRC / "attention.cu").read_text()
            assert source.count(removed) == 1, f"{broken}: the line to remove is not in attention.cu exactly once"
            sources = {"attention.cu": source.replace(removed, ""), "common.cuh": (emulation.CSRC / "common.cuh").read_text()}
            # the run's one configuration alone (bf16, head dim 64, no window, no rotary): 3 of attention.cu's 48 kernels
            built[broken] = str(emulation.build_library(
                sources, tmp_path_factory.mktemp("broken"), dtype="BDS_BFLOAT16",
                defines={"BDS_EMULATE_HEAD_DIM": 64, "BDS_EMULATE_WINDOWED": 0, "BDS_EMULATE_ROTARY": 0}))
        return built[broken]
    return library


@pytest.mark.parametrize("broken, batch", [("forward: missing cp_async_wait", "one tile")] + [
    (broken, batch) for broken in sorted(BROKEN_ATTENTION) if broken.startswith("backward")
    for batch in sorted(BATCHES)])
def test_attention_missing_a_synchronisation_fails_in_the_emulator(broken_attention, broken, batch):
    outcome = _run_attention(broken_attention(broken), batch)
    assert outcome.aborted, f"{broken}: the emulated kernel ran to the end\n{outcome.stdout}{outcome.stderr[-2000:]}"
    assert re.search(BROKEN_ATTENTION[broken][1], outcome.emu_error), \
        f"{broken}: {outcome.emu_error or outcome.stderr[-2000:]}"


# --------------------------------------------------------------------------- public ops and model on the emulation

@pytest.fixture
def emulated_cuda(emu, monkeypatch):
    """``backend="cuda"`` runs the ops' fused path (dispatch, autograd Functions) on the emulated
    launchers, with CPU tensors: the Python glue is tested with the real kernel source."""
    return run_ops_on(emu, monkeypatch)


def run_ops_on(emu: Emulated, monkeypatch) -> Emulated:
    """What :func:`emulated_cuda` sets up, for a test module with a library of its own."""
    from bert_ds.kernels import choice, dispatch

    passed = {op: "" for op in dispatch.OPS}
    for module in (choice, dispatch):  # resolve_backend's view and the dispatch's
        monkeypatch.setattr(module, "load_extension", lambda: (emu, ""))
    monkeypatch.setattr(choice, "op_verdicts", lambda: passed)
    monkeypatch.setattr(dispatch, "_verdicts", lambda: passed)
    modules = {"layer_norm": "layer_norm", "dropout_add_layer_norm": "dropout_layer_norm", "bias_gelu": "bias_gelu",
               "varlen_attention": "attention", "mlm_cross_entropy": "cross_entropy", "lamb_update": "lamb",
               "geglu": "geglu", "local_attention": "local_attention"}
    for op in dispatch.OPS:  # the inputs are on the CPU by design: waive that reason, and only that
        module = importlib.import_module(f"bert_ds.kernels.{modules[op]}")

        def unsupported(*args, _check=module._unsupported):
            reason = _check(*args)
            return "" if reason == "its inputs are not all on a CUDA device" else reason
        monkeypatch.setattr(module, "_unsupported", unsupported)
    return emu


def _public_op_grads(fn, inputs, grad_out, dtype=None):
    leaves = {name: (t.to(dtype) if dtype else t).detach().requires_grad_() for name, t in inputs.items()}
    out = fn(**leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), {name: t.grad for name, t in leaves.items()}


def test_public_ops_run_the_emulated_kernels_through_autograd(emulated_cuda):
    from bert_ds.kernels import ops as kernels

    dtype = torch.bfloat16
    atol = ATOL[dtype]
    ln_inputs = {"x": rand(5, 768, dtype=dtype, seed=1, scale=2.0), "residual": rand(5, 768, dtype=dtype, seed=2),
                 "weight": rand(768, dtype=dtype, seed=3, shift=1.0), "bias": rand(768, dtype=dtype, seed=4)}
    gelu_inputs = {"x": rand(7, 256, dtype=dtype, seed=5, scale=2.0), "bias": rand(256, dtype=dtype, seed=6)}
    geglu_inputs = {"x": rand(2, 3, 2 * 136, dtype=dtype, seed=11, scale=2.0)}  # leading dims of a padded batch
    lengths = [3, 70]
    cu_seqlens = cu_seqlens_of(lengths)
    attn_inputs = {n: rand(73, 2, 64, dtype=dtype, seed=s) for n, s in (("q", 7), ("k", 8), ("v", 9))}
    cases = [
        ("layer_norm", ln_inputs, lambda **t: kernels.layer_norm(eps=1e-12, backend="cuda", **t),
         lambda **t: layer_norm_fp64(eps=1e-12, **t), lambda **t: layer_norm_same_dtype(eps=1e-12, **t)),
        ("bias_gelu", gelu_inputs, lambda **t: kernels.bias_gelu(approximate="tanh", backend="cuda", **t),
         lambda **t: gelu_fp64(approximate="tanh", **t), lambda **t: gelu_same_dtype(approximate="tanh", **t)),
        ("geglu", geglu_inputs, lambda **t: kernels.geglu(approximate="none", backend="cuda", **t),
         lambda **t: geglu_fp64(approximate="none", **t), lambda **t: geglu_same_dtype(approximate="none", **t)),
        ("varlen_attention", attn_inputs,
         lambda **t: kernels.varlen_attention(cu_seqlens=cu_seqlens, max_seqlen=70, backend="cuda", **t),
         lambda **t: attention_per_sequence(lengths=lengths, **t),
         lambda **t: attention_per_sequence(lengths=lengths, upcast=False, **t)),
    ]
    for op, inputs, fused_fn, truth_fn, torch_fn in cases:
        grad_out = rand(*fused_fn(**inputs).shape, dtype=dtype, seed=10)
        out, grads = _public_op_grads(fused_fn, inputs, grad_out)
        truth_out, truth_grads = _public_op_grads(truth_fn, inputs, grad_out, torch.float64)
        same_out, same_grads = _public_op_grads(torch_fn, inputs, grad_out)
        assert_close_to_reference(f"{op} out", out, same_out, truth_out, atol)
        for name in inputs:
            assert_close_to_reference(f"{op} d{name}", grads[name], same_grads[name], truth_grads[name],
                                      atol * max(1.0, truth_grads[name].abs().max().item()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_add_layer_norm_runs_the_emulated_kernels_through_autograd(emulated_cuda, dtype):
    """The fused path's Python (the autograd Function, the binding's API, the seed) on the emulated
    kernels: with the kernel's mask, every gradient against the fp64 reference; the public op's
    mask follows torch's generator (the same seed, the same mask) and drops about p of the elements."""
    from bert_ds.kernels.dropout_layer_norm import dropout_add_layer_norm_fused

    inputs = {"x": rand(33, 768, dtype=dtype, seed=1, scale=2.0), "bias": rand(768, dtype=dtype, seed=2),
              "residual": rand(33, 768, dtype=dtype, seed=3), "weight": rand(768, dtype=dtype, seed=4, shift=1.0),
              "ln_bias": rand(768, dtype=dtype, seed=5)}
    grad_out = rand(33, 768, dtype=dtype, seed=6)
    keep = torch.zeros(33, 768, dtype=torch.bool)
    out, grads = _public_op_grads(
        lambda **t: dropout_add_layer_norm_fused(eps=1e-12, dropout_p=0.1, seed=5, offset=8, keep_out=keep, **t),
        inputs, grad_out)
    assert torch.equal(keep, dropout_keep((33, 768), 0.1, 5, 8))
    truth_out, truth_grads = _public_op_grads(
        lambda **t: dropout_layer_norm_fp64(eps=1e-12, dropout_p=0.1, keep=keep, **t), inputs, grad_out, torch.float64)
    same_out, same_grads = _public_op_grads(
        lambda **t: dropout_layer_norm_same_dtype(eps=1e-12, dropout_p=0.1, keep=keep, **t), inputs, grad_out)
    assert_close_to_reference("out", out, same_out, truth_out, ATOL[dtype])
    for name in inputs:
        assert_close_to_reference(f"d{name}", grads[name], same_grads[name], truth_grads[name],
                                  scaled_atol(dtype, truth_grads[name]))

    def public(**t):
        return kernels.dropout_add_layer_norm(eps=1e-12, dropout_p=0.1, backend="cuda", **t)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(_public_op_grads(public, inputs, grad_out))
    (out_a, grads_a), (out_b, grads_b) = runs
    assert torch.equal(out_a, out_b) and torch.equal(grads_a["x"], grads_b["x"])
    dropped = (grads_a["x"] == 0).float().mean().item()
    assert 0.07 < dropped < 0.13, dropped
    _, grads_c = _public_op_grads(public, inputs, grad_out)  # the generator moved on: another mask
    assert not torch.equal(grads_c["x"] == 0, grads_a["x"] == 0)


@pytest.mark.parametrize("precision", ["bf16 parameters", "bf16 autocast"])
def test_tiny_model_trains_alike_on_the_emulated_kernels(emulated_cuda, precision):
    """bf16 parameters: how DeepSpeed's bf16 mode runs the model. Autocast over fp32 parameters:
    how bert_ds.tools.bench runs it, which mixes dtypes at the ops (fp32 residuals, weights, biases)."""
    from bert_ds.model.bert.model import BertForPreTraining
    from bert_ds.model.families import model_preset

    vocab, seq_len = 128, 24
    config = model_preset("tiny", vocab, max_position_embeddings=seq_len, hidden_dropout=0.0,
                          attention_dropout=0.0, kernels="torch")
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([seq_len, 1, 9, 17])
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    ids = torch.randint(5, vocab, (4, seq_len), generator=generator) * mask
    types = (torch.arange(seq_len)[None, :] >= (lengths // 2)[:, None]).long() * mask
    labels = torch.where((torch.rand(4, seq_len, generator=generator) < 0.3) & mask.bool(), ids, IGNORE_INDEX)
    labels[0, 1] = ids[0, 1]
    nsp = torch.tensor([0, 1, 1, 0])

    bf16_parameters = precision == "bf16 parameters"
    autocast = contextlib.nullcontext() if bf16_parameters else torch.autocast("cpu", dtype=torch.bfloat16)
    assert_fused_training_follows_torch(BertForPreTraining, config, bf16_parameters, autocast,
                                        lambda model: model(ids, types, mask, labels, nsp).loss)


def assert_fused_training_follows_torch(model_class, config, bf16_parameters: bool, autocast, loss_of) -> None:
    """``model_class`` from one initialisation under kernels=torch and kernels=cuda (bf16 parameters, or
    fp32 ones under ``autocast``), three SGD steps each: the fused run's losses within 2% of torch's,
    and falling."""
    torch.manual_seed(0)
    state = model_class(config).state_dict()
    curves = {}
    for kernels_choice in ("torch", "cuda"):
        model = model_class(dataclasses.replace(config, kernels=kernels_choice))
        assert model.backend == kernels_choice
        model.load_state_dict(state)
        if bf16_parameters:
            model.to(torch.bfloat16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        curves[kernels_choice] = []
        for _ in range(3):
            with autocast:
                loss = loss_of(model)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curves[kernels_choice].append(loss.item())
    for fused, reference in zip(curves["cuda"], curves["torch"]):
        assert abs(fused - reference) <= 0.02 * reference, curves
    assert curves["cuda"][-1] < curves["cuda"][0], curves


def test_tiny_modernbert_trains_alike_on_the_emulated_kernels(emulated_cuda, monkeypatch):
    """Under kernels=cuda a ModernBERT's GeGLU (on Wi's whole output), its bias-free LayerNorms and
    its attention run the fused kernels: the global and the local layers' (windows shorter than the
    sequences), each handed the unrotated projection and its rotary base (the MLM loss too). With
    bf16 parameters, three SGD steps' losses within 2% of kernels=torch's (whose rotary and
    attention run in PyTorch), and falling."""
    from bert_ds.model.families import model_preset
    from bert_ds.model.modernbert.model import ModernBertForPreTraining

    calls, attention = [], set()

    def counted(name: str):
        run = getattr(emulated_cuda, name)
        return lambda *args, **kwargs: calls.append(name) or run(*args, **kwargs)
    for name in ("geglu_fwd", "geglu_bwd", "layer_norm_fwd", "layer_norm_bwd", "varlen_attention_bwd_packed"):
        monkeypatch.setattr(emulated_cuda, name, counted(name))
    forward = emulated_cuda.varlen_attention_fwd

    def attention_forward(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, window=-1, rope_theta=0.0):
        attention.add(("global" if window < 0 else f"window {window}", rope_theta))
        return forward(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, window, rope_theta)
    monkeypatch.setattr(emulated_cuda, "varlen_attention_fwd", attention_forward)
    vocab, seq_len = 128, 24
    config = model_preset("modernbert-tiny", vocab, num_layers=3, local_attention=8, max_position_embeddings=seq_len,
                          kernels="torch")
    generator = torch.Generator().manual_seed(0)
    mask = (torch.arange(seq_len)[None, :] < torch.tensor([seq_len, 1, 9, 17])[:, None]).long()
    ids = torch.randint(5, vocab, (4, seq_len), generator=generator) * mask
    labels = torch.where((torch.rand(4, seq_len, generator=generator) < 0.3) & mask.bool(), ids, IGNORE_INDEX)
    labels[0, 1] = ids[0, 1]

    assert_fused_training_follows_torch(ModernBertForPreTraining, config, True, contextlib.nullcontext(),
                                        lambda model: model(ids, attention_mask=mask, masked_lm_labels=labels).loss)
    assert set(calls) == {"geglu_fwd", "geglu_bwd", "layer_norm_fwd", "layer_norm_bwd", "varlen_attention_bwd_packed"}
    assert attention == {("global", config.global_rope_theta), ("window 4", config.local_rope_theta)}, attention


# --------------------------------------------------------------------------- LAMB's chunked update

def test_lamb_kernels_pass_the_self_check(emulated_cuda):
    """lamb.cu's two passes through the real fused path (lamb_update_fused, the binding's API)
    against lamb_update_ref, by the GPU's own self-check: ragged chunks, weight decay or not,
    per-chunk multipliers or one; the guards catch a write outside the tensors."""
    from bert_ds.kernels import selfcheck
    from bert_ds.kernels.lamb import lamb_update_fused

    assert selfcheck.check_lamb_update(lamb_update_fused, torch.device("cpu")) == []


# Copies of lamb.cu with the skip flag ignored in one pass: (after this anchor, this text, becomes
# this, what check_lamb_update then names as changed).
LAMB_PLANTED = {
    "the moments pass ignores the flag": ("lamb_moments_kernel(", "  if (skipped(skip)) {", "  if (false) {",
                                          "exp_avg"),
    "the apply pass ignores the flag": ("lamb_apply_kernel(", "  if (skipped(skip)) return;", "", "param"),
}


@pytest.mark.parametrize("planted", sorted(LAMB_PLANTED))
def test_a_planted_mistake_fails_the_lamb_skip_check(emulated_cuda, monkeypatch, tmp_path, planted):
    from bert_ds.kernels import dispatch, selfcheck
    from bert_ds.kernels.lamb import lamb_update_fused

    anchor, old, new, changed = LAMB_PLANTED[planted]
    source = (emulation.CSRC / "lamb.cu").read_text()
    at = source.index(old, source.index(anchor, source.index("namespace bds")))
    sources = {"lamb.cu": source[:at] + new + source[at + len(old):],
               "common.cuh": (emulation.CSRC / "common.cuh").read_text()}
    broken = Emulated(ctypes.CDLL(str(emulation.build_library(sources, tmp_path, dtype="BDS_FLOAT32"))))
    monkeypatch.setattr(dispatch, "load_extension", lambda: (broken, ""))
    problems = selfcheck.check_lamb_update(lamb_update_fused, torch.device("cpu"))
    assert any(p.startswith("skip flag set") and changed in p for p in problems), problems


def test_lamb_optimizer_on_the_emulated_kernels_follows_the_native_path(emulated_cuda):
    """Lamb(kernels="cuda") steps a bound flat tensor (padding, fragments of three parameters
    and one of them split at a chunk boundary) on the emulated kernels; kernels="torch" steps
    a copy with the native ops: the weights agree after five steps to float32 rounding, and
    the plain-Adam group (weight decay 0) takes the uniform-scale pass."""
    from bert_ds.optim.lamb import Lamb

    generator = torch.Generator().manual_seed(0)
    numel, segments = 3000, [(0, 1500, 0), (1500, 900, 1), (2432, 500, 2)]  # 2400-2431: padding
    start = torch.randn(numel, generator=generator)
    grads = [torch.randn(numel, generator=generator) for _ in range(5)]
    plain_start = torch.randn(37, generator=generator)
    weights = {}
    for kernels_setting in ("cuda", "torch"):
        flat = start.clone().requires_grad_()
        plain = plain_start.clone().requires_grad_()
        lamb = Lamb([{"params": [flat], "weight_decay": 0.01}, {"params": [plain], "weight_decay": 0.0}],
                    lr=1e-2, kernels=kernels_setting)
        lamb.bind_flat_tensor(flat, segments, num_params=3)
        for g in grads:
            flat.grad, plain.grad = g.clone(), g[:37].clone()
            lamb.step()
        weights[kernels_setting] = flat.detach().clone(), plain.detach().clone()
        assert lamb._backend(flat) == kernels_setting
    for fused, native in zip(weights["cuda"], weights["torch"]):
        assert not torch.equal(fused, start[:fused.numel()])
        torch.testing.assert_close(fused, native, rtol=1e-5, atol=1e-6)
