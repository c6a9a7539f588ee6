"""The builders and the learning-rate schedule: BERT's and warmup-stable-decay, a pure function of
the step; a schedule and optimizer loaded from a checkpoint give the uninterrupted run's rates,
and the recipe's settings where a resume changed them."""

import dataclasses
import math

import pytest
import torch

from bert_ds.config import OptimConfig
from bert_ds.optim.builders import build_optimizer, build_schedule
from bert_ds.optim.schedule import decay_steps, lr_multiplier

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


def test_the_bert_schedule_is_bitwise_what_it_was():
    """The formula before warmup-stable-decay joined it: runs (the golden run's losses) keep their rates."""
    def before(step: int, cfg: OptimConfig, total: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.decay == "constant":
            return 1.0
        remaining = max(0.0, 1.0 - (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        return remaining if cfg.decay == "linear" else remaining ** cfg.poly_power

    for cfg in (OptimConfig(warmup_steps=7, decay="linear"), OptimConfig(warmup_steps=0, decay="poly"),
                OptimConfig(warmup_steps=5, decay="constant")):
        assert [lr_multiplier(s, cfg, 97) for s in range(98)] == [before(s, cfg, 97) for s in range(98)]


@pytest.mark.parametrize("decay, midway", [("linear", 0.5), ("one_minus_sqrt", 1 - math.sqrt(0.5)),
                                           ("poly", math.sqrt(0.5))])
def test_wsd_warms_up_holds_the_peak_then_decays_the_last_share(decay, midway):
    cfg = OptimConfig(schedule="wsd", warmup_steps=10, decay=decay, decay_share=0.2, final_lr_fraction=0.1)
    lrs = [lr_multiplier(s, cfg, 100) for s in range(100)]
    assert lrs[:10] == [(s + 1) / 10 for s in range(10)]
    assert lrs[10:80] == [1.0] * 70 and decay_steps(cfg, 100) == 20
    assert lrs[80] == 1.0 and all(a > b for a, b in zip(lrs[80:], lrs[81:]))
    assert lrs[90] == pytest.approx(0.1 + 0.9 * midway)  # halfway through the decay
    assert lrs[99] > 0.1 and lr_multiplier(100, cfg, 100) == pytest.approx(0.1)  # no step at the final rate


def test_wsd_shares_at_the_ends():
    total = 50
    never = OptimConfig(schedule="wsd", warmup_steps=5, decay="one_minus_sqrt", decay_share=0.0)
    assert [lr_multiplier(s, never, total) for s in range(5, total)] == [1.0] * (total - 5)
    for decay in ("linear", "one_minus_sqrt"):  # a share of 1 decays over every step after the warm-up: BERT's
        wsd = OptimConfig(schedule="wsd", warmup_steps=5, decay=decay, decay_share=1.0)
        bert = OptimConfig(schedule="bert", warmup_steps=5, decay=decay)
        assert [lr_multiplier(s, wsd, total) for s in range(total)] == [lr_multiplier(s, bert, total) for s in range(total)]


# --------------------------------------------------------------------------- checkpoints


def _lrs(opt) -> list[float]:
    return [g["lr"] for g in opt.param_groups]


def _built(cfg: OptimConfig, total: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = build_optimizer(model, cfg)
    return model, opt, build_schedule(opt, cfg, total)


def _step(model, opt, schedule) -> None:
    model(torch.ones(2, 3)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    schedule.step()


WSD = OptimConfig(name="stable_adamw", lr=1e-3, schedule="wsd", warmup_steps=3, decay="one_minus_sqrt",
                  decay_share=0.5, betas=(0.9, 0.98), weight_decay=1e-5, decouple_lr=True)


@pytest.mark.parametrize("optimizer_first", [True, False])  # ZeRO-0 loads the optimizer first, ZeRO-1/2 the schedule
def test_a_loaded_schedule_gives_the_uninterrupted_rates(optimizer_first):
    total, saved_at = 12, 5
    model, opt, schedule = _built(WSD, total)
    uninterrupted = []
    for step in range(total):
        if step == saved_at:
            saved = (opt.state_dict(), schedule.state_dict())
        uninterrupted.append(_lrs(opt))
        _step(model, opt, schedule)

    model, opt, schedule = _built(WSD, total)
    loads = [lambda: opt.load_state_dict(saved[0]), lambda: schedule.load_state_dict(saved[1])]
    for load in loads if optimizer_first else loads[::-1]:
        load()
    resumed = []
    for _ in range(saved_at, total):
        resumed.append(_lrs(opt))
        _step(model, opt, schedule)
    assert resumed == uninterrupted[saved_at:]
    assert uninterrupted[0] != uninterrupted[6] != uninterrupted[-1]  # warm-up, peak and decay differ


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_a_resume_takes_the_requested_rate_and_settings_not_the_saved_ones(optimizer_first):
    """A resume records a changed lr, betas or weight decay as safe (bert_ds.checkpoint.resume);
    torch's scheduler and optimizer would put the saved ones back on a load."""
    total, saved_at = 12, 5
    model, opt, schedule = _built(WSD, total)
    for _ in range(saved_at):
        _step(model, opt, schedule)
    saved = (opt.state_dict(), schedule.state_dict())

    changed = dataclasses.replace(WSD, lr=4e-4, betas=(0.8, 0.95), weight_decay=1e-4)
    model, opt, schedule = _built(changed, total)
    loads = [lambda: opt.load_state_dict(saved[0]), lambda: schedule.load_state_dict(saved[1])]
    for load in loads if optimizer_first else loads[::-1]:
        load()
    assert _lrs(opt) == [4e-4 * lr_multiplier(saved_at, changed, total)] * 2
    assert [(g["betas"], g["weight_decay"], g["max_lr"]) for g in opt.param_groups] == [
        ((0.8, 0.95), 1e-4, 4e-4), ((0.8, 0.95), 0.0, 4e-4)]
    assert schedule.last_epoch == saved_at and opt.state[opt.param_groups[0]["params"][0]]["step"] == saved_at
    _step(model, opt, schedule)
    assert _lrs(opt) == [4e-4 * lr_multiplier(saved_at + 1, changed, total)] * 2


def test_no_weight_decay_on_biases_and_layernorm():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for name in ("lamb", "adamw", "stable_adamw"):
        opt = build_optimizer(model, OptimConfig(name=name, weight_decay=0.1))
        decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
        assert decayed == {id(model[0].weight)}


def test_a_phase_plan_passes_each_phases_optimizer_and_schedule_through():
    """ModernBERT's phases as a plan: one optimizer for all, a schedule of each phase's own."""
    from bert_ds.train.phases import PhasePlan

    plan = PhasePlan.from_dict({
        "output": "runs/x", "model": {"preset": "tiny"}, "phases": [
            {"name": "pretrain", "steps": 10, "optim": {"schedule": "wsd", "decay_share": 0.0, "warmup_steps": 3}},
            {"name": "decay", "steps": 5, "optim": {"lr": 3e-4, "schedule": "wsd", "warmup_steps": 0, "decay_share": 1.0,
                                                    "decay": "one_minus_sqrt", "final_lr_fraction": 0.001}}],
        "base": {"data": {"train": ["d"]}, "ds_config": "zero1_fp32.json",
                 "optim": {"name": "stable_adamw", "lr": 8e-4, "betas": [0.9, 0.98], "weight_decay": 1e-5,
                           "decouple_lr": True, "grad_clip": 0.0}}})
    pretrain, decay = (cfg.optim for cfg in plan.train_configs({"vocab_size": 128, "pad_token_id": 0}))
    shared = dict(name="stable_adamw", betas=(0.9, 0.98), weight_decay=1e-5, decouple_lr=True, grad_clip=0.0)
    assert pretrain == OptimConfig(**shared, lr=8e-4, schedule="wsd", decay_share=0.0, warmup_steps=3)
    assert decay == OptimConfig(**shared, lr=3e-4, schedule="wsd", warmup_steps=0, decay_share=1.0,
                                decay="one_minus_sqrt", final_lr_fraction=0.001)
    assert [lr_multiplier(s, pretrain, 10) for s in (2, 9)] == [1.0, 1.0]
    assert lr_multiplier(0, decay, 5) == 1.0 and lr_multiplier(5, decay, 5) == pytest.approx(0.001)
