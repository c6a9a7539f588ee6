"""The PyTorch references of the kernels, against independent formulas, and the dispatch.

Error bounds follow flash-attention's tests: in a low-precision dtype the
reference may be at most 2x as far from an fp64 result as PyTorch's own
same-dtype computation, plus a small atol.
"""

import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F

from bert_ds.kernels import ops as kernels
from bert_ds.kernels import choice, dispatch
from bert_ds.kernels._build import load_extension
from bert_ds.kernels.choice import UnknownKernelBackend, resolve_backend
from bert_ds.kernels.cross_entropy import IGNORE_INDEX
from bert_ds.kernels.dispatch import KernelUnavailable, OpPlan
from bert_ds.kernels.selfcheck import mlm_rows
from bert_ds.kernels.speed import OpShapes
from bert_ds.base.errors import UserError
from tests.kernels.helpers import mlm_cross_entropy_fp64

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)

DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


def _non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values as ``x``, laid out with a stride-2 last dimension."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    out = wide[..., ::2]
    assert not out.is_contiguous()
    return out


def _max_err(x: torch.Tensor, reference: torch.Tensor) -> float:
    return (x.double() - reference).abs().max().item()


# --------------------------------------------------------------------------- layer_norm

def _layer_norm_fp64(x, weight, bias, eps, residual=None):
    h = x.double() if residual is None else x.double() + residual.double()
    mean = h.mean(dim=-1, keepdim=True)
    var = ((h - mean) ** 2).mean(dim=-1, keepdim=True)
    return (h - mean) / torch.sqrt(var + eps) * weight.double() + bias.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 7, 1023])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_layer_norm_ref_matches_formula(dtype, hidden, with_residual, contiguous):
    x = _rand(5, 3, hidden, dtype=dtype, seed=1, scale=3.0) + 0.5
    if not contiguous:
        x = _non_contiguous(x)
    residual = _rand(5, 3, hidden, dtype=dtype, seed=2) if with_residual else None
    weight = _rand(hidden, dtype=dtype, seed=3) + 1.0
    bias = _rand(hidden, dtype=dtype, seed=4)
    eps = 1e-5

    out = kernels.layer_norm_ref(x, weight, bias, eps, residual)
    expected = _layer_norm_fp64(x, weight, bias, eps, residual)
    summed = x if residual is None else x + residual
    same_dtype = F.layer_norm(summed, (hidden,), weight, bias, eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert _max_err(out, expected) <= 2 * _max_err(same_dtype, expected) + 1e-5


@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_ref_grads_match_formula(with_residual):
    hidden = 37
    leaves = {
        "x": _rand(6, hidden, seed=1, scale=2.0),
        "weight": _rand(hidden, seed=3) + 1.0,
        "bias": _rand(hidden, seed=4),
    }
    if with_residual:
        leaves["residual"] = _rand(6, hidden, seed=2)
    grad_out = _rand(6, hidden, seed=5)

    def grads(fn, dtype):
        inputs = {k: v.to(dtype, copy=True).requires_grad_() for k, v in leaves.items()}
        fn(eps=1e-5, **inputs).backward(grad_out.to(dtype))
        return {k: v.grad for k, v in inputs.items()}

    ours = grads(kernels.layer_norm_ref, torch.float32)
    expected = grads(_layer_norm_fp64, torch.float64)
    for name in leaves:
        assert _max_err(ours[name], expected[name]) <= 1e-5, name


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_ref_without_bias_matches_formula(dtype):
    """bias=None: a LayerNorm without one (ModernBERT's), and no bias gradient."""
    leaves = {"x": _rand(5, 3, 1023, seed=1, scale=3.0) + 0.5, "weight": _rand(1023, seed=3) + 1.0}
    grad_out = _rand(5, 3, 1023, seed=5)
    x, weight = (leaves[name].to(dtype, copy=True).requires_grad_() for name in ("x", "weight"))
    out = kernels.layer_norm_ref(x, weight, None, 1e-5)
    expected = _layer_norm_fp64(x, weight, torch.zeros(()), 1e-5)
    same_dtype = F.layer_norm(x, (1023,), weight, None, 1e-5)
    assert out.dtype == dtype and _max_err(out, expected) <= 2 * _max_err(same_dtype, expected) + 1e-5
    out.float().backward(grad_out)
    truth = {name: t.double().requires_grad_() for name, t in leaves.items()}
    _layer_norm_fp64(truth["x"], truth["weight"], torch.zeros(()), 1e-5).backward(grad_out.double())
    if dtype == torch.float32:
        for name, ours in (("x", x), ("weight", weight)):
            assert _max_err(ours.grad, truth[name].grad) <= 1e-4, name


def test_layer_norm_public_op_runs_reference_on_torch():
    x, weight, bias = _rand(4, 33, seed=1), _rand(33, seed=2), _rand(33, seed=3)
    residual = _rand(4, 33, seed=4)
    out = kernels.layer_norm(x, weight, bias, 1e-12, residual, backend="torch")
    assert torch.equal(out, kernels.layer_norm_ref(x, weight, bias, 1e-12, residual))


# --------------------------------------------------------------------------- dropout_add_layer_norm

def _dropout_layer_norm_fp64(x, bias, residual, weight, ln_bias, eps, dropout_p, keep):
    h = torch.where(keep, (x.double() + bias.double()) / (1 - dropout_p), 0.0) + residual.double()
    mean = h.mean(dim=-1, keepdim=True)
    var = ((h - mean) ** 2).mean(dim=-1, keepdim=True)
    return (h - mean) / torch.sqrt(var + eps) * weight.double() + ln_bias.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 7, 1023])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("contiguous", [True, False])
def test_dropout_add_layer_norm_ref_matches_formula(dtype, hidden, dropout_p, contiguous):
    x = _rand(5, 3, hidden, dtype=dtype, seed=1, scale=3.0) + 0.5
    if not contiguous:
        x = _non_contiguous(x)
    residual, bias = _rand(5, 3, hidden, dtype=dtype, seed=2), _rand(hidden, dtype=dtype, seed=3)
    weight, ln_bias = _rand(hidden, dtype=dtype, seed=4) + 1.0, _rand(hidden, dtype=dtype, seed=5)
    keep = torch.rand(5, 3, hidden, generator=torch.Generator().manual_seed(6)) >= dropout_p
    out = kernels.dropout_add_layer_norm_ref(x, bias, residual, weight, ln_bias, 1e-5, dropout_p, keep)
    expected = _dropout_layer_norm_fp64(x, bias, residual, weight, ln_bias, 1e-5, dropout_p, keep)
    h = torch.where(keep, (x + bias) / (1 - dropout_p), torch.zeros((), dtype=dtype)) + residual
    same_dtype = F.layer_norm(h, (hidden,), weight, ln_bias, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert _max_err(out, expected) <= 2 * _max_err(same_dtype, expected) + 1e-5


def test_dropout_add_layer_norm_ref_grads_match_formula():
    leaves = {"x": _rand(6, 37, seed=1, scale=2.0), "bias": _rand(37, seed=2), "residual": _rand(6, 37, seed=3),
              "weight": _rand(37, seed=4) + 1.0, "ln_bias": _rand(37, seed=5)}
    keep = torch.rand(6, 37, generator=torch.Generator().manual_seed(6)) >= 0.3
    grad_out = _rand(6, 37, seed=7)

    def grads(fn, dtype):
        inputs = {k: v.to(dtype, copy=True).requires_grad_() for k, v in leaves.items()}
        fn(eps=1e-5, dropout_p=0.3, keep=keep, **inputs).backward(grad_out.to(dtype))
        return {k: v.grad for k, v in inputs.items()}

    ours, expected = grads(kernels.dropout_add_layer_norm_ref, torch.float32), grads(_dropout_layer_norm_fp64,
                                                                                   torch.float64)
    for name in leaves:
        assert _max_err(ours[name], expected[name]) <= 1e-5, name
    assert torch.equal(ours["x"] == 0, ~keep.expand(6, 37))  # dropped elements pass no gradient


def test_dropout_add_layer_norm_ref_without_a_mask_draws_one_keeping_one_minus_p():
    x, residual = _rand(64, 1024, seed=1), _rand(64, 1024, seed=2)
    weight, ln_bias = torch.ones(1024), torch.zeros(1024)
    x.requires_grad_()
    torch.manual_seed(0)
    kernels.dropout_add_layer_norm_ref(x, None, residual, weight, ln_bias, 1e-5, 0.25).backward(_rand(64, 1024, seed=3))
    kept = (x.grad != 0).float().mean().item()
    assert abs(kept - 0.75) < 5 * math.sqrt(0.75 * 0.25 / x.numel())
    no_dropout = kernels.dropout_add_layer_norm_ref(x, None, residual, weight, ln_bias, 1e-5, 0.0)
    assert torch.equal(no_dropout, kernels.layer_norm_ref(x, weight, ln_bias, 1e-5, residual))


def test_dropout_add_layer_norm_public_op_runs_the_native_op_on_torch_and_checks_p():
    x, residual, bias = _rand(4, 33, seed=1), _rand(4, 33, seed=2), _rand(33, seed=3)
    weight, ln_bias = _rand(33, seed=4), _rand(33, seed=5)
    out = kernels.dropout_add_layer_norm(x, bias, residual, weight, ln_bias, 1e-12, 0.0, backend="torch")
    assert torch.equal(out, kernels.dropout_add_layer_norm_native(x, bias, residual, weight, ln_bias, 1e-12, 0.0))
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match="dropout_p"):
            kernels.dropout_add_layer_norm(x, bias, residual, weight, ln_bias, 1e-12, p, backend="torch")


@pytest.mark.parametrize("change, reason", [
    ({"x": torch.float64}, "torch.float64 input"),
    ({"bias": torch.float32}, "a torch.float32 bias beside torch.bfloat16 LayerNorm weights"),
    ({"weight": torch.float16}, "weight/ln_bias for torch.bfloat16 input"),
    ({"residual": torch.float16}, "a torch.float16 residual"),
    ({}, "its inputs are not all on a CUDA device"),
])
def test_fused_dropout_add_layer_norm_says_which_inputs_it_cannot_take(change, reason):
    from bert_ds.kernels import dropout_layer_norm

    dtypes = {"x": torch.bfloat16, "bias": torch.bfloat16, "residual": torch.bfloat16, "weight": torch.bfloat16,
              "ln_bias": torch.bfloat16, **change}
    t = {name: torch.zeros(2, 8, dtype=d) if name in ("x", "residual") else torch.zeros(8, dtype=d)
         for name, d in dtypes.items()}
    if "weight" in change:
        t["ln_bias"] = t["ln_bias"].to(change["weight"])
    assert reason in dropout_layer_norm._unsupported("fused", t["x"], t["bias"], t["residual"], t["weight"],
                                                     t["ln_bias"])


# --------------------------------------------------------------------------- bias_gelu

def _gelu_fp64(x, bias, approximate):
    h = x.double() + bias.double()
    if approximate == "tanh":
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
    return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("width", [1, 13, 1031])
@pytest.mark.parametrize("contiguous", [True, False])
def test_bias_gelu_ref_matches_formula(dtype, approximate, width, contiguous):
    x = _rand(7, width, dtype=dtype, seed=1, scale=3.0)
    if not contiguous:
        x = _non_contiguous(x)
    bias = _rand(width, dtype=dtype, seed=2)

    out = kernels.bias_gelu_ref(x, bias, approximate)
    expected = _gelu_fp64(x, bias, approximate)
    same_dtype = F.gelu(x + bias, approximate=approximate)
    assert out.dtype == dtype and out.shape == x.shape
    assert _max_err(out, expected) <= 2 * _max_err(same_dtype, expected) + 1e-6


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_ref_grads_match_formula(approximate):
    x0, bias0, grad_out = _rand(9, 41, seed=1, scale=3.0), _rand(41, seed=2), _rand(9, 41, seed=3)

    def grads(fn, dtype):
        x, bias = x0.to(dtype, copy=True).requires_grad_(), bias0.to(dtype, copy=True).requires_grad_()
        fn(x, bias, approximate).backward(grad_out.to(dtype))
        return x.grad, bias.grad

    for ours, expected in zip(grads(kernels.bias_gelu_ref, torch.float32), grads(_gelu_fp64, torch.float64)):
        assert _max_err(ours, expected) <= 1e-5


def test_bias_gelu_public_op_runs_reference_on_torch():
    x, bias = _rand(3, 11, seed=1), _rand(11, seed=2)
    assert torch.equal(kernels.bias_gelu(x, bias, "tanh", backend="torch"),
                       kernels.bias_gelu_ref(x, bias, "tanh"))


# --------------------------------------------------------------------------- geglu

def _geglu_fp64(x, approximate):
    inputs, gate = x.double().chunk(2, dim=-1)
    return _gelu_fp64(inputs, torch.zeros(()), approximate) * gate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("width", [1, 1031])
@pytest.mark.parametrize("contiguous", [True, False])
def test_geglu_ref_matches_formula(dtype, approximate, width, contiguous):
    x = _rand(7, 2 * width, dtype=dtype, seed=1, scale=3.0)
    if not contiguous:
        x = _non_contiguous(x)

    out = kernels.geglu_ref(x, approximate)
    expected = _geglu_fp64(x, approximate)
    same_dtype = F.gelu(x[:, :width], approximate=approximate) * x[:, width:]
    assert out.dtype == dtype and out.shape == (7, width)
    assert _max_err(out, expected) <= 2 * _max_err(same_dtype, expected) + 1e-6


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu_ref_grads_match_formula(approximate):
    x0, grad_out = _rand(9, 82, seed=1, scale=3.0), _rand(9, 41, seed=3)

    def grad(fn, dtype):
        x = x0.to(dtype, copy=True).requires_grad_()
        fn(x, approximate).backward(grad_out.to(dtype))
        return x.grad

    assert _max_err(grad(kernels.geglu_ref, torch.float32), grad(_geglu_fp64, torch.float64)) <= 1e-5


def test_geglu_public_op_runs_the_native_op_on_torch():
    x = _rand(3, 22, seed=1)
    assert torch.equal(kernels.geglu(x, "tanh", backend="torch"), kernels.geglu_native(x, "tanh"))


def test_geglu_refuses_an_unknown_approximation_and_an_odd_width():
    with pytest.raises(ValueError, match="approximate"):
        kernels.geglu(_rand(2, 8, seed=1), "sigmoid", backend="torch")
    with pytest.raises(ValueError, match="an even last dimension"):
        kernels.geglu(_rand(2, 7, seed=1), "none", backend="torch")


# --------------------------------------------------------------------------- varlen attention

def _attention_per_sequence(q, k, v, lengths, softmax_scale):
    """Independent of the scatter/gather: one unmasked SDPA call per sequence."""
    outs, start = [], 0
    for length in lengths:
        rows = slice(start, start + length)
        per_head = [x[rows].transpose(0, 1) for x in (q, k, v)]  # (nh, L, hd)
        outs.append(F.scaled_dot_product_attention(*per_head, scale=softmax_scale).transpose(0, 1))
        start += length
    return torch.cat(outs)  # (T, nh, hd)


def _varlen_inputs(lengths, num_heads, head_dim, dtype):
    total = sum(lengths)
    q, k, v = (_rand(total, num_heads, head_dim, dtype=dtype, seed=seed) for seed in (1, 2, 3))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_seqlens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", [[1], [5, 1, 17, 2], [9, 9]])
@pytest.mark.parametrize("softmax_scale", [None, 0.3])
def test_varlen_attention_ref_matches_per_sequence_sdpa(dtype, lengths, softmax_scale):
    q, k, v, cu_seqlens = _varlen_inputs(lengths, num_heads=3, head_dim=8, dtype=dtype)
    out = kernels.varlen_attention_ref(q, k, v, cu_seqlens, max(lengths), softmax_scale=softmax_scale)
    expected = _attention_per_sequence(*(x.double() for x in (q, k, v)), lengths, softmax_scale)
    same_dtype = _attention_per_sequence(q, k, v, lengths, softmax_scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert _max_err(out, expected) <= 2 * _max_err(same_dtype, expected) + 1e-5


def test_varlen_attention_ref_grads_match_per_sequence_sdpa():
    lengths = [4, 1, 11]
    inputs = _varlen_inputs(lengths, num_heads=2, head_dim=16, dtype=torch.float32)
    cu_seqlens = inputs[3]
    grad_out = _rand(sum(lengths), 2, 16, seed=7)

    def grads(fn):
        q, k, v = (x.clone().requires_grad_() for x in inputs[:3])
        fn(q, k, v).backward(grad_out)
        return q.grad, k.grad, v.grad

    ours = grads(lambda q, k, v: kernels.varlen_attention_ref(q, k, v, cu_seqlens, max(lengths)))
    expected = grads(lambda q, k, v: _attention_per_sequence(q, k, v, lengths, None))
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_varlen_attention_ref_dropout_is_applied():
    q, k, v, cu_seqlens = _varlen_inputs([6, 3], num_heads=2, head_dim=4, dtype=torch.float32)
    torch.manual_seed(0)
    dropped = kernels.varlen_attention_ref(q, k, v, cu_seqlens, 6, dropout_p=0.5)
    assert not torch.allclose(dropped, kernels.varlen_attention_ref(q, k, v, cu_seqlens, 6))


def test_varlen_attention_public_op_runs_reference_on_torch():
    q, k, v, cu_seqlens = _varlen_inputs([3, 5], num_heads=2, head_dim=4, dtype=torch.float32)
    assert torch.equal(kernels.varlen_attention(q, k, v, cu_seqlens, 5, backend="torch"),
                       kernels.varlen_attention_ref(q, k, v, cu_seqlens, 5))


# --------------------------------------------------------------------------- MLM cross-entropy

@pytest.mark.parametrize("dtype", DTYPES)
def test_mlm_cross_entropy_ref_matches_formula(dtype):
    """On the decoder's layout (-inf padding columns, ignored rows, row 0's label the last real column,
    ties for the maximum: rows 0, 3 and the two rows whose label is their argmax count, row 2 does not):
    the summed loss and its gradient against fp64, the count exactly; padding columns and ignored rows
    get exactly zero gradient."""
    logits, labels = mlm_rows(9, 61, 64, dtype, torch.device("cpu"))
    leaf, truth_leaf = logits.clone().requires_grad_(), logits.double().requires_grad_()
    loss, correct = kernels.mlm_cross_entropy_ref(leaf, labels)
    truth_loss, truth_correct = mlm_cross_entropy_fp64(truth_leaf, labels)
    (0.7 * loss).backward()
    (0.7 * truth_loss).backward()
    assert loss.dtype == torch.float32 and correct.dtype == torch.int64 and leaf.grad.dtype == dtype
    assert int(correct) == int(truth_correct) == 4
    assert _max_err(loss, truth_loss) <= 1e-6 * truth_loss.abs().item()
    # fp32 arithmetic on logits up to 120 (the shifted row): a few 1e-7 off where the rounding to fp32 is 2e-8
    assert _max_err(leaf.grad, truth_leaf.grad) <= 2 * _max_err(truth_leaf.grad.to(dtype), truth_leaf.grad) + 2e-6
    ignored = labels == IGNORE_INDEX
    assert ignored.sum() == 2 and not leaf.grad[ignored].any() and not leaf.grad[:, 61:].any()


def test_mlm_cross_entropy_public_op_runs_the_native_op_on_torch():
    logits, labels = mlm_rows(6, 20, 24, torch.float32, torch.device("cpu"))
    ours, native = kernels.mlm_cross_entropy(logits, labels, backend="torch"), kernels.mlm_cross_entropy_native(
        logits, labels)
    assert all(torch.equal(a, b) for a, b in zip(ours, native))


# --------------------------------------------------------------------------- dispatch

def test_resolve_torch():
    assert resolve_backend("torch") == "torch"


def test_resolve_cuda_without_extension_says_why():
    extension, reason = load_extension()
    if extension is not None:
        pytest.skip("the fused CUDA extension loads here")
    with pytest.raises(KernelUnavailable, match=re.escape(reason)) as caught:
        resolve_backend("cuda")
    assert isinstance(caught.value, UserError)
    if torch.version.cuda is None:
        assert "CPU-only build" in reason
    elif not torch.cuda.is_available():
        assert reason == "no CUDA device"


def test_resolve_auto_falls_back_to_torch_and_logs_once(caplog):
    if load_extension()[0] is not None:
        pytest.skip("the fused CUDA extension loads here")
    choice._auto_backend.cache_clear()
    with caplog.at_level(logging.INFO, logger="bert_ds.kernels.choice"):
        assert resolve_backend("auto") == "torch"
        assert resolve_backend("auto") == "torch"
    messages = [r.getMessage() for r in caplog.records if r.name == "bert_ds.kernels.choice"]
    assert len(messages) == 1
    assert "native PyTorch ops" in messages[0] and load_extension()[1] in messages[0]


@pytest.mark.parametrize("name", ["triton", "", "CUDA"])
def test_resolve_rejects_unknown_names(name):
    with pytest.raises(UnknownKernelBackend, match="auto, cuda, torch"):
        resolve_backend(name)


def test_cuda_branch_of_ops_is_never_a_silent_fallback():
    if load_extension()[0] is not None:
        pytest.skip("the fused CUDA extension loads here")
    x, weight, bias = _rand(2, 8, seed=1), _rand(8, seed=2), _rand(8, seed=3)
    with pytest.raises(KernelUnavailable):
        kernels.layer_norm(x, weight, bias, 1e-5, backend="cuda")
    with pytest.raises(KernelUnavailable):
        kernels.bias_gelu(x, bias, "none", backend="cuda")
    with pytest.raises(KernelUnavailable):
        kernels.geglu(x, "none", backend="cuda")
    q, k, v, cu_seqlens = _varlen_inputs([2], num_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(KernelUnavailable):
        kernels.varlen_attention(q, k, v, cu_seqlens, 2, backend="cuda")
    with pytest.raises(KernelUnavailable):
        kernels.mlm_cross_entropy(x, torch.tensor([1, 7]), backend="cuda")


@pytest.mark.parametrize("backend", ["auto", "prefer_cuda"])  # a setting, and the name auto once resolved to
def test_ops_reject_unresolved_backend_names(backend):
    x, weight, bias = _rand(2, 8, seed=1), _rand(8, seed=2), _rand(8, seed=3)
    with pytest.raises(ValueError, match="resolve_backend"):
        kernels.layer_norm(x, weight, bias, 1e-5, backend=backend)


def test_bias_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        kernels.bias_gelu(_rand(2, 8, seed=1), _rand(8, seed=2), "sigmoid", backend="torch")


@pytest.fixture
def fake_extension(monkeypatch, caplog):
    """A CUDA device with a loaded extension whose layer_norm failed its self-check and whose
    bias_gelu won the race (as resolve_backend and the dispatch see them)."""
    from bert_ds.kernels.speed import Choice

    verdicts = {"layer_norm": "y: error 1 > 2 x 0 + 0", "bias_gelu": "", "varlen_attention": ""}
    choices = {"layer_norm": Choice("native", {"native": 1.0}, {"native": 1.0}, {"fused": "failed the self-check"}),
               "bias_gelu": Choice("fused", {"native": 2.0, "fused": 1.0}, {"native": 2.0, "fused": 1.0}, {}),
               "varlen_attention": Choice("native", {"native": 1.0, "fused": 1.5}, {"native": 1.0, "fused": 1.5}, {})}
    for module in (choice, dispatch):
        monkeypatch.setattr(module, "load_extension", lambda: (object(), ""))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(choice, "op_verdicts", lambda: verdicts)
    monkeypatch.setattr(choice, "op_choices", lambda shapes=None: choices)
    monkeypatch.setattr(choice, "verdict_path", lambda: "/cache/verdicts-fake-h100.json")
    monkeypatch.setattr(dispatch, "_verdicts", lambda: verdicts)
    for cached in (choice._auto_backend, choice._log_once, dispatch._log_fallback):
        cached.cache_clear()
    caplog.set_level(logging.INFO, logger="bert_ds.kernels")
    yield caplog
    for cached in (choice._auto_backend, choice._log_once, dispatch._log_fallback):
        cached.cache_clear()


def test_cuda_refuses_to_start_when_an_op_failed_its_self_check(fake_extension):
    with pytest.raises(KernelUnavailable, match="layer_norm: y: error"):
        resolve_backend("cuda")


def test_auto_runs_each_op_s_recorded_winner_and_never_a_failed_kernel(fake_extension):
    plan = resolve_backend("auto")
    assert plan == OpPlan((("layer_norm", "native"), ("bias_gelu", "fused"), ("varlen_attention", "native")),
                          OpShapes().key)
    warnings = [r.getMessage() for r in fake_extension.records if r.levelno == logging.WARNING]
    assert any("layer_norm never runs its fused kernel" in m for m in warnings)
    assert dispatch.choose("layer_norm", plan, _takes_anything) == "native"
    assert dispatch.choose("bias_gelu", plan, _takes_anything) == "fused"
    assert dispatch.choose("varlen_attention", plan, _takes_anything) == "native"
    with pytest.raises(KernelUnavailable, match="layer_norm cannot run fused"):
        dispatch.choose("layer_norm", "cuda", _takes_anything)
    assert dispatch.choose("varlen_attention", "cuda", _takes_anything) == "fused"


def _takes_anything(impl: str) -> str:
    return ""


def test_inputs_a_kernel_cannot_take_are_an_error_under_cuda_and_a_logged_fallback_under_auto(fake_extension):
    problem = "torch.float64 input"
    with pytest.raises(KernelUnavailable, match=problem):
        dispatch.choose("bias_gelu", "cuda", lambda impl: problem)
    plan = resolve_backend("auto")
    for _ in range(3):
        assert dispatch.choose("bias_gelu", plan, lambda impl: problem) == "native"
    fallbacks = [r for r in fake_extension.records if problem in r.getMessage()]
    assert len(fallbacks) == 1 and fallbacks[0].levelno == logging.WARNING


def test_a_width_the_geglu_kernel_cannot_take_is_one_error_under_cuda_and_one_warning_under_auto(fake_extension):
    """A projection whose halves overflow the kernels' 32-bit column index (a meta tensor: no memory):
    kernels=cuda stops with one line that names the setting; a plan whose geglu winner is the fused
    kernel says so once and runs the native op."""
    x = torch.empty(2, 2 ** 32 + 2, device="meta")
    with pytest.raises(KernelUnavailable) as refused:
        kernels.geglu(x, "none", backend="cuda")
    message = str(refused.value)
    assert message.startswith("kernels=cuda: geglu cannot run fused: a width of 4294967298 ") and "\n" not in message
    plan = OpPlan((("geglu", "fused"),), OpShapes(geglu=True).key)
    for _ in range(3):
        assert kernels.geglu(x, "none", backend=plan).shape == (2, 2 ** 31 + 1)
    fallbacks = [r.getMessage() for r in fake_extension.records if r.levelno == logging.WARNING]
    assert fallbacks == ["kernels=auto: geglu runs the native op where fused cannot: a width of 4294967298 (it takes "
                         "halves of 1 to 2147483647 columns)"]


def test_fused_attention_declines_dropout_and_host_tensors():
    from bert_ds.kernels import attention

    q, k, v, cu_seqlens = _varlen_inputs([3], num_heads=1, head_dim=64, dtype=torch.bfloat16)
    assert "dropout" in attention._unsupported("fused", q, k, v, cu_seqlens, 0.1, None)
    assert "CUDA device" in attention._unsupported("fused", q, k, v, cu_seqlens, 0.0, None)
