"""StableAdamW: against its formulas written out in float64, against torch-optimi's StableAdamW
(where installed), over bound flat tensors, under the device skip, as the builders make it, and
under DeepSpeed ZeRO-0/1/2 on two CPU ranks against a single-process reference.

The distributed test launches ``tests/bert_ds/lamb_zero_worker.py`` once (its ``stable`` runs)
and compares the final fp32 weights with :class:`StableAdamWReference` trained in this process
on the concatenated global batches, with DeepSpeed's clipping rule.
"""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch

from bert_ds.config import OptimConfig
from bert_ds.optim import device_skip
from bert_ds.optim.builders import build_optimizer
from bert_ds.optim.stable_adamw import StableAdamW, StableAdamWReference
from tests.bert_ds import lamb_zero_worker as worker
from tests.bert_ds.test_device_skip import _grads, _no_host_reads, _params, _run
from tests.conftest import run_command

BETAS, EPS, LR = (0.9, 0.98), 1e-6, 0.01
DECAYS = [0.1, 0.1, 0.0, 0.0]  # a matrix and a bias that decay, a bias and a LayerNorm weight that do not


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


def _tensors_and_gradients(steps: int = 150):
    """Tensors shaped like BERT's and seeded gradients; every seventh step's are 20x larger, so
    the update clipping acts (rms up to ~4) and then lets go as v catches up."""
    g = torch.Generator().manual_seed(3)
    w0 = [torch.randn(13, 7, generator=g) * 0.2, torch.randn(7, generator=g) * 0.1, torch.zeros(7), torch.ones(7)]
    grads = [[torch.randn(w.shape, generator=g) * (20.0 if i % 7 == 3 else 1.0) for w in w0] for i in range(steps)]
    return w0, grads


def _from_the_formula(w0, grads, decays, *, lr, betas, eps, decouple_lr, clip=True):
    """StableAdamW written out in float64, one tensor and one step at a time, independent of
    bert_ds.optim (Wortsman et al., 2023, Algorithm 2, with optimi's weight decay)."""
    b1, b2 = betas
    out = []
    for w, wd, gs in zip(w0, decays, zip(*grads), strict=True):
        w = w.double().clone()
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        for t, g in enumerate(gs, start=1):
            g = g.double()
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
            rms = math.sqrt((g * g / torch.clamp(v_hat, min=eps ** 2)).mean().item())
            lr_t = lr / max(1.0, rms) if clip else lr
            w = w * (1 - lr_t * (wd / lr if decouple_lr else wd)) - lr_t * m_hat / (v_hat.sqrt() + eps)
        out.append(w)
    return out


def _train(make, w0, grads) -> list[torch.Tensor]:
    params = [w.clone().requires_grad_() for w in w0]
    opt = make([{"params": [p], "weight_decay": wd} for p, wd in zip(params, DECAYS)])
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        opt.step()
    return [p.detach() for p in params]


# --------------------------------------------------------------------------- one process


@pytest.mark.lowest
@pytest.mark.parametrize("decouple_lr", [False, True])
@pytest.mark.parametrize("opt_cls", [StableAdamW, StableAdamWReference])
def test_stable_adamw_matches_the_float64_formula(opt_cls, decouple_lr):
    w0, grads = _tensors_and_gradients()
    got = _train(lambda groups: opt_cls(groups, lr=LR, betas=BETAS, eps=EPS, decouple_lr=decouple_lr), w0, grads)
    want = _from_the_formula(w0, grads, DECAYS, lr=LR, betas=BETAS, eps=EPS, decouple_lr=decouple_lr)
    assert _max_diff(got, want) <= 2e-6
    # The clipping is what is tested: without it every tensor ends far beyond the tolerance.
    unclipped = _from_the_formula(w0, grads, DECAYS, lr=LR, betas=BETAS, eps=EPS, decouple_lr=decouple_lr, clip=False)
    assert min((a - b).abs().max().item() for a, b in zip(want, unclipped)) > 1e-3


@pytest.mark.filterwarnings("ignore:You are using weight_decay")  # optimi's, of a decoupled 0.1: so it moves
@pytest.mark.parametrize("decouple_lr", [False, True])
def test_stable_adamw_matches_torch_optimi(decouple_lr):
    optimi = pytest.importorskip("optimi")
    w0, grads = _tensors_and_gradients()
    theirs = _train(lambda groups: optimi.StableAdamW(groups, lr=LR, betas=BETAS, eps=EPS, decouple_lr=decouple_lr,
                                                      foreach=False, triton=False, kahan_sum=False), w0, grads)
    ours = _train(lambda groups: StableAdamW(groups, lr=LR, betas=BETAS, eps=EPS, decouple_lr=decouple_lr), w0, grads)
    assert _max_diff(ours, theirs) <= 2e-6
    assert min((a - b).abs().max().item() for a, b in zip(ours, w0)) > 0.1  # every tensor moved far


@pytest.mark.lowest
def test_a_bound_flat_tensor_clips_per_parameter_and_leaves_padding_alone():
    """A flat tensor with padding gaps and a parameter with no fragment in it, as a ZeRO
    partition looks, steps exactly like the parameters themselves; one rms for the whole flat
    tensor is another optimizer."""
    params = list(worker.build_model().parameters())
    reference = StableAdamWReference([{"params": params, "weight_decay": 0.1}], lr=0.05, betas=BETAS)
    absent = 4  # its slot exists in the index space, but no element of it is in the flat tensor
    segments, offset = [], 3
    for i, p in enumerate(params):
        if i != absent:
            segments.append((offset, p.numel(), i))
            offset += p.numel() + 5  # 5 padding elements after each fragment
    flat = torch.zeros(offset, requires_grad=True)
    with torch.no_grad():
        for start, n, i in segments:
            flat[start:start + n] = params[i].flatten()
    stable = StableAdamW([{"params": [flat], "weight_decay": 0.1}], lr=0.05, betas=BETAS)
    stable.bind_flat_tensor(flat, segments, len(params))
    naive = StableAdamWReference([{"params": [flat.detach().clone().requires_grad_()], "weight_decay": 0.1}],
                                 lr=0.05, betas=BETAS)

    g = torch.Generator().manual_seed(7)
    for step in range(12):
        for i, p in enumerate(params):  # parameters whose gradients jump at different steps
            p.grad = torch.randn(p.shape, generator=g) * (10.0 if step % 4 == i % 4 else 1.0)
        flat.grad = torch.zeros_like(flat)
        for start, n, i in segments:
            flat.grad[start:start + n] = params[i].grad.flatten()
        naive.param_groups[0]["params"][0].grad = flat.grad.clone()
        for opt in (reference, stable, naive):
            opt.step()

    got = [flat.detach()[start:start + n] for start, n, _ in segments]
    want = [params[i].detach().flatten() for _, _, i in segments]
    assert _max_diff(got, want) <= 1e-6
    covered = torch.zeros(flat.numel(), dtype=torch.bool)
    for start, n, _ in segments:
        covered[start:start + n] = True
    assert torch.count_nonzero(flat.detach()[~covered]) == 0
    naive_got = [naive.param_groups[0]["params"][0].detach()[start:start + n] for start, n, _ in segments]
    assert _max_diff(naive_got, want) > 1e-2


@pytest.mark.lowest
def test_step_refuses_a_tensor_it_was_neither_given_nor_bound():
    stable = StableAdamW(worker.param_groups(worker.build_model()))
    flat = torch.cat([p.detach().flatten() for p in stable.param_groups[0]["params"]]).requires_grad_()
    flat.grad = torch.ones_like(flat)
    stable.param_groups[0]["params"] = [flat]
    with pytest.raises(RuntimeError, match="bind_to_engine.*update clipping would cover whole partitions"):
        stable.step()


# --------------------------------------------------------------------------- the device skip


def _plain(params):
    return StableAdamW([{"params": params[:1], "weight_decay": 0.01}, {"params": params[1:], "weight_decay": 0.0}],
                       lr=1e-2, betas=BETAS)


def _flat(params):
    stable = _plain(params)
    stable.bind_flat_tensor(params[0], [(0, 1500, 0), (1500, 400, 1), (1932, 68, 2)], num_params=3)  # and padding
    return stable


SKIPPING = {"separate tensors": _plain, "a bound flat tensor": _flat}


@pytest.mark.lowest
@pytest.mark.parametrize("name", sorted(SKIPPING))
def test_a_flagged_step_changes_nothing_and_reads_nothing(name):
    assert device_skip.skips_on_device(_plain([torch.nn.Parameter(torch.zeros(3))]))
    seen, end = _run(SKIPPING[name], [None, 1.0, 0.0])
    assert all(torch.equal(a, b) for a, b in zip(seen[1], seen[2])), "the skipped step changed a weight or moment"
    assert not all(torch.equal(a, b) for a, b in zip(seen[2], end)), "the step after it did not step"
    assert all(torch.isfinite(t).all() for t in end)


@pytest.mark.lowest
@pytest.mark.parametrize("name", sorted(SKIPPING))
def test_a_clear_flag_steps_bitwise_as_no_flag_and_reads_nothing(name):
    _, flagged = _run(SKIPPING[name], [0.0, 0.0, 0.0])
    _, plain = _run(SKIPPING[name], [None, None, None])
    assert all(torch.equal(a, b) for a, b in zip(flagged, plain))
    params = _params()
    opt = SKIPPING[name](params)
    for p, grad in zip(params, _grads(0)):
        p.grad = grad
    opt.step()  # the state exists: the next step is an ordinary one
    with _no_host_reads():
        opt.step()  # without a flag too: rms and the clipped rate stay on the device


# --------------------------------------------------------------------------- the builders


@pytest.mark.lowest
def test_the_builder_gives_the_recipe_and_decouples_weight_decay_from_the_peak():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = OptimConfig(name="stable_adamw", lr=8e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=1e-5, decouple_lr=True)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, StableAdamW)
    decayed = [g for g in opt.param_groups if g["weight_decay"] > 0]
    assert [p for g in decayed for p in g["params"]] == [model[0].weight]
    assert decayed[0]["max_lr"] == 8e-4 and decayed[0]["decouple_lr"] and decayed[0]["betas"] == (0.9, 0.98)


@pytest.mark.lowest
@pytest.mark.parametrize("decouple_lr", [False, True])
def test_adamw_decays_as_torch_or_decoupled_from_the_peak(decouple_lr):
    """torch's AdamW takes ``w *= 1 - lr_t * wd``; decoupled, the builder hands it wd / lr, so a
    step at lr_t takes ``w *= 1 - lr_t / lr * wd`` (optimi's decouple_lr), whatever the peak."""
    cfg = OptimConfig(name="adamw", lr=2e-3, weight_decay=1e-3 if decouple_lr else 0.1, decouple_lr=decouple_lr)
    model = torch.nn.Linear(3, 3, bias=False)
    before = model.weight.detach().clone()
    opt = build_optimizer(model, cfg)
    opt.param_groups[0]["lr"] = 5e-4  # a step a quarter of the way up the warm-up
    model.weight.grad = torch.zeros_like(before)  # no Adam step: only the decay moves the weight
    opt.step()
    factor = 1 - (5e-4 / 2e-3 * 1e-3 if decouple_lr else 5e-4 * 0.1)
    torch.testing.assert_close(model.weight.detach(), before * factor, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- DeepSpeed ZeRO, two ranks

RUNS = ["zero1-fp32-stable", "zero2-fp32-stable", "zero1-fp32-stablenaive", "zero0-fp32-stable"]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("stable-zero") / "result.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "tests.bert_ds.lamb_zero_worker", "--out", str(out), "--runs", ",".join(RUNS)]
    proc = run_command(cmd, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"worker on 2 ranks exited {proc.returncode}\n{proc.stderr[-6000:]}")
    return torch.load(out, weights_only=False)


@functools.cache
def _reference():
    return worker.train_single_process("stablenaive", clip=worker.CLIP)


@pytest.mark.distributed
@pytest.mark.parametrize("run_name", ["zero1-fp32-stable", "zero2-fp32-stable", "zero0-fp32-stable"])
def test_zero_stable_adamw_matches_the_single_process_reference(zero_runs, run_name):
    ref_weights, ref_norms = _reference()
    run = zero_runs[run_name]
    assert run["wrapper"] == ("StableAdamW" if run_name.startswith("zero0") else "DeepSpeedZeroOptimizer")
    assert all(run["model_params_stepped"]) if run_name.startswith("zero0") else not any(run["model_params_stepped"])
    if not run_name.startswith("zero0"):  # ZeRO-0 clips inside DeepSpeed's own path and reports no norm
        assert run["grad_norms"] == pytest.approx(ref_norms, rel=1e-5)
    assert _max_diff(run["weights"], ref_weights) <= 1e-5
    assert run["losses"][-1] < run["losses"][0] - 0.3
    # the fragments were spread: some parameter is cut between the ranks (else the test shows nothing)
    entries = [e for rank in zero_runs["zero1-fp32-stable"]["fragments"] for group in rank for e in group]
    assert any(addr is not None and addr[1] < numel for _, _, numel, addr in entries)


@pytest.mark.distributed
def test_one_clipping_per_partition_fails_the_same_comparison(zero_runs):
    naive = zero_runs["zero1-fp32-stablenaive"]
    assert naive["wrapper"] == "DeepSpeedZeroOptimizer" and naive["skipped_steps"] == 0
    assert _max_diff(naive["weights"], _reference()[0]) > 1e-3
