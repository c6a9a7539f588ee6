import pytest
import torch

from bert_ds.config import OptimConfig
from bert_ds.optim.builders import build_optimizer, lr_multiplier

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)


def test_warmup_then_linear_decay_to_zero():
    cfg = OptimConfig(warmup_steps=10, decay="linear")
    lrs = [lr_multiplier(s, cfg, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # monotone after the peak
    assert lr_multiplier(100, cfg, 100) == 0.0


def test_poly_decay_is_above_linear_midway():
    lin = OptimConfig(warmup_steps=0, decay="linear")
    poly = OptimConfig(warmup_steps=0, decay="poly", poly_power=0.5)
    assert lr_multiplier(50, poly, 100) == pytest.approx(0.5 ** 0.5)
    assert lr_multiplier(50, poly, 100) > lr_multiplier(50, lin, 100)


def test_no_weight_decay_on_biases_and_layernorm():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
