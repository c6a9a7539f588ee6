"""The native path (``<op>_native``: what ``kernels=torch`` and an unused fused kernel run)
against the references, and which inputs its attention sends to torch's varlen_attn.

varlen_attn raises on a CPU, so its dispatch is tested with the detection and the
device's compute capability substituted: the decision code is the real one.
"""

import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from bert_ds.kernels import ops as kernels
from bert_ds.kernels import attention, dispatch, selfcheck
from bert_ds.kernels.attention import VarlenAttnApi
from bert_ds.kernels.lamb import lamb_update_native
from bert_ds.kernels.cross_entropy import IGNORE_INDEX
from bert_ds.kernels.dropout_layer_norm import dropout_add_layer_norm_native, dropout_add_layer_norm_ref
from bert_ds.kernels.layer_norm import layer_norm_native, layer_norm_ref
from bert_ds.kernels.selfcheck import mlm_rows
from bert_ds.model import padding

from tests.kernels.helpers import cu_seqlens_of, non_contiguous, rand

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)


def _varlen_inputs(lengths: list[int], num_heads: int, head_dim: int, dtype: torch.dtype):
    q, k, v = (rand(sum(lengths), num_heads, head_dim, dtype=dtype, seed=seed) for seed in (1, 2, 3))
    return q, k, v, cu_seqlens_of(lengths)


# --------------------------------------------------------------------------- numerics

@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_native_layer_norm_is_the_reference_in_float32(with_residual, contiguous):
    x = rand(6, 1023, seed=1, scale=3.0) + 0.5
    x = x if contiguous else non_contiguous(x)
    residual = rand(6, 1023, seed=2) if with_residual else None
    weight, bias = rand(1023, seed=3) + 1.0, rand(1023, seed=4)
    assert torch.equal(layer_norm_native(x, weight, bias, 1e-12, residual),
                       layer_norm_ref(x, weight, bias, 1e-12, residual))


def test_native_layer_norm_gradients_are_the_reference_s_in_float32():
    leaves = {"x": rand(5, 37, seed=1), "residual": rand(5, 37, seed=2), "weight": rand(37, seed=3) + 1.0,
              "bias": rand(37, seed=4)}
    grad_out = rand(5, 37, seed=5)

    def grads(fn):
        inputs = {name: t.clone().requires_grad_() for name, t in leaves.items()}
        fn(eps=1e-12, **inputs).backward(grad_out)
        return [inputs[name].grad for name in leaves]

    for ours, reference in zip(grads(layer_norm_native), grads(layer_norm_ref)):
        assert torch.equal(ours, reference)


def test_native_layer_norm_without_bias_is_torch_s_bias_free_layer_norm():
    """bias=None in float32: ``nn.LayerNorm(bias=False)`` (what ModernBERT's norms ran before the op) bit
    for bit, output and gradients."""
    norm = torch.nn.LayerNorm(1023, eps=1e-5, bias=False)
    with torch.no_grad():
        norm.weight.copy_(rand(1023, seed=3) + 1.0)
    x0, grad_out = rand(6, 1023, seed=1, scale=3.0) + 0.5, rand(6, 1023, seed=2)

    def run(fn):
        x = x0.clone().requires_grad_()
        norm.weight.grad = None
        out = fn(x)
        out.backward(grad_out)
        return out, x.grad, norm.weight.grad

    for ours, theirs in zip(run(lambda x: layer_norm_native(x, norm.weight, None, norm.eps)), run(norm)):
        assert torch.equal(ours, theirs)


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check, native", [
    (selfcheck.check_layer_norm, layer_norm_native),
    (selfcheck.check_bias_gelu, kernels.bias_gelu_native),
    (selfcheck.check_geglu, kernels.geglu_native),
    (selfcheck.check_varlen_attention, kernels.varlen_attention_native),
    (selfcheck.check_mlm_cross_entropy, kernels.mlm_cross_entropy_native),
    (selfcheck.check_lamb_update, lamb_update_native),
])
def test_the_native_ops_meet_the_rule_the_fused_kernels_are_held_to(device, check, native):
    # Every dtype, odd sizes, forward and every gradient: at most twice the error of the
    # reference in the input dtype, against the reference in fp32.
    assert selfcheck.verdict(lambda: check(native, torch.device(device))) == ""


def test_every_op_has_a_fused_self_check():
    # kernels=auto and kernels=cuda decide per op from these checks: an op without one would
    # have no verdict (and the GPU test of the verdicts would fail only on a GPU)
    assert tuple(selfcheck.fused_checks()) == dispatch.OPS


def test_the_lamb_skip_check_catches_a_path_that_ignores_its_flag():
    def ignores_the_flag(param, grad, exp_avg, exp_avg_sq, chunks, s, scales, skip=None):
        lamb_update_native(param, grad, exp_avg, exp_avg_sq, chunks, s, scales)

    def skips_the_weights_only(param, grad, exp_avg, exp_avg_sq, chunks, s, scales, skip=None):
        held = param.clone()
        lamb_update_native(param, grad, exp_avg, exp_avg_sq, chunks, s, scales)
        if skip is not None:
            param.copy_(torch.where(skip != 0, held, param))

    assert any("skip flag set" in p for p in selfcheck.check_lamb_update(ignores_the_flag, torch.device("cpu")))
    found = selfcheck.check_lamb_update(skips_the_weights_only, torch.device("cpu"))
    assert found and all("exp_avg" in p and "param" not in p for p in found), found


def test_a_rule_that_can_fail():
    def off(x, weight, bias, eps, residual=None):
        return layer_norm_native(x, weight, bias, eps, residual) * 1.01
    assert "error" in selfcheck.verdict(lambda: selfcheck.check_layer_norm(off, torch.device("cpu")))


def test_the_attention_check_holds_the_packed_form_to_the_rule():
    """The self-check's packed case (the model's one QKV projection): the native op on qkv's
    views passes; one that reads k and v the wrong way round fails."""
    def packed(qkv, *rest):
        return kernels.varlen_attention_native(*qkv.unbind(1), *rest)

    def swapped(qkv, *rest):
        q, k, v = qkv.unbind(1)
        return kernels.varlen_attention_native(q, v, k, *rest)

    cpu, small = torch.device("cpu"), {"lengths": (1, 40, 17), "heads": 2}  # the GPU's case costs 8 s here
    assert selfcheck.verdict(lambda: selfcheck.check_packed_attention(packed, cpu, **small)) == ""
    found = selfcheck.verdict(lambda: selfcheck.check_packed_attention(swapped, cpu, **small))
    assert found.startswith("packed qkv torch.bfloat16") and "error" in found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_layer_norm_in_half_precision_on_a_cpu_is_the_reference(dtype):
    # A CPU's half-precision LayerNorm backward sums dweight and dbias in the input dtype.
    x, residual = rand(7, 768, dtype=dtype, seed=1, scale=2.0), rand(7, 768, dtype=dtype, seed=2)
    weight, bias = rand(768, dtype=dtype, seed=3) + 1.0, rand(768, dtype=dtype, seed=4)
    assert torch.equal(layer_norm_native(x, weight, bias, 1e-5, residual),
                       layer_norm_ref(x, weight, bias, 1e-5, residual))


def test_native_layer_norm_with_float32_weights_for_half_inputs_is_the_reference():
    x, residual = rand(4, 33, dtype=torch.bfloat16, seed=1), rand(4, 33, dtype=torch.bfloat16, seed=2)
    weight, bias = rand(33, seed=3) + 1.0, rand(33, seed=4)
    assert torch.equal(layer_norm_native(x, weight, bias, 1e-12, residual),
                       layer_norm_ref(x, weight, bias, 1e-12, residual))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_native_bias_gelu_is_the_reference_in_float32_with_its_gradients(approximate):
    x0, bias0, grad_out = rand(9, 1031, seed=1, scale=3.0), rand(1031, seed=2), rand(9, 1031, seed=3)

    def run(fn):
        x, bias = x0.clone().requires_grad_(), bias0.clone().requires_grad_()
        out = fn(x, bias, approximate)
        out.backward(grad_out)
        return out, x.grad, bias.grad

    for ours, reference in zip(run(kernels.bias_gelu_native), run(kernels.bias_gelu_ref)):
        assert torch.equal(ours, reference)


def test_native_bias_gelu_in_bfloat16_keeps_the_dtype_and_a_float32_bias_takes_the_reference():
    x, bias = rand(5, 64, dtype=torch.bfloat16, seed=1, scale=3.0), rand(64, dtype=torch.bfloat16, seed=2)
    out = kernels.bias_gelu_native(x, bias, "none")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.gelu(x + bias), rtol=0, atol=0)
    fp32_bias = bias.float()
    assert torch.equal(kernels.bias_gelu_native(x, fp32_bias, "tanh"), kernels.bias_gelu_ref(x, fp32_bias, "tanh"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_geglu_is_what_the_model_computed_and_the_reference_in_float32(dtype):
    """Bit for bit ModernBERT's MLP before the op (transformers' too): ``F.gelu(input) * gate`` on the
    halves of Wi's output, output and gradient; in float32 that is the reference itself."""
    x0, grad_out = rand(6, 2 * 1031, dtype=dtype, seed=1, scale=3.0), rand(6, 1031, dtype=dtype, seed=2)

    def run(fn):
        x = x0.clone().requires_grad_()
        out = fn(x)
        out.backward(grad_out)
        return out, x.grad

    def before(x):
        inputs, gate = x.chunk(2, dim=-1)
        return F.gelu(inputs, approximate="tanh") * gate

    native = run(lambda x: kernels.geglu_native(x, "tanh"))
    assert native[0].dtype == dtype
    for ours, expected in zip(native, run(before)):
        assert torch.equal(ours, expected)
    if dtype == torch.float32:
        for ours, reference in zip(native, run(lambda x: kernels.geglu_ref(x, "tanh"))):
            assert torch.equal(ours, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_mlm_cross_entropy_is_the_model_s_former_loss_and_the_reference(dtype):
    """Bit for bit the lines bert.py ran before the op (loss, count and gradient), on the decoder's
    layout: -inf padding, ignored rows, a label at the last real column, ties; and the reference's
    count, loss and gradient to fp32 rounding (one dtype rounding of the gradient in bf16)."""
    logits, labels = mlm_rows(9, 61, 64, dtype, torch.device("cpu"))

    def former(x, labels):
        return F.cross_entropy(x.float(), labels, reduction="sum"), (x.detach().argmax(dim=-1) == labels).sum()

    def run(fn):
        leaf = logits.clone().requires_grad_()
        loss, correct = fn(leaf, labels)
        (loss / 7).backward()
        return loss.detach(), correct, leaf.grad

    native, before, reference = run(kernels.mlm_cross_entropy_native), run(former), run(kernels.mlm_cross_entropy_ref)
    assert IGNORE_INDEX == padding.IGNORE_INDEX and (labels == IGNORE_INDEX).any()
    assert all(torch.equal(a, b) for a, b in zip(native, before))
    assert torch.equal(native[1], reference[1]) and native[1] == 4
    torch.testing.assert_close(native[0], reference[0], rtol=1e-6, atol=0)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: one rounding apart at most
    torch.testing.assert_close(native[2].float(), reference[2].float(), rtol=rtol, atol=1e-6)


def test_packed_attention_off_a_gpu_is_the_op_on_the_three_views():
    """varlen_attention_packed(qkv) under kernels=torch: the op on qkv's views q, k, v (what a
    candidate without a packed form is handed), and the gradient of qkv in one piece."""
    lengths, heads, head_dim = [3, 9, 1], 2, 16
    cu_seqlens = cu_seqlens_of(lengths)
    qkv = rand(sum(lengths), 3, heads, head_dim, dtype=torch.float32, seed=1).requires_grad_()
    dout = rand(sum(lengths), heads, head_dim, dtype=torch.float32, seed=2)
    packed = kernels.varlen_attention_packed(qkv, cu_seqlens, max(lengths), backend="torch")
    (dqkv,) = torch.autograd.grad(packed, qkv, dout)
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.unbind(1))
    plain = kernels.varlen_attention(q, k, v, cu_seqlens, max(lengths), backend="torch")
    grads = torch.autograd.grad(plain, (q, k, v), dout)
    torch.testing.assert_close(packed, plain, rtol=0, atol=1e-6)
    torch.testing.assert_close(dqkv, torch.stack(grads, dim=1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_attention_off_a_gpu_is_the_reference(dtype):
    q, k, v, cu_seqlens = _varlen_inputs([5, 1, 17, 2], num_heads=2, head_dim=64, dtype=dtype)
    assert torch.equal(kernels.varlen_attention_native(q, k, v, cu_seqlens, 17),
                       kernels.varlen_attention_ref(q, k, v, cu_seqlens, 17))


@pytest.mark.parametrize("with_bias", [False, True])
def test_native_dropout_add_layer_norm_is_the_reference_in_float32_without_dropout(with_bias):
    leaves = {"x": rand(6, 1023, seed=1, scale=3.0), "bias": rand(1023, seed=2), "residual": rand(6, 1023, seed=3),
              "weight": rand(1023, seed=4) + 1.0, "ln_bias": rand(1023, seed=5)}
    grad_out = rand(6, 1023, seed=6)

    def run(fn):
        inputs = {name: t.clone().requires_grad_() for name, t in leaves.items()}
        if not with_bias:
            inputs["bias"] = None
        out = fn(eps=1e-12, dropout_p=0.0, **inputs)
        out.backward(grad_out)
        return [out.detach()] + [t.grad for t in inputs.values() if t is not None]

    for ours, reference in zip(run(dropout_add_layer_norm_native), run(dropout_add_layer_norm_ref)):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_native_dropout_add_layer_norm_is_what_the_model_ran_before_it(dropout_p):
    """Without a bias (the GEMM added it) and under the same seed: nn.Dropout's mask, then the
    native LayerNorm of the sum, bit for bit, forward and backward (the golden run depends on it)."""
    x, residual = rand(9, 64, seed=1), rand(9, 64, seed=2)
    weight, ln_bias, grad_out = rand(64, seed=3) + 1.0, rand(64, seed=4), rand(9, 64, seed=5)
    runs = []
    for fn in (lambda x, r: dropout_add_layer_norm_native(x, None, r, weight, ln_bias, 1e-12, dropout_p),
               lambda x, r: layer_norm_native(torch.nn.Dropout(dropout_p).train()(x), weight, ln_bias, 1e-12, r)):
        leaves = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
        torch.manual_seed(0)
        out = fn(*leaves)
        out.backward(grad_out)
        runs.append([out.detach(), *(t.grad for t in leaves)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    if dropout_p:
        assert (runs[0][1] == 0).any()  # dropout happened


def test_native_dropout_add_layer_norm_adds_a_float32_bias_in_float32_and_keeps_the_dtype():
    x, residual = rand(4, 32, dtype=torch.bfloat16, seed=1), rand(4, 32, seed=2)
    bias, weight, ln_bias = rand(32, seed=3), rand(32, seed=4) + 1.0, rand(32, seed=5)
    out = dropout_add_layer_norm_native(x, bias, residual, weight, ln_bias, 1e-12, 0.0)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, dropout_add_layer_norm_ref(x, bias, residual, weight, ln_bias, 1e-12, 0.0))


def test_kernels_torch_runs_the_native_ops(monkeypatch):
    calls = []
    for module, name in ((attention, "varlen_attention"), (sys.modules["bert_ds.kernels.layer_norm"], "layer_norm"),
                         (sys.modules["bert_ds.kernels.bias_gelu"], "bias_gelu"),
                         (sys.modules["bert_ds.kernels.dropout_layer_norm"], "dropout_add_layer_norm"),
                         (sys.modules["bert_ds.kernels.cross_entropy"], "mlm_cross_entropy"),
                         (sys.modules["bert_ds.kernels.geglu"], "geglu")):
        native = module.IMPLEMENTATIONS["native"]
        monkeypatch.setitem(module.IMPLEMENTATIONS, "native",
                            lambda *args, native=native, name=name: calls.append(name) or native(*args))
    q, k, v, cu_seqlens = _varlen_inputs([3, 5], num_heads=2, head_dim=8, dtype=torch.bfloat16)
    x, bias = rand(8, 16, dtype=torch.bfloat16, seed=4), rand(16, dtype=torch.bfloat16, seed=5)
    kernels.varlen_attention(q, k, v, cu_seqlens, 5, backend="torch")
    kernels.layer_norm(x, bias, bias, 1e-12, x, backend="torch")
    kernels.bias_gelu(x, bias, "none", backend="torch")
    kernels.dropout_add_layer_norm(x, bias, x, bias, bias, 1e-12, 0.1, backend="torch")
    kernels.mlm_cross_entropy(x, torch.arange(8), backend="torch")
    kernels.geglu(x, "none", backend="torch")
    assert calls == ["varlen_attention", "layer_norm", "bias_gelu", "dropout_add_layer_norm", "mlm_cross_entropy",
                     "geglu"]


def test_the_native_ops_compile_into_one_graph():
    q, k, v, cu_seqlens = _varlen_inputs([3, 8, 5], num_heads=2, head_dim=8, dtype=torch.float32)
    weight, bias = rand(16, seed=4) + 1.0, rand(16, seed=5)

    def block(q, k, v, cu_seqlens):
        context = kernels.varlen_attention(q, k, v, cu_seqlens, 8, backend="torch").reshape(-1, 16)
        hidden = kernels.bias_gelu(context, bias, "tanh", backend="torch")
        hidden = kernels.dropout_add_layer_norm(hidden, bias, context, weight, bias, 1e-12, 0.0, backend="torch")
        return kernels.layer_norm(hidden, weight, bias, 1e-12, context, backend="torch")

    compiled = torch.compile(block, fullgraph=True, backend="eager")  # fullgraph: a graph break is an error
    torch.testing.assert_close(compiled(q, k, v, cu_seqlens), block(q, k, v, cu_seqlens), rtol=0, atol=0)


# --------------------------------------------------------------------------- varlen_attn dispatch

class FakeVarlenAttn:
    """Stands in for torch's varlen_attn: records its calls, answers like the reference."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
        self.calls.append({"cu_seq_q": cu_seq_q, "cu_seq_k": cu_seq_k, "max_q": max_q, "max_k": max_k, **kwargs})
        return kernels.varlen_attention_ref(q, k, v, cu_seq_q, max_q, softmax_scale=kwargs.get("scale"))


@pytest.fixture
def on_a_gpu(monkeypatch):
    """torch's varlen_attn (a fake) on a device of compute capability 9.0, whatever the tensors' device."""
    fake = FakeVarlenAttn()
    monkeypatch.setattr(attention, "varlen_attn_api", lambda: VarlenAttnApi(fake, takes_scale=True))
    monkeypatch.setattr(attention, "cuda_capability", lambda device: (9, 0))
    return fake


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_half_precision_attention_without_dropout_goes_to_varlen_attn(on_a_gpu, dtype, head_dim):
    q, k, v, cu_seqlens = _varlen_inputs([5, 1, 17], num_heads=2, head_dim=head_dim, dtype=dtype)
    out = kernels.varlen_attention(q, k, v, cu_seqlens, 17, backend="torch")
    assert len(on_a_gpu.calls) == 1
    call = on_a_gpu.calls[0]
    assert call["cu_seq_q"] is cu_seqlens and call["cu_seq_k"] is cu_seqlens
    assert call["max_q"] == call["max_k"] == 17 and "scale" not in call
    assert torch.equal(out, kernels.varlen_attention_ref(q, k, v, cu_seqlens, 17))


def test_a_softmax_scale_is_passed_to_varlen_attn(on_a_gpu):
    q, k, v, cu_seqlens = _varlen_inputs([4, 6], num_heads=1, head_dim=64, dtype=torch.bfloat16)
    kernels.varlen_attention_native(q, k, v, cu_seqlens, 6, softmax_scale=0.3)
    assert on_a_gpu.calls[0]["scale"] == 0.3


def _declined(dtype=torch.bfloat16, head_dim=64, dropout_p=0.0, softmax_scale=None, cu_dtype=torch.int32,
              strided=False):
    q, k, v, cu_seqlens = _varlen_inputs([3, 5], num_heads=2, head_dim=head_dim, dtype=dtype)
    if strided:
        q = non_contiguous(q)
    return not attention.takes_varlen_attn(q, k, v, cu_seqlens.to(cu_dtype), dropout_p, softmax_scale)


@pytest.mark.parametrize("case", [
    {"dtype": torch.float32}, {"dropout_p": 0.1}, {"head_dim": 12}, {"head_dim": 264},
    {"cu_dtype": torch.int64}, {"strided": True},
])
def test_inputs_varlen_attn_cannot_take_go_to_sdpa(on_a_gpu, case):
    assert _declined(**case)
    assert not _declined()  # the same inputs otherwise go to varlen_attn


@pytest.mark.parametrize("capability, head_dim, taken", [
    (None, 64, False), ((7, 5), 64, False), ((8, 0), 64, True), ((8, 6), 192, True),
    ((8, 6), 256, False), ((8, 0), 256, True), ((9, 0), 224, True), ((12, 0), 224, False),
])
def test_varlen_attn_runs_on_the_devices_flash_attention_2_supports(monkeypatch, on_a_gpu, capability, head_dim,
                                                                     taken):
    monkeypatch.setattr(attention, "cuda_capability", lambda device: capability)
    assert _declined(head_dim=head_dim) is not taken


def test_without_varlen_attn_everything_goes_to_sdpa(monkeypatch, on_a_gpu):
    monkeypatch.setattr(attention, "varlen_attn_api", lambda: None)
    q, k, v, cu_seqlens = _varlen_inputs([3, 5], num_heads=2, head_dim=64, dtype=torch.bfloat16)
    assert torch.equal(kernels.varlen_attention_native(q, k, v, cu_seqlens, 5),
                       kernels.varlen_attention_ref(q, k, v, cu_seqlens, 5))
    assert not on_a_gpu.calls


def test_a_varlen_attn_without_scale_takes_only_the_default_scale(monkeypatch, on_a_gpu):
    monkeypatch.setattr(attention, "varlen_attn_api", lambda: VarlenAttnApi(on_a_gpu, takes_scale=False))
    assert _declined(softmax_scale=0.3)
    assert not _declined(softmax_scale=None)


def test_varlen_attn_is_found_where_this_torch_keeps_it():
    from torch.nn.attention import varlen

    api = attention.find_varlen_attn()
    assert api is not None and api.fn is varlen.varlen_attn and api.takes_scale


def test_varlen_attn_is_looked_up_in_each_known_location(monkeypatch):
    def first_release_form(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        raise AssertionError("never called by the lookup")

    module = types.ModuleType("older_torch_attention")
    module.varlen_attn = first_release_form
    monkeypatch.setitem(sys.modules, "older_torch_attention", module)
    monkeypatch.setattr(attention, "VARLEN_ATTN_LOCATIONS",
                        (("no_such_torch_module", "varlen_attn"), ("older_torch_attention", "varlen_attn")))
    assert attention.find_varlen_attn() == VarlenAttnApi(first_release_form, takes_scale=False)
    monkeypatch.setattr(attention, "VARLEN_ATTN_LOCATIONS", (("no_such_torch_module", "varlen_attn"),))
    assert attention.find_varlen_attn() is None


def test_a_process_without_cuda_starts_without_importing_varlen_attn():
    """Its module pulls in torch's compiler stack (about 2.5 s a start): a CPU process never needs it."""
    code = ("import sys, bert_ds.train.loop, bert_ds.kernels.attention as a; "
            "assert 'torch.nn.attention.varlen' not in sys.modules; "
            "assert a.varlen_attn_api() == a.find_varlen_attn(); assert 'torch.nn.attention.varlen' in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
