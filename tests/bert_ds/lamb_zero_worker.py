"""Train a small model with LAMB or StableAdamW under DeepSpeed ZeRO on CPU ranks; used by
test_lamb.py and test_stable_adamw.py.

Run under torchrun (every rank)::

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m tests.bert_ds.lamb_zero_worker --out RESULT.pt --runs zero1-fp32-lamb,zero2-fp32-naive,...

A run name is ``zero{stage}-{precision}-{optimizer}[-{variant}]``: precision ``fp32`` (no bf16/fp16
section, so results compare exactly), ``bf16``, or ``bf16acc32`` (bf16 with fp32 gradient
accumulation: DeepSpeed's BF16_Optimizer at stage 1); optimizer ``lamb`` (bert_ds.optim.lamb.Lamb,
bound after initialize) or ``naive`` (LambReference: one trust ratio per flat partition),
``stable`` (bert_ds.optim.stable_adamw.StableAdamW, bound) or ``stablenaive``
(StableAdamWReference: one update clipping per flat partition); LAMB's variant ``nvidia`` (the
default) or ``paper`` (see bert_ds/optim/lamb.py).
bf16 runs get a non-finite input on one rank at ``OVERFLOW_STEP`` so DeepSpeed's
overflow check skips that step. All runs of one launch share one process start-up.

The model, data and recipe are defined here once and imported by the tests, which train the
single-process reference on the concatenated global batches (:func:`train_single_process`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 20
GAS = 2            # micro-steps per optimizer step
MICRO_ALL = 12     # samples per micro-step over all ranks: every world size (1, 2, 3) trains on the same data
IN, HIDDEN, OUT = 11, 29, 7  # parameter sizes 319, 29, 29, 29, 203, 7: none divides by 2 or 3
LR, BETAS, EPS, WEIGHT_DECAY = 0.02, (0.9, 0.999), 1e-6, 0.1
CLIP = 1.5         # the global-batch gradient norms run 1.3-1.8: some steps are clipped, some not
OVERFLOW_STEP = 7  # bf16 runs: one rank sees inf here and the whole step is skipped
# StableAdamW's, ModernBERT's: its update clipping acts on about a third of this model's
# parameter-steps (rms up to 1.4), so one clipping per partition would show
STABLE_BETAS = (0.9, 0.98)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, OUT))


def param_groups(model: nn.Module) -> list[dict]:
    """Matrices decay; biases and LayerNorm do not (as bert_ds.optim.builders does)."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def make_optimizer(kind: str, groups: list[dict], variant: str = "nvidia") -> torch.optim.Optimizer:
    """The optimizer a run name's ``kind`` names (module docstring), with the recipe's settings."""
    from bert_ds.optim.lamb import Lamb, LambReference
    from bert_ds.optim.stable_adamw import StableAdamW, StableAdamWReference

    if kind in ("lamb", "naive"):
        return {"lamb": Lamb, "naive": LambReference}[kind](groups, lr=LR, betas=BETAS, eps=EPS, variant=variant)
    return {"stable": StableAdamW, "stablenaive": StableAdamWReference}[kind](groups, lr=LR, betas=STABLE_BETAS,
                                                                              eps=EPS)


def train_single_process(kind: str, steps: int = STEPS, clip: float | None = None, skip: tuple[int, ...] = (),
                         variant: str = "nvidia") -> tuple[list[torch.Tensor], list[float]]:
    """The model and recipe in one process on the global batches, with DeepSpeed ZeRO's clipping
    rule where ``clip`` is given; returns (weights, gradient norms before clipping)."""
    model = build_model()
    opt = make_optimizer(kind, param_groups(model), variant)
    x, y = batches()
    norms = []
    for s in range(steps):
        if s in skip:  # DeepSpeed skipped this step: no update, its batch is gone
            continue
        opt.zero_grad()
        F.cross_entropy(model(x[s].reshape(-1, IN)), y[s].reshape(-1)).backward()
        norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters()))
        norms.append(norm.item())
        if clip is not None:
            # DeepSpeed ZeRO's rule: divide by (norm + 1e-6) / clip when that exceeds 1.
            factor = (norm + 1e-6) / clip
            if factor > 1:
                for p in model.parameters():
                    p.grad.mul_(1.0 / factor)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], norms


def batches() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (STEPS, GAS, MICRO_ALL, IN) and labels (STEPS, GAS, MICRO_ALL).

    Rank r of W at micro-step k of step s trains on rows ``[s, k, r*m:(r+1)*m]``,
    m = MICRO_ALL // W; the reference on all of ``[s]``. Labels come from a fixed random
    teacher, so the loss can fall.
    """
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS, GAS, MICRO_ALL, IN, generator=g)
    teacher = torch.randn(IN, OUT, generator=g)
    return x, (x @ teacher).argmax(-1)


def ds_config(stage: int, precision: str, world: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_ALL // world,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        # The project's ds_configs settings, with buckets small enough to split this model.
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 200, "allgather_bucket_size": 200},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if precision in ("bf16", "bf16acc32"):
        cfg["bf16"] = {"enabled": True}
        cfg["communication_data_type"] = "fp32"
    if precision == "bf16acc32":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def train(name: str, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    from bert_ds import zero
    from bert_ds.optim.builders import bind_to_engine

    stage_name, precision, kind, *rest = name.split("-")
    variant = rest[0] if rest else "nvidia"
    stage = int(stage_name.removeprefix("zero"))
    model = build_model()
    optimizer = make_optimizer(kind, param_groups(model), variant)
    step_calls: list[int] = []  # groups present in each optimizer.step() call DeepSpeed makes
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: step_calls.append(len(opt.param_groups)))
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer,
                                           config=ds_config(stage, precision, world))
    wrapper = engine.optimizer
    if kind in ("lamb", "stable"):
        bound = bind_to_engine(optimizer, engine)
        assert bound == (len(optimizer.param_groups) if stage > 0 else 0), bound
    stepped = [list(g["params"]) for g in optimizer.param_groups]  # what DeepSpeed left in the groups
    partitions = zero.flat_partitions(engine)  # [] under ZeRO-0
    fragments = [_fragments(gi, part) for gi, part in enumerate(partitions)]

    x_all, y_all = batches()
    if precision != "fp32":
        x_all[OVERFLOW_STEP, 0, -1, 0] = float("inf")  # a row of the last rank
    micro = MICRO_ALL // world
    mine = slice(rank * micro, (rank + 1) * micro)
    dtype = next(engine.module.parameters()).dtype
    losses, grad_norms = [], []
    for s in range(STEPS):
        step_loss = 0.0
        for k in range(GAS):
            loss = F.cross_entropy(engine(x_all[s, k, mine].to(dtype)).float(), y_all[s, k, mine])
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / GAS
        losses.append(step_loss)
        norm = engine.get_global_grad_norm()  # None without ZeRO: DeepSpeed clips inside its own path
        grad_norms.append(None if norm is None else float(norm))

    # ZeRO keeps the fp32 master apart from the (maybe bf16) module; ZeRO-0 fp32 steps the module.
    weights = [(p if stage == 0 else safe_get_full_fp32_param(p)).detach().clone() for p in engine.module.parameters()]
    all_fragments = [None] * world
    dist.all_gather_object(all_fragments, fragments)
    result = {
        "weights": weights,
        "losses": losses,
        "grad_norms": grad_norms,
        "skipped_steps": engine.skipped_steps,
        "step_calls": step_calls,
        "wrapper": type(wrapper).__name__,
        "client_is_stepped": zero.client_optimizer(engine) is optimizer,
        "groups_hold_partitions": [len(g) == 1 and g[0] is part.flat for g, part in zip(stepped, partitions)],
        "model_params_stepped": [any(p is q for q in model.parameters()) for g in stepped for p in g],
        "opt_steps": [optimizer.state[p]["step"] for g in stepped for p in g],
        "fragments": all_fragments,
    }
    engine.destroy()
    return result


def _fragments(gi: int, part) -> list[tuple[int, int, int, tuple[int, int] | None]]:
    """(group, parameter, its numel, (offset, numel) of this rank's fragment or None) for each
    parameter of a flat partition, as bert_ds.zero reads them from DeepSpeed."""
    held = {index: (start, numel) for start, numel, index in part.segments}
    return [(gi, pi, p.numel(), held.get(pi)) for pi, p in enumerate(part.params)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", required=True, help="comma-separated run names")
    args = parser.parse_args()

    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        results = {name: train(name, rank, world) for name in args.runs.split(",")}
        if rank == 0:
            torch.save(results, args.out)
    finally:
        dist.destroy_process_group()
    # Skip interpreter finalization: DeepSpeed keeps its gloo groups alive, and a gloo worker
    # thread that drops the last reference to a finished collective's tensor while Python
    # finalizes is killed inside C++ and aborts the rank (std::terminate, seen ~1 launch in 20).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
