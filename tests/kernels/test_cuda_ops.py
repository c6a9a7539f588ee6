"""The fused CUDA kernels against the references, on a GPU (skipped without one).

Every op and every gradient, by flash-attention's rule (helpers.assert_close_to_reference):
the kernel's error against an fp64 reference is at most 2x the error of PyTorch's own
computation in the same dtype, plus a small atol scaled to the values. Odd sizes,
non-contiguous and misaligned inputs, fp32/fp16/bf16, fixed seeds, no zeros. Then the
model: BertForPreTraining with kernels="cuda" against kernels="torch", 50 steps.

On a GPU machine the extension must build: a build failure fails these tests (with
the loader's reason) rather than skipping them.
"""

import dataclasses
import functools
import math

import pytest
import torch

from bert_ds.kernels import ops as kernels
from bert_ds.kernels import _build, choice, dispatch
from bert_ds.kernels.dispatch import KernelUnavailable
from bert_ds.kernels.selfcheck import mlm_rows
from bert_ds.model.padding import IGNORE_INDEX
from tests.kernels.helpers import (
    ATOL, assert_close_to_reference, attention_per_sequence, cu_seqlens_of, dropout_keep, dropout_layer_norm_fp64,
    dropout_layer_norm_same_dtype, geglu_fp64, geglu_same_dtype, gelu_fp64, gelu_same_dtype, layer_norm_fp64,
    layer_norm_same_dtype, misaligned, mlm_cross_entropy_fp64, non_contiguous, rand, scaled_atol,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def extension():
    module, reason = _build.load_extension()
    assert module is not None, f"the fused CUDA extension does not load on this GPU machine: {reason}"
    return module


def _grads(fn, inputs: dict[str, torch.Tensor], grad_out: torch.Tensor, dtype: torch.dtype | None = None):
    """fn(**inputs) and d(output . grad_out)/d(input) for each input; inputs cast to ``dtype`` if given."""
    leaves = {}
    for name, t in inputs.items():
        leaf = (t.to(dtype) if dtype is not None else t).detach()
        if not t.is_contiguous():  # keep the stride pattern the test chose
            leaf = non_contiguous(leaf)
        leaves[name] = leaf.requires_grad_()
    out = fn(**leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), {name: t.grad for name, t in leaves.items()}


def _check(label, fused, same_dtype, truth, dtype):
    out, grads = fused
    out_same, grads_same = same_dtype
    out_truth, grads_truth = truth
    assert out.dtype == out_same.dtype
    assert_close_to_reference(f"{label} out", out, out_same, out_truth, scaled_atol(dtype, out_truth))
    for name, grad in grads.items():
        assert grad is not None and grad.dtype == grads_same[name].dtype, name
        assert_close_to_reference(f"{label} d{name}", grad, grads_same[name], grads_truth[name],
                                  scaled_atol(dtype, grads_truth[name]))


def test_every_op_passed_its_self_check():
    assert choice.op_verdicts() == {op: "" for op in dispatch.OPS}
    assert kernels.resolve_backend("cuda") == "cuda"
    assert isinstance(kernels.resolve_backend("auto"), kernels.OpPlan)


# --------------------------------------------------------------------------- layer norm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [768, 1024, 1023, 37, 4099])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_layer_norm(dtype, hidden, with_residual, layout):
    rows, eps = 257, 1e-12
    inputs = {"x": rand(rows, hidden, dtype=dtype, seed=1, scale=2.0, shift=0.5, device="cuda"),
              "weight": rand(hidden, dtype=dtype, seed=3, shift=1.0, device="cuda"),
              "bias": rand(hidden, dtype=dtype, seed=4, device="cuda")}
    if with_residual:
        inputs["residual"] = rand(rows, hidden, dtype=dtype, seed=2, device="cuda")
    if layout == "strided":
        inputs = {k: non_contiguous(v) if v.dim() == 2 else v for k, v in inputs.items()}
    elif layout == "misaligned":
        inputs = {k: misaligned(v) if v.dim() == 2 else v for k, v in inputs.items()}
    grad_out = rand(rows, hidden, dtype=dtype, seed=5, device="cuda")

    fused = _grads(lambda **t: kernels.layer_norm(eps=eps, backend="cuda", **t), inputs, grad_out)
    same = _grads(lambda **t: layer_norm_same_dtype(eps=eps, **t), inputs, grad_out)
    truth = _grads(lambda **t: layer_norm_fp64(eps=eps, **t), inputs, grad_out, torch.float64)
    _check(f"layer_norm {dtype} {hidden}", fused, same, truth, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [768, 1024, 1023])
def test_layer_norm_without_bias(dtype, hidden):
    """ModernBERT's LayerNorm (no bias, no residual): no bias gradient, the rest against fp64."""
    inputs = {"x": rand(257, hidden, dtype=dtype, seed=1, scale=2.0, shift=0.5, device="cuda"),
              "weight": rand(hidden, dtype=dtype, seed=3, shift=1.0, device="cuda")}
    grad_out = rand(257, hidden, dtype=dtype, seed=5, device="cuda")
    fused = _grads(lambda **t: kernels.layer_norm(bias=None, eps=1e-5, backend="cuda", **t), inputs, grad_out)
    same = _grads(lambda **t: layer_norm_same_dtype(bias=None, eps=1e-5, **t), inputs, grad_out)
    truth = _grads(lambda **t: layer_norm_fp64(bias=None, eps=1e-5, **t), inputs, grad_out, torch.float64)
    _check(f"layer_norm without bias {dtype} {hidden}", fused, same, truth, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [768, 1023])
@pytest.mark.parametrize("residual_fp32", [False, True])
def test_layer_norm_with_fp32_parameters(dtype, hidden, residual_fp32):
    """What autocast over fp32 parameters passes: fp32 weights, and in the first layer an fp32 residual."""
    inputs = {"x": rand(64, hidden, dtype=dtype, seed=1, device="cuda"),
              "weight": rand(hidden, seed=2, shift=1.0, device="cuda"),
              "bias": rand(hidden, seed=3, device="cuda"),
              "residual": rand(64, hidden, dtype=torch.float32 if residual_fp32 else dtype, seed=4, device="cuda")}
    grad_out = rand(64, hidden, dtype=dtype, seed=5, device="cuda")
    fused = _grads(lambda **t: kernels.layer_norm(eps=1e-5, backend="cuda", **t), inputs, grad_out)
    same = _grads(lambda **t: kernels.layer_norm_ref(eps=1e-5, **t), inputs, grad_out)
    truth = _grads(lambda **t: layer_norm_fp64(eps=1e-5, **t), inputs, grad_out, torch.float64)
    assert fused[1]["weight"].dtype == torch.float32
    _check(f"layer_norm {dtype} x, fp32 params", fused, same, truth, dtype)


def test_layer_norm_backward_is_deterministic():
    x = rand(4096, 1024, dtype=torch.bfloat16, seed=1, device="cuda").requires_grad_()
    weight = rand(1024, dtype=torch.bfloat16, seed=2, device="cuda").requires_grad_()
    bias = rand(1024, dtype=torch.bfloat16, seed=3, device="cuda").requires_grad_()
    grad_out = rand(4096, 1024, dtype=torch.bfloat16, seed=4, device="cuda")
    runs = []
    for _ in range(2):
        x.grad = weight.grad = bias.grad = None
        kernels.layer_norm(x, weight, bias, 1e-12, backend="cuda").backward(grad_out)
        runs.append((x.grad.clone(), weight.grad.clone(), bias.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# --------------------------------------------------------------------------- dropout + residual + layer norm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [768, 1024, 1023, 100])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_dropout_add_layer_norm(dtype, hidden, dropout_p, layout):
    """Forward and every gradient, the bias's included, against the fp64 reference given the mask
    the kernel reports; that mask is the independent Philox's, and the backward's is the forward's."""
    from bert_ds.kernels.dropout_layer_norm import dropout_add_layer_norm_fused

    rows, eps, seed, offset = 257, 1e-12, 2024, 4 * 12345
    inputs = {"x": rand(rows, hidden, dtype=dtype, seed=1, scale=2.0, shift=0.5, device="cuda"),
              "bias": rand(hidden, dtype=dtype, seed=6, scale=0.5, device="cuda"),
              "residual": rand(rows, hidden, dtype=dtype, seed=2, device="cuda"),
              "weight": rand(hidden, dtype=dtype, seed=3, shift=1.0, device="cuda"),
              "ln_bias": rand(hidden, dtype=dtype, seed=4, device="cuda")}
    if layout == "strided":
        inputs = {k: non_contiguous(v) if v.dim() == 2 else v for k, v in inputs.items()}
    elif layout == "misaligned":
        inputs = {k: misaligned(v) if v.dim() == 2 else v for k, v in inputs.items()}
    grad_out = rand(rows, hidden, dtype=dtype, seed=5, device="cuda")
    keep = torch.empty(rows, hidden, dtype=torch.bool, device="cuda")
    fused = _grads(lambda **t: dropout_add_layer_norm_fused(eps=eps, dropout_p=dropout_p, seed=seed, offset=offset,
                                                            keep_out=keep, **t), inputs, grad_out)
    assert torch.equal(keep.cpu(), dropout_keep((rows, hidden), dropout_p, seed, offset))
    assert torch.equal(fused[1]["x"] != 0, keep)  # the backward regenerated the forward's mask
    same = _grads(lambda **t: dropout_layer_norm_same_dtype(eps=eps, dropout_p=dropout_p, keep=keep, **t), inputs,
                  grad_out)
    truth = _grads(lambda **t: dropout_layer_norm_fp64(eps=eps, dropout_p=dropout_p, keep=keep, **t), inputs,
                   grad_out, torch.float64)
    _check(f"dropout_add_layer_norm {dtype} {hidden} p={dropout_p}", fused, same, truth, dtype)


@pytest.mark.parametrize("hidden", [768, 1023])
def test_dropout_add_layer_norm_with_fp32_parameters_and_residual(hidden):
    """What autocast over fp32 parameters passes: a bf16 GEMM output, fp32 biases, weights and residual."""
    from bert_ds.kernels.dropout_layer_norm import dropout_add_layer_norm_fused

    inputs = {"x": rand(64, hidden, dtype=torch.bfloat16, seed=1, device="cuda"),
              "bias": rand(hidden, seed=6, device="cuda"), "residual": rand(64, hidden, seed=2, device="cuda"),
              "weight": rand(hidden, seed=3, shift=1.0, device="cuda"), "ln_bias": rand(hidden, seed=4, device="cuda")}
    grad_out = rand(64, hidden, dtype=torch.bfloat16, seed=5, device="cuda")
    keep = torch.empty(64, hidden, dtype=torch.bool, device="cuda")
    fused = _grads(lambda **t: dropout_add_layer_norm_fused(eps=1e-5, dropout_p=0.1, seed=3, offset=0, keep_out=keep,
                                                            **t), inputs, grad_out)
    same = _grads(lambda **t: kernels.dropout_add_layer_norm_ref(eps=1e-5, dropout_p=0.1, keep=keep, **t), inputs,
                  grad_out)
    truth = _grads(lambda **t: dropout_layer_norm_fp64(eps=1e-5, dropout_p=0.1, keep=keep, **t), inputs, grad_out,
                   torch.float64)
    assert fused[0].dtype == torch.bfloat16 and fused[1]["bias"].dtype == fused[1]["residual"].dtype == torch.float32
    _check("dropout_add_layer_norm bf16 x, fp32 params", fused, same, truth, torch.bfloat16)


@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_dropout_add_layer_norm_keeps_one_minus_p_and_follows_torch_s_generator(dropout_p):
    """At BERT-Base's shape the keep rate is 1 - p within 5 standard deviations; the mask follows torch's
    CUDA generator (the same seed, the same mask; the next call, another), which the op advances by 4."""
    x = rand(16384, 768, dtype=torch.bfloat16, seed=1, device="cuda").requires_grad_()
    residual, bias = rand(16384, 768, dtype=torch.bfloat16, seed=2, device="cuda"), x.new_zeros(768)
    weight, grad_out = x.new_ones(768), rand(16384, 768, dtype=torch.bfloat16, seed=3, device="cuda")

    def dropped() -> torch.Tensor:
        x.grad = None
        kernels.dropout_add_layer_norm(x, bias, residual, weight, bias, 1e-12, dropout_p, backend="cuda").backward(
            grad_out)
        return x.grad == 0

    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    torch.cuda.manual_seed(11)
    start = generator.get_offset()
    first = dropped()
    assert generator.get_offset() == start + 4
    second = dropped()
    torch.cuda.manual_seed(11)
    assert torch.equal(dropped(), first) and not torch.equal(first, second)
    n, keep_p = x.numel(), 1 - dropout_p
    assert abs((~first).sum().item() - n * keep_p) <= 5 * math.sqrt(n * keep_p * dropout_p)


def test_dropout_add_layer_norm_backward_is_deterministic():
    inputs = [rand(*shape, dtype=torch.bfloat16, seed=seed, device="cuda").requires_grad_()
              for seed, shape in enumerate([(4096, 1024), (1024,), (4096, 1024), (1024,), (1024,)])]
    grad_out = rand(4096, 1024, dtype=torch.bfloat16, seed=9, device="cuda")
    runs = []
    for _ in range(2):
        for t in inputs:
            t.grad = None
        torch.cuda.manual_seed(5)
        kernels.dropout_add_layer_norm(*inputs, 1e-12, 0.1, backend="cuda").backward(grad_out)
        runs.append([t.grad.clone() for t in inputs])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# --------------------------------------------------------------------------- bias + gelu

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [3072, 4096, 1031, 13])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_bias_gelu(dtype, cols, approximate, layout):
    rows = 129
    inputs = {"x": rand(rows, cols, dtype=dtype, seed=1, scale=3.0, device="cuda"),
              "bias": rand(cols, dtype=dtype, seed=2, device="cuda")}
    if layout == "strided":
        inputs["x"] = non_contiguous(inputs["x"])
    elif layout == "misaligned":
        inputs["x"] = misaligned(inputs["x"])
    grad_out = rand(rows, cols, dtype=dtype, seed=3, device="cuda")
    fused = _grads(lambda **t: kernels.bias_gelu(approximate=approximate, backend="cuda", **t), inputs, grad_out)
    same = _grads(lambda **t: gelu_same_dtype(approximate=approximate, **t), inputs, grad_out)
    truth = _grads(lambda **t: gelu_fp64(approximate=approximate, **t), inputs, grad_out, torch.float64)
    _check(f"bias_gelu {dtype} {cols} {approximate}", fused, same, truth, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bias_gelu_with_fp32_bias(dtype):
    inputs = {"x": rand(64, 3072, dtype=dtype, seed=1, scale=3.0, device="cuda"),
              "bias": rand(3072, seed=2, device="cuda")}
    grad_out = rand(64, 3072, dtype=dtype, seed=3, device="cuda")
    fused = _grads(lambda **t: kernels.bias_gelu(approximate="none", backend="cuda", **t), inputs, grad_out)
    same = _grads(lambda **t: kernels.bias_gelu_ref(approximate="none", **t), inputs, grad_out)
    truth = _grads(lambda **t: gelu_fp64(approximate="none", **t), inputs, grad_out, torch.float64)
    assert fused[1]["bias"].dtype == torch.float32
    _check(f"bias_gelu {dtype} x, fp32 bias", fused, same, truth, dtype)


# --------------------------------------------------------------------------- GeGLU

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1152, 2624, 1031])  # ModernBERT-base's and -large's, and a scalar width
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_geglu(dtype, cols, approximate, layout):
    inputs = {"x": rand(129, 2 * cols, dtype=dtype, seed=1, scale=3.0, device="cuda")}
    if layout == "strided":
        inputs["x"] = non_contiguous(inputs["x"])
    elif layout == "misaligned":
        inputs["x"] = misaligned(inputs["x"])
    grad_out = rand(129, cols, dtype=dtype, seed=2, device="cuda")
    fused = _grads(lambda **t: kernels.geglu(approximate=approximate, backend="cuda", **t), inputs, grad_out)
    same = _grads(lambda **t: geglu_same_dtype(approximate=approximate, **t), inputs, grad_out)
    truth = _grads(lambda **t: geglu_fp64(approximate=approximate, **t), inputs, grad_out, torch.float64)
    _check(f"geglu {dtype} {cols} {approximate}", fused, same, truth, dtype)


# --------------------------------------------------------------------------- MLM cross-entropy

def _mlm_loss_and_grad(fn, logits, labels, dloss):
    """fn(logits, labels)'s summed loss and count, and the logits' gradient for dloss; the leaf keeps
    the logits' layout (strided, misaligned)."""
    leaf = logits.detach().requires_grad_()
    loss, correct = fn(leaf, labels)
    loss.backward(dloss.to(loss.dtype))
    return loss.detach(), correct, leaf.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab,width", [(4915, 30522, 30528), (257, 1031, 1031), (64, 13, 16)])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_mlm_cross_entropy(dtype, rows, vocab, width, layout):
    """BERT-Base's masked rows of a 32,768-token micro-batch and two small cases, on selfcheck.mlm_rows'
    rows (ties, ignored rows, -inf padding, a row shifted by +100): the count equals the reference's
    (torch.argmax's first maximal column); the loss is within 2x the fp32 reference's error of fp64, the
    gradient within 2x its rounding to the dtype; padding columns and ignored rows get exactly 0."""
    logits, labels = mlm_rows(rows, vocab, width, dtype, torch.device("cuda"))
    if layout == "strided":
        logits = non_contiguous(logits)
    elif layout == "misaligned":
        logits = misaligned(logits)
    dloss = torch.tensor(1.0 / rows, device="cuda")  # the model's mean over the masked rows
    fused = _mlm_loss_and_grad(lambda x, y: kernels.mlm_cross_entropy(x, y, backend="cuda"), logits, labels, dloss)
    same = _mlm_loss_and_grad(kernels.mlm_cross_entropy_ref, logits, labels, dloss)
    truth = _mlm_loss_and_grad(mlm_cross_entropy_fp64, logits.double(), labels, dloss.double())
    assert fused[1].dtype == torch.int64 and torch.equal(fused[1], same[1]) and int(fused[1]) == int(truth[1])
    assert_close_to_reference("loss", fused[0], same[0], truth[0], ATOL[torch.float32] * max(1.0, truth[0].item()))
    assert fused[2].dtype == dtype
    assert_close_to_reference("dlogits", fused[2], same[2], truth[2], scaled_atol(dtype, truth[2]))
    scored = labels != IGNORE_INDEX
    assert not fused[2][:, vocab:].any() and not fused[2][~scored].any()


def test_mlm_cross_entropy_is_deterministic():
    logits, labels = mlm_rows(4915, 30522, 30528, torch.bfloat16, torch.device("cuda"))
    dloss = torch.tensor(1.0 / 4915, device="cuda")
    run = functools.partial(_mlm_loss_and_grad, lambda x, y: kernels.mlm_cross_entropy(x, y, backend="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(run(logits, labels, dloss), run(logits, labels, dloss)))


# --------------------------------------------------------------------------- attention

# The backward's path follows max(lengths): one key tile (at most 128: dQ stored by the kernel)
# or general (several key tiles adding dQ up with atomics).
ATTENTION_CASES = [  # (lengths, heads, head_dim)
    ([1, 512, 77, 128, 3], 3, 64),  # 1 and 512 in one batch; general
    ([1, 5, 70, 129, 513], 2, 64),  # a last key tile of one key (129, 513); general
    ([512], 2, 64),  # general
    ([1], 1, 64),  # one tile
    ([1, 5, 70, 128], 3, 64),  # one tile, two query tiles at 70 and 128
    ([13, 200, 64, 65, 129], 4, 32),  # general
    ([5, 70, 127, 1], 2, 32),  # one tile
    ([128] * 16, 12, 64),  # a BERT-Base-like block; one tile
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths,heads,head_dim", ATTENTION_CASES)
@pytest.mark.parametrize("softmax_scale", [None, 0.3])
def test_varlen_attention(dtype, lengths, heads, head_dim, softmax_scale):
    total, max_seqlen = sum(lengths), max(lengths)
    cu_seqlens = cu_seqlens_of(lengths, device="cuda")
    inputs = {name: rand(total, heads, head_dim, dtype=dtype, seed=seed, device="cuda")
              for name, seed in (("q", 1), ("k", 2), ("v", 3))}
    grad_out = rand(total, heads, head_dim, dtype=dtype, seed=4, device="cuda")

    fused = _grads(lambda q, k, v: kernels.varlen_attention(q, k, v, cu_seqlens, max_seqlen,
                                                            softmax_scale=softmax_scale, backend="cuda"),
                   inputs, grad_out)
    same = _grads(lambda q, k, v: attention_per_sequence(q, k, v, lengths, softmax_scale, upcast=False),
                  inputs, grad_out)
    truth = _grads(lambda q, k, v: attention_per_sequence(q, k, v, lengths, softmax_scale), inputs, grad_out,
                   torch.float64)
    _check(f"attention {dtype} {lengths}", fused, same, truth, dtype)


@pytest.mark.parametrize("head_dim", [64, 32])
def test_varlen_attention_one_tile_path_equals_the_general_path(extension, head_dim):
    """Sequences of at most 128 tokens: max_seqlen 128 takes the one-tile backward (dQ stored by
    the kernel), 129 the general one (its second key tile past every sequence: dQ added once, in
    fp32, to zeros, then converted). The same products in the same order: the same bits."""
    lengths, dtype = [1, 5, 70, 128, 33], torch.bfloat16
    total, scale = sum(lengths), 1.0 / math.sqrt(head_dim)
    q, k, v, dout = (rand(total, 4, head_dim, dtype=dtype, seed=seed, device="cuda") for seed in range(4))
    cu_seqlens = cu_seqlens_of(lengths, device="cuda")
    out, lse = extension.varlen_attention_fwd(q, k, v, cu_seqlens, 128, 0.0, scale)
    one_tile = extension.varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, 128, scale)
    general = extension.varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, 129, scale)
    for name, a, b in zip(("dq", "dk", "dv"), one_tile, general):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("layout", ["packed_qkv", "misaligned"])
def test_varlen_attention_takes_strided_and_misaligned_inputs(layout):
    lengths, heads, head_dim, dtype = [5, 300, 1], 2, 64, torch.bfloat16
    total = sum(lengths)
    cu_seqlens = cu_seqlens_of(lengths, device="cuda")
    qkv = rand(total, 3, heads, head_dim, dtype=dtype, seed=1, device="cuda")
    if layout == "packed_qkv":  # q, k, v as views of one (T, 3, nh, hd) projection: not contiguous
        q, k, v = qkv.unbind(1)
        assert not q.is_contiguous()
    else:
        q, k, v = (misaligned(x.contiguous()) for x in qkv.unbind(1))
    expected = kernels.varlen_attention(*(x.contiguous() for x in (q, k, v)), cu_seqlens, max(lengths),
                                        backend="cuda")
    torch.testing.assert_close(kernels.varlen_attention(q, k, v, cu_seqlens, max(lengths), backend="cuda"),
                               expected, rtol=0, atol=0)


@pytest.mark.parametrize("max_extra", [0, 1])  # max_seqlen 128: the one-tile backward; 129: the general one
def test_packed_attention_reads_and_writes_the_projection_in_place(max_extra):
    """varlen_attention_packed on the fused kernels: q, k, v read from one (T, 3, nh, hd)
    projection and its gradient written in one piece, the same bits as the kernels on
    contiguous copies of q, k, v (the same products in the same order)."""
    lengths, heads, head_dim, dtype = [1, 5, 70, 128, 33], 12, 64, torch.bfloat16
    total, max_seqlen = sum(lengths), 128 + max_extra
    cu_seqlens = cu_seqlens_of(lengths, device="cuda")
    qkv = rand(total, 3, heads, head_dim, dtype=dtype, seed=1, device="cuda").requires_grad_()
    dout = rand(total, heads, head_dim, dtype=dtype, seed=2, device="cuda")
    packed = kernels.varlen_attention_packed(qkv, cu_seqlens, max_seqlen, backend="cuda")
    (dqkv,) = torch.autograd.grad(packed, qkv, dout)
    q, k, v = (x.detach().contiguous().requires_grad_() for x in qkv.unbind(1))
    plain = kernels.varlen_attention(q, k, v, cu_seqlens, max_seqlen, backend="cuda")
    grads = torch.autograd.grad(plain, (q, k, v), dout)
    assert torch.equal(packed, plain) and dqkv.is_contiguous()
    assert torch.equal(dqkv, torch.stack(grads, dim=1))


@pytest.mark.parametrize("max_extra", [0, 1])
def test_the_packed_attention_op_declares_what_the_kernels_return(max_extra):
    """torch.library.opcheck on the real kernels: the shapes and strides declared for
    torch.compile (register_fake) are the outputs', and the registered gradient is the kernels'."""
    lengths, heads, head_dim = [1, 5, 70, 128, 33], 12, 64
    qkv = rand(sum(lengths), 3, heads, head_dim, dtype=torch.bfloat16, seed=1, device="cuda").requires_grad_()
    cu_seqlens = cu_seqlens_of(lengths, device="cuda")
    for window, rope_theta in ((-1, 0.0), (64, 10000.0)):  # BERT's layers; a ModernBERT local layer's
        args = (qkv, cu_seqlens, 128 + max_extra, 1 / math.sqrt(head_dim), window, rope_theta)
        results = torch.library.opcheck(torch.ops.bert_ds.packed_attention_fwd.default, args)
        assert set(results.values()) == {"SUCCESS"}, (window, rope_theta, results)


def test_the_window_and_the_rotary_embeddings_pass_the_self_check():
    """The self-check's cases of the local attention and of the rotary path (global and windowed),
    run on this GPU: windows inside a tile, ModernBERT's 64 and wider than every tile, both dtypes
    and head dims, bases 10,000 and 160,000, against local_attention_ref and rotary_attention_ref."""
    from bert_ds.kernels import selfcheck
    from bert_ds.kernels.local_attention import local_attention_fused
    from bert_ds.kernels.rotary_attention import rotary_attention_fused

    cuda = torch.device("cuda")
    assert selfcheck.check_local_attention(local_attention_fused, cuda, rotary=rotary_attention_fused) == []
    assert selfcheck.check_rotary_attention(rotary_attention_fused, cuda, None, 160000.0) == []


def test_varlen_attention_refuses_dropout():
    q, k, v = (rand(8, 1, 64, dtype=torch.bfloat16, seed=s, device="cuda") for s in (1, 2, 3))
    cu_seqlens = cu_seqlens_of([8], device="cuda")
    with pytest.raises(KernelUnavailable, match="dropout"):
        kernels.varlen_attention(q, k, v, cu_seqlens, 8, dropout_p=0.1, backend="cuda")
    with pytest.raises(ValueError, match="no dropout"):
        _build.load_extension()[0].varlen_attention_fwd(q, k, v, cu_seqlens, 8, 0.1, 0.125)
    # auto: the native op runs instead (it does dropout), with a warning
    plan = kernels.OpPlan((("varlen_attention", "fused"),), "a plan whose attention is fused")
    out = kernels.varlen_attention(q, k, v, cu_seqlens, 8, dropout_p=0.1, backend=plan)
    assert out.shape == q.shape


def test_binding_rejects_host_tensors_and_wrong_shapes(extension):
    x = rand(4, 768, seed=1)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        extension.layer_norm_fwd(x, x[0], x[0], None, 1e-5)
    x = x.cuda()
    with pytest.raises(RuntimeError, match="weight must have shape"):
        extension.layer_norm_fwd(x, x[0, :100], x[0, :100], None, 1e-5)
    with pytest.raises(ValueError, match="multiple of 4"):
        extension.dropout_layer_norm_fwd(x, None, x, x[0], x[0], 1e-5, 0.1, 1, 2, None)
    with pytest.raises(RuntimeError, match="keep_out must be a contiguous bool tensor"):
        extension.dropout_layer_norm_fwd(x, None, x, x[0], x[0], 1e-5, 0.1, 1, 4, x)
    with pytest.raises(RuntimeError, match="labels must be int64 of shape"):
        extension.mlm_cross_entropy_fwd(x, torch.zeros(4, dtype=torch.int32, device="cuda"), IGNORE_INDEX)
    q = rand(8, 1, 48, dtype=torch.bfloat16, seed=1, device="cuda")
    with pytest.raises(RuntimeError, match="head_dim 32 or 64"):
        extension.varlen_attention_fwd(q, q, q, cu_seqlens_of([8], device="cuda"), 8, 0.0, 0.1)


# --------------------------------------------------------------------------- the model

def _pretraining_batches(vocab: int, steps: int, batch: int, seq_len: int, seed: int = 0):
    """Fixed right-padded batches with lengths from 1 to seq_len, 15% masked, on the GPU."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(1, seq_len + 1, (batch,), generator=generator)
        lengths[0] = seq_len
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        ids = torch.randint(5, vocab, (batch, seq_len), generator=generator) * mask
        types = (torch.arange(seq_len)[None, :] >= (lengths // 2)[:, None]).long() * mask
        masked = (torch.rand(batch, seq_len, generator=generator) < 0.15) & mask.bool()
        masked[0, 1] = True
        labels = torch.where(masked, ids, IGNORE_INDEX)
        nsp = torch.randint(0, 2, (batch,), generator=generator)
        batches.append([t.cuda() for t in (ids, types, mask, labels, nsp)])
    return batches


def _loss_curve(config, state, batches, dtype):
    from bert_ds.model.bert.model import BertForPreTraining

    model = BertForPreTraining(config).cuda()
    model.load_state_dict(state)
    model.to(dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    losses = []
    for batch in batches:
        loss = model(*batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("preset", ["tiny", "mini"])
def test_model_loss_curve_matches_the_torch_path(preset):
    from bert_ds.model.bert.model import BertForPreTraining
    from bert_ds.model.families import model_preset

    vocab, dtype = 1024, torch.bfloat16
    config = model_preset(preset, vocab, hidden_dropout=0.0, attention_dropout=0.0, kernels="torch")
    torch.manual_seed(0)
    state = BertForPreTraining(config).state_dict()
    batches = _pretraining_batches(vocab, steps=50, batch=16, seq_len=128)

    fused_model = BertForPreTraining(dataclasses.replace(config, kernels="cuda"))
    assert fused_model.backend == "cuda"
    assert list(fused_model.state_dict()) == list(state)  # same checkpoint layout with kernels on or off

    reference = _loss_curve(config, state, batches, dtype)
    fused = _loss_curve(dataclasses.replace(config, kernels="cuda"), state, batches, dtype)
    assert all(math.isfinite(x) for x in fused)
    assert reference[-1] < reference[0] - 0.5, f"the model does not learn: {reference}"
    assert abs(fused[0] - reference[0]) <= 0.01 * reference[0], (fused[0], reference[0])
    gaps = [abs(a - b) / b for a, b in zip(fused, reference)]
    assert max(gaps) <= 0.05 and sum(gaps) / len(gaps) <= 0.02, list(zip(fused, reference))


def test_model_under_autocast_runs_every_op_fused():
    """fp32 parameters under bf16 autocast (bert_ds.tools.bench's CUDA precision): the ops see mixed dtypes."""
    from bert_ds.model.bert.model import BertForPreTraining
    from bert_ds.model.families import model_preset

    config = model_preset("mini", 1024, hidden_dropout=0.0, attention_dropout=0.0, kernels="torch")
    torch.manual_seed(0)
    state = BertForPreTraining(config).state_dict()
    batches = _pretraining_batches(1024, steps=5, batch=8, seq_len=128)
    curves = {}
    for setting in ("torch", "cuda"):
        model = BertForPreTraining(dataclasses.replace(config, kernels=setting)).cuda()
        model.load_state_dict(state)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curves[setting] = []
        for batch in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(*batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            curves[setting].append(loss.item())
    for fused, reference in zip(curves["cuda"], curves["torch"]):
        assert abs(fused - reference) <= 0.02 * reference, curves


def test_model_in_float32_with_kernels_cuda_names_the_attention():
    from bert_ds.model.bert.model import BertForPreTraining
    from bert_ds.model.families import model_preset

    model = BertForPreTraining(model_preset("tiny", 128, kernels="cuda")).cuda()
    batch = _pretraining_batches(128, steps=1, batch=2, seq_len=16)[0]
    with pytest.raises(KernelUnavailable, match="varlen_attention.*float32"):
        model(*batch)


def _lamb_on_a_flat_tensor(kernels_setting: str, steps: int = 20) -> torch.Tensor:
    """Lamb stepping one bound flat tensor: fragments of BERT-Base's shapes with padding between."""
    from bert_ds.optim.lamb import Lamb

    generator = torch.Generator(device="cuda").manual_seed(0)
    sizes = [768 * 768, 768, 768 * 3072, 3072, 1001]
    segments, offset = [], 0
    for i, n in enumerate(sizes):
        segments.append((offset, n, i))
        offset += n + 13  # padding
    flat = (torch.randn(offset, device="cuda", generator=generator) * 0.02).requires_grad_()
    lamb = Lamb([{"params": [flat], "weight_decay": 0.01}], lr=1e-3, kernels=kernels_setting)
    lamb.bind_flat_tensor(flat, segments, num_params=len(sizes))
    for _ in range(steps):
        flat.grad = torch.randn(offset, device="cuda", generator=generator) * 1e-3
        lamb.step()
    return flat.detach()


def test_lamb_fused_update_follows_the_native_path_and_is_deterministic():
    fused, native = _lamb_on_a_flat_tensor("cuda"), _lamb_on_a_flat_tensor("torch")
    torch.testing.assert_close(fused, native, rtol=1e-5, atol=1e-7)
    assert torch.equal(fused, _lamb_on_a_flat_tensor("cuda"))  # chunk sums in a fixed order, no atomics
