"""LAMB: both variants (NVIDIA's BERT LAMB, the default, and the paper's) against a float64
from-the-formula reference, the foreach implementation against the textbook one, and
per-parameter trust ratios under DeepSpeed ZeRO-1/2 on 1, 2 and 3 CPU ranks against one process.

The distributed tests launch ``tests/bert_ds/lamb_zero_worker.py`` once per world size
(all runs of that size in one launch) and compare its final fp32 weights with
:class:`LambReference` trained in this process on the concatenated global batches, with
DeepSpeed's clipping rule. Every world size trains on the same data, so one reference
serves all of them.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.nn.functional as F

from bert_ds.optim.fragments import flat_layout
from bert_ds.optim.lamb import Lamb, LambReference, lamb_reference_step
from tests.bert_ds import lamb_zero_worker as worker
from tests.conftest import run_command

FP32_RUNS = [f"zero{stage}-fp32-{kind}" for stage in (1, 2) for kind in ("lamb", "naive", "lamb-paper")]
# bf16 runs use the paper's variant, which puts a trust ratio on every parameter: the
# per-parameter ratios on DeepSpeed's bf16 paths are what they check.
BF16_RUNS = ["zero1-bf16-lamb-paper", "zero2-bf16-lamb-paper", "zero1-bf16acc32-lamb-paper"]
# World sizes of the ZeRO runs; 1 and 2 also run under the lowest supported torch (run.sh test-lowest)
WORLDS = [pytest.param(1, marks=pytest.mark.lowest), pytest.param(2, marks=pytest.mark.lowest), 3]
RUNS = {1: FP32_RUNS + ["zero0-fp32-lamb"], 2: FP32_RUNS + BF16_RUNS + ["zero1-fp32-naive-paper"], 3: FP32_RUNS}


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@functools.cache
def _reference(skip: tuple[int, ...] = (), variant: str = "nvidia"):
    return worker.train_single_process("naive", clip=worker.CLIP, skip=skip, variant=variant)


def _lamb_from_the_formula(w0: list[torch.Tensor], grads: list[list[torch.Tensor]], decays: list[float], *,
                           lr: float, betas: tuple[float, float], eps: float, adapt_all: bool) -> list[torch.Tensor]:
    """LAMB written out from its definition in float64, one tensor and one step at a time.

    Independent of bert_ds.optim.lamb: the paper's update (You et al., 2019, Algorithm 2, with
    Adam's bias correction and decoupled weight decay); NVIDIA's BERT LAMB drops the trust
    ratio where the weight decay is 0 (apex FusedLAMB, use_nvlamb=False).
    """
    b1, b2 = betas
    out = []
    for w, wd, gs in zip(w0, decays, zip(*grads), strict=True):
        w = w.double().clone()
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        for t, g in enumerate(gs, start=1):
            g = g.double()
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + wd * w
            w_norm, u_norm = w.norm().item(), u.norm().item()
            ratio = w_norm / u_norm if (adapt_all or wd != 0) and w_norm > 0 and u_norm > 0 else 1.0
            w = w - lr * ratio * u
        out.append(w)
    return out


# --------------------------------------------------------------------------- one process


@pytest.mark.lowest
@pytest.mark.parametrize("variant", ["nvidia", "paper"])
@pytest.mark.parametrize("opt_cls", [Lamb, LambReference])
def test_lamb_variants_match_the_float64_formula_over_many_steps(opt_cls, variant):
    """200 steps of seeded gradients on tensors shaped like BERT's: a matrix and a bias that
    decay, a bias and a LayerNorm weight (at 0 and at 1) that do not."""
    g = torch.Generator().manual_seed(3)
    w0 = [torch.randn(13, 7, generator=g) * 0.2, torch.randn(7, generator=g) * 0.1, torch.zeros(7), torch.ones(7)]
    decays = [0.01, 0.01, 0.0, 0.0]
    grads = [[torch.randn(w.shape, generator=g) * (1 + i % 5) for w in w0] for i in range(200)]
    params = [w.clone().requires_grad_() for w in w0]
    opt = opt_cls([{"params": [p], "weight_decay": wd} for p, wd in zip(params, decays)],
                  lr=0.01, betas=(0.9, 0.999), eps=1e-6, variant=variant)
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        opt.step()
    want = _lamb_from_the_formula(w0, grads, decays, lr=0.01, betas=(0.9, 0.999), eps=1e-6,
                                  adapt_all=variant == "paper")
    for p, w, start in zip(params, want, w0):
        assert (p.detach().double() - w).abs().max().item() <= 1e-5 * max(1.0, w.abs().max().item())
        assert (w - start.double()).abs().max().item() > 1e-3  # every tensor moved far beyond the tolerance
    other = _lamb_from_the_formula(w0, grads, decays, lr=0.01, betas=(0.9, 0.999), eps=1e-6,
                                   adapt_all=variant != "paper")
    # The variants differ exactly on the tensors without weight decay, and by far more than the tolerance.
    assert max((p.detach().double() - w).abs().max().item() for p, w in zip(params[2:], other[2:])) > 1e-2


@pytest.mark.lowest
def test_the_default_variant_is_nvidias_and_leaves_biases_trainable():
    """Under the paper's rule a bias that starts at 0 hardly moves after its first step
    (its ratio ||w|| / ||u|| is about lr); NVIDIA's rule gives it plain Adam steps."""
    assert Lamb([torch.zeros(1, requires_grad=True)]).variant == "nvidia"
    moved = {}
    for variant in ("nvidia", "paper"):
        bias = torch.zeros(64, requires_grad=True)
        opt = Lamb([{"params": [bias], "weight_decay": 0.0}], lr=0.01, variant=variant)
        g = torch.Generator().manual_seed(0)
        for _ in range(50):
            bias.grad = torch.randn(64, generator=g) + 1.0
            opt.step()
        moved[variant] = bias.detach().abs().mean().item()
    assert moved["nvidia"] > 10 * moved["paper"], moved


@pytest.mark.lowest
def test_an_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="variant"):
        Lamb([torch.zeros(1, requires_grad=True)], variant="nvlamb")


@pytest.mark.lowest
def test_foreach_lamb_matches_reference_over_20_steps_with_decay_groups():
    initial = [p.detach().clone() for p in worker.build_model().parameters()]
    fast, _ = worker.train_single_process("lamb")
    ref, _ = worker.train_single_process("naive")
    assert _max_diff(fast, ref) <= 1e-6
    # The comparison means something only if LAMB moved every tensor well beyond 1e-6.
    assert min((a - b).abs().max().item() for a, b in zip(ref, initial)) > 1e-2


@pytest.mark.lowest
def test_weight_decay_applies_only_where_the_group_sets_it():
    w = torch.randn(5, 3)
    grad = torch.randn(5, 3)
    runs = {}
    for wd in (0.0, 0.5):
        p = w.clone().requires_grad_()
        p.grad = grad.clone()
        opt = Lamb([{"params": [p], "weight_decay": wd}], lr=0.1)
        opt.step()
        expected = w.clone()
        lamb_reference_step(expected, grad, torch.zeros_like(w), torch.zeros_like(w), 1,
                            lr=0.1, betas=(0.9, 0.999), eps=1e-6, weight_decay=wd)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
        runs[wd] = p.detach()
    assert (runs[0.0] - runs[0.5]).abs().max() > 1e-3


@pytest.mark.lowest
def test_trust_ratio_is_one_when_a_norm_is_zero():
    zero_w = torch.zeros(4, requires_grad=True)  # ||w|| = 0: the step is lr * update
    zero_w.grad = torch.tensor([1.0, -2.0, 3.0, 0.5])
    zero_u = torch.full((3,), 2.0, requires_grad=True)  # ||update|| = 0: nothing moves, no NaN
    zero_u.grad = torch.zeros(3)
    Lamb([{"params": [zero_w, zero_u], "weight_decay": 0.0}], lr=0.1, variant="paper").step()
    # Adam's first step is sign(g) * |g| / (|g| + eps).
    expected = -0.1 * zero_w.grad / (zero_w.grad.abs() + 1e-6)
    torch.testing.assert_close(zero_w.detach(), expected, rtol=0, atol=1e-7)
    assert torch.equal(zero_u.detach(), torch.full((3,), 2.0))


@pytest.mark.lowest
def test_bound_flat_tensor_gets_per_parameter_ratios_and_leaves_padding_alone():
    """A flat tensor with padding gaps and a parameter that has no fragment in it, as a
    ZeRO partition looks, steps exactly like the parameters themselves."""
    model = worker.build_model()
    params = list(model.parameters())
    reference = LambReference([{"params": params, "weight_decay": 0.1}], lr=0.05)
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
    lamb = Lamb([{"params": [flat], "weight_decay": 0.1}], lr=0.05)
    lamb.bind_flat_tensor(flat, segments, len(params))
    naive = LambReference([{"params": [flat.detach().clone().requires_grad_()], "weight_decay": 0.1}], lr=0.05)

    g = torch.Generator().manual_seed(7)
    for _ in range(10):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        flat.grad = torch.zeros_like(flat)
        for start, n, i in segments:
            flat.grad[start:start + n] = params[i].grad.flatten()
        naive.param_groups[0]["params"][0].grad = flat.grad.clone()
        for opt in (reference, lamb, naive):
            opt.step()

    got = [flat.detach()[start:start + n] for start, n, _ in segments]
    want = [params[i].detach().flatten() for _, _, i in segments]
    assert _max_diff(got, want) <= 1e-6
    covered = torch.zeros(flat.numel(), dtype=torch.bool)
    for start, n, _ in segments:
        covered[start:start + n] = True
    assert torch.count_nonzero(flat.detach()[~covered]) == 0
    naive_got = [naive.param_groups[0]["params"][0].detach()[start:start + n] for start, n, _ in segments]
    assert _max_diff(naive_got, want) > 1e-2  # one ratio for the whole flat tensor is a different optimizer


@pytest.mark.lowest
def test_segment_norms_are_exact_across_chunk_boundaries_and_large_fragments():
    sizes = [1, 1023, 1024, 1025, 3_000_001]  # around the 1024-element chunk, and one a single fp32 sum gets wrong
    segments, offset = [], 2
    for i, n in enumerate(sizes):
        segments.append((offset, n, i))
        offset += n + 1
    x = torch.randn(offset, generator=torch.Generator().manual_seed(3)) * 0.02
    layout = flat_layout(x, segments, len(sizes), None)
    chunk_squares = layout.chunks.sums(x.square())
    got = layout.slot_sums(torch.stack([chunk_squares, 4 * chunk_squares], dim=1))
    want = [x[s:s + n].double().square().sum() for s, n, _ in segments]
    gaps = x.double().square().sum() - sum(want)
    torch.testing.assert_close(got[0], torch.stack(want + [gaps]), rtol=1e-6, atol=0)
    torch.testing.assert_close(got[1], 4 * got[0], rtol=0, atol=0)
    assert torch.all(layout.chunks.lengths <= 1024)
    expanded = layout.chunks.expand(layout.chunk_slots)
    for s, n, i in segments:
        assert torch.all(expanded[s:s + n] == i)
    assert expanded[0] == expanded[1] == len(sizes)  # the leading gap is padding


@pytest.mark.lowest
def test_bind_flat_tensor_rejects_overlapping_segments():
    flat = torch.zeros(10, requires_grad=True)
    lamb = Lamb([flat])
    with pytest.raises(ValueError, match="overlaps"):
        lamb.bind_flat_tensor(flat, [(0, 6, 0), (5, 3, 1)], 2)


@pytest.mark.lowest
def test_step_refuses_a_tensor_it_was_neither_given_nor_bound():
    """What DeepSpeed ZeRO does to the param groups; without a bind it is an error."""
    model = worker.build_model()
    lamb = Lamb(worker.param_groups(model))
    flat = torch.cat([p.detach().flatten() for p in lamb.param_groups[0]["params"]]).requires_grad_()
    flat.grad = torch.ones_like(flat)
    lamb.param_groups[0]["params"] = [flat]
    with pytest.raises(RuntimeError, match="bind_to_engine"):
        lamb.step()


# --------------------------------------------------------------------------- DeepSpeed ZeRO, several ranks


def _launch(world: int, runs: list[str], out_dir) -> dict:
    out = out_dir / "result.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "tests.bert_ds.lamb_zero_worker", "--out", str(out), "--runs", ",".join(runs)]
    proc = run_command(cmd, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"worker on {world} ranks exited {proc.returncode}\n{proc.stderr[-6000:]}")
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """world size -> {run name: result}; each world size is launched once."""
    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            cache[world] = _launch(world, RUNS[world], tmp_path_factory.mktemp(f"lamb-zero-{world}"))
        return cache[world]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("variant", ["nvidia", "paper"])
def test_zero_lamb_matches_single_process_reference(zero_runs, world, stage, variant):
    ref_weights, ref_norms = _reference(variant=variant)
    run = zero_runs(world)[f"zero{stage}-fp32-lamb" + ("-paper" if variant == "paper" else "")]
    # Same global gradient before clipping: sharding, accumulation and loss scaling agree.
    assert run["grad_norms"] == pytest.approx(ref_norms, rel=1e-5)
    assert any(n > worker.CLIP for n in ref_norms) and any(n < worker.CLIP for n in ref_norms)
    assert _max_diff(run["weights"], ref_weights) <= 1e-5
    assert run["losses"][-1] < run["losses"][0] - 0.3


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_naive_lamb_with_one_ratio_per_partition_fails_the_same_comparison(zero_runs, world, stage):
    ref_weights, _ = _reference()
    naive = zero_runs(world)[f"zero{stage}-fp32-naive"]
    assert naive["wrapper"] == "DeepSpeedZeroOptimizer" and naive["skipped_steps"] == 0
    assert _max_diff(naive["weights"], ref_weights) > 1e-2


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
def test_deepspeed_steps_the_client_optimizer_on_flat_partitions(zero_runs, world):
    for stage in (1, 2):
        run = zero_runs(world)[f"zero{stage}-fp32-lamb"]
        assert run["wrapper"] == "DeepSpeedZeroOptimizer" and run["client_is_stepped"]
        # Each param group holds only this rank's flat fp32 partition, no model parameter.
        assert run["groups_hold_partitions"] == [True, True]
        assert not any(run["model_params_stepped"])
        # DeepSpeed calls step() once per param group, showing the optimizer one group at a time.
        assert run["step_calls"] == [1] * (2 * worker.STEPS)
        assert run["opt_steps"] == [worker.STEPS] * 2


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS[1:])
def test_partitions_cut_parameters_and_miss_some_entirely(zero_runs, world):
    fragments = zero_runs(world)["zero1-fp32-lamb"]["fragments"]  # [rank][group][param]
    entries = [e for rank in fragments for group in rank for e in group]
    assert any(addr is not None and addr[1] < numel for _, _, numel, addr in entries)  # part of a parameter
    assert any(addr is None for _, _, _, addr in entries)  # a rank without a parameter
    # Per parameter, the fragments over all ranks add up to the whole parameter.
    total: dict[tuple[int, int], int] = {}
    for gi, pi, numel, addr in entries:
        total[gi, pi] = total.get((gi, pi), 0) + (addr[1] if addr else 0)
        assert total[gi, pi] <= numel
    assert all(total[gi, pi] == numel for gi, pi, numel, _ in entries)


@pytest.mark.lowest
@pytest.mark.distributed
def test_zero0_fp32_steps_model_parameters_with_nothing_to_bind(zero_runs):
    run = zero_runs(1)["zero0-fp32-lamb"]
    assert run["wrapper"] == "Lamb" and all(run["model_params_stepped"])
    assert _max_diff(run["weights"], _reference()[0]) <= 1e-5


@pytest.mark.lowest
@pytest.mark.distributed
@pytest.mark.parametrize("run_name", BF16_RUNS)
def test_bf16_trains_skips_the_overflow_step_and_tracks_the_reference(zero_runs, run_name):
    runs = zero_runs(2)
    run = runs[run_name]
    assert run["wrapper"] == ("BF16_Optimizer" if "acc32" in run_name else "DeepSpeedZeroOptimizer")
    # The inf at OVERFLOW_STEP made DeepSpeed skip that step without calling step().
    assert run["skipped_steps"] == 1
    assert run["opt_steps"] == [worker.STEPS - 1] * 2
    # ZeRO-1/2 step one group per call; the bf16 optimizer (fp32 accumulation) both at once.
    applied = worker.STEPS - 1
    assert run["step_calls"] == ([2] * applied if "acc32" in run_name else [1] * (2 * applied))
    assert all(torch.isfinite(w).all() for w in run["weights"])
    assert sum(run["losses"][-3:]) / 3 < sum(run["losses"][:3]) / 3 - 0.2
    ref_weights, _ = _reference(skip=(worker.OVERFLOW_STEP,), variant="paper")
    diff = _max_diff(run["weights"], ref_weights)
    naive = _max_diff(runs["zero1-fp32-naive-paper"]["weights"], _reference(variant="paper")[0])
    assert diff <= 2e-2 and diff < naive / 10, (diff, naive)


@pytest.mark.lowest
def test_flat_lamb_steps_the_model_as_per_tensor_lamb_does():
    """FlatLamb (one flat tensor per group, the parameters views of it) follows Lamb over the
    separate tensors: the same per-parameter ratios, norms summed per chunk instead of at once.
    The model keeps its parameters (names, shapes, storage shared with the flat tensor)."""
    from bert_ds.optim.flat import FlatLamb

    torch.manual_seed(0)
    weights = {}
    for opt_cls in (Lamb, FlatLamb):
        model = worker.build_model()
        shapes = {name: p.shape for name, p in model.named_parameters()}
        opt = opt_cls(worker.param_groups(model), lr=worker.LR, betas=worker.BETAS, eps=worker.EPS)
        x, y = worker.batches()
        for s in range(5):
            F.cross_entropy(model(x[s].reshape(-1, worker.IN)), y[s].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert {name: p.shape for name, p in model.named_parameters()} == shapes
        weights[opt_cls.__name__] = [p.detach().clone() for p in model.parameters()]
        if opt_cls is FlatLamb:
            flat = opt.param_groups[0]["params"][0]
            first = next(p for p in model.parameters() if p.ndim >= 2)
            assert first.data_ptr() == flat.data_ptr()  # a view: the flat update moves the model
    assert _max_diff(weights["FlatLamb"], weights["Lamb"]) <= 1e-6
    assert _max_diff(weights["FlatLamb"], [p.detach() for p in worker.build_model().parameters()]) > 1e-4
