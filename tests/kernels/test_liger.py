"""liger-kernel's GeGLU and LayerNorm as candidates of kernels=auto (kernels/liger.py), on a CPU: the
package stands in as a module whose functions compute the definitions and record their calls."""

import types

import pytest
import torch
import torch.nn.functional as F

from bert_ds.kernels import geglu, layer_norm, liger, speed
from bert_ds.kernels.geglu import geglu_ref
from bert_ds.kernels.layer_norm import layer_norm_ref


@pytest.fixture
def fake_liger(monkeypatch):
    """liger_kernel.functional on this CPU, its tensors taken for CUDA ones."""
    calls = []

    def geglu(a, b):
        calls.append(("geglu", a, b))
        return (F.gelu(a.float(), approximate="tanh") * b.float()).to(a.dtype)

    def layer_norm(x, weight, bias=None, eps=1e-6):
        calls.append(("layer_norm", x, weight, bias, eps))
        bias = torch.zeros_like(weight) if bias is None else bias
        return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)

    functional = types.SimpleNamespace(geglu=geglu, layer_norm=layer_norm)
    liger.liger_functional.cache_clear()
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(liger.importlib, "import_module", lambda name: functional)
    monkeypatch.setattr(liger, "on_cuda", lambda *tensors: True)
    yield calls
    liger.liger_functional.cache_clear()


def test_liger_is_a_candidate_of_geglu_and_layer_norm_that_says_why_not_where_it_cannot_run():
    assert "liger" in speed.candidate_names()["geglu"] and "liger" in speed.candidate_names()["layer_norm"]
    x = torch.randn(4, 16)
    off = "its inputs are not all on a CUDA device"
    assert geglu._unsupported("liger", x) == off
    assert layer_norm._unsupported("liger", x, torch.ones(16), None, None) == off
    with pytest.raises(ValueError, match=f"liger-kernel cannot take these inputs: {off}"):
        liger.geglu_liger(x, "tanh")


def test_without_the_package_liger_says_it_is_not_installed(monkeypatch):
    liger.liger_functional.cache_clear()
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(liger, "on_cuda", lambda *tensors: True)
    try:
        assert liger.liger_problem(torch.ones(2)) == "the liger-kernel package is not installed"
    finally:
        liger.liger_functional.cache_clear()


def test_liger_geglu_takes_the_halves_and_only_the_tanh_gelu(fake_liger):
    x = torch.randn(6, 2 * 8, dtype=torch.bfloat16)
    out = liger.geglu_liger(x, "tanh")
    (_, a, b), = fake_liger
    assert torch.equal(a, x[:, :8]) and torch.equal(b, x[:, 8:])
    torch.testing.assert_close(out, geglu_ref(x, "tanh"))
    with pytest.raises(ValueError, match="approximate='none' \\(liger's GeGLU is the tanh approximation\\)"):
        liger.geglu_liger(x, "none")


@pytest.mark.parametrize("with_bias", [True, False])
def test_liger_layer_norm_adds_the_residual_first_and_hands_the_bias_on(fake_liger, with_bias):
    x, residual, weight = torch.randn(5, 16), torch.randn(5, 16), torch.randn(16) + 1.0
    bias = torch.randn(16) if with_bias else None
    out = liger.layer_norm_liger(x, weight, bias, 1e-5, residual)
    (_, summed, _, handed_bias, eps), = fake_liger
    assert torch.equal(summed, x + residual) and eps == 1e-5
    assert handed_bias is bias
    torch.testing.assert_close(out, layer_norm_ref(x, weight, bias, 1e-5, residual))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_the_race_times_liger_s_geglu_for_the_tanh_gelu_and_says_why_not_for_the_erf_one(fake_liger, approximate):
    """The real race on a CPU (a trivial timer): liger's GeGLU is checked against the reference and
    timed where the model's GELU is its tanh form; with the erf form it is out, with the reason."""
    shapes = speed.OpShapes(hidden=16, intermediate=32, num_heads=2, max_seqlen=8, tokens=16, dtype="float32",
                            approximate=approximate, geglu=True)
    timed = {"geglu": {"native": geglu.geglu_native, "liger": liger.geglu_liger}}
    verdict = speed.race(shapes, torch.device("cpu"), timed, {}, timer=lambda run, device: speed.Timing(1.0, 1.0))
    if approximate == "tanh":
        assert set(verdict["geglu"].wall_ms) == {"native", "liger"} and not verdict["geglu"].excluded
    else:
        assert set(verdict["geglu"].wall_ms) == {"native"}
        assert verdict["geglu"].excluded["liger"] == (
            "raised ValueError: liger-kernel cannot take these inputs: approximate='none' "
            "(liger's GeGLU is the tanh approximation)")
