"""bert_ds.train.bf16_copy on two CPU ranks: what it hands DeepSpeed's step, what its copy
computes with, and a checkpoint of DeepSpeed's own bf16 engine resumed on it.

One probe (``torchrun --nproc-per-node 2 -m tests.bert_ds.test_bf16_copy --probe OUT``, gloo)
trains lamb_zero_worker's model (two param groups, parameter sizes that split across ranks
mid-tensor) under ZeRO-1 and ZeRO-2 with LAMB, each rank on its rows of every micro-batch:

- the gradient partition each rank hands the step, against the exact (float64) average over
  both ranks of the micro-batch gradients of the copy's bf16 weights on the same rows;
- after each update, the copy's weights against the engine's fp32 weights rounded to bf16
  (they must be those, bit for bit), its parameters still views of the flat tensors;
- a checkpoint saved by DeepSpeed's own bf16 engine (``BF16_Optimizer``, the shipped ZeRO-1
  config's engine before bert-ds ran bf16 itself), loaded into the fp32 engine of the copy:
  the same fp32 weights and optimizer state, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import cli_env, run_command

STEPS = 3


def _config(stage: int, world: int, copy: bool) -> dict:
    """The worker's bf16 config with fp32 sums, the step owning the gradients (as
    bert_ds.config.deepspeed_config makes it) or DeepSpeed checking them (its BF16_Optimizer)."""
    from tests.bert_ds import lamb_zero_worker as worker

    config = worker.ds_config(stage, "bf16acc32", world)
    config["gradient_clipping"] = 0.0 if copy else worker.CLIP
    if copy:
        config["zero_optimization"]["compute_grad_norm"] = False
        config["bf16"]["check_grad_overflow"] = False
    return config


def _build(config: dict):
    from bert_ds import zero
    from bert_ds.config import engine_json, runs_bf16_copy
    from bert_ds.optim.builders import bind_to_engine
    from bert_ds.optim.lamb import Lamb
    from bert_ds.train.bf16_copy import Bf16Copy
    from tests.bert_ds import lamb_zero_worker as worker

    model = worker.build_model()
    client = Lamb(worker.param_groups(model), lr=worker.LR)
    engine, *_ = zero.initialize(model=model, optimizer=client, config=engine_json(config),
                                 lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s))
    bind_to_engine(client, engine)
    copy = Bf16Copy(engine, worker.build_model, worker.GAS) if runs_bf16_copy(config) else None
    return engine, client, copy


def _rows(rank: int, world: int) -> slice:
    from tests.bert_ds import lamb_zero_worker as worker

    m = worker.MICRO_ALL // world
    return slice(rank * m, (rank + 1) * m)


def _train(stage: int, rank: int, world: int) -> dict:
    """STEPS steps on the copy; per step the handed partitions' error and whether the weights match."""
    from bert_ds import zero
    from tests.bert_ds import lamb_zero_worker as worker

    engine, client, copy = _build(_config(stage, world, copy=True))
    x, y = worker.batches()
    errors, rounded, views = [], [], []
    for step in range(STEPS):
        reference = [torch.zeros(p.numel(), dtype=torch.float64) for p in copy.model.parameters()]
        for k in range(worker.GAS):
            rows = _rows(rank, world)
            copy.backward(F.cross_entropy(copy(x[step, k, rows].to(torch.bfloat16)).float(), y[step, k, rows]))
            for r in range(world):  # every rank's micro-batch gradient, as the average counts it
                mine = _rows(r, world)
                loss = F.cross_entropy(copy.model(x[step, k, mine].to(torch.bfloat16)).float(), y[step, k, mine])
                grads = torch.autograd.grad(loss / worker.GAS, list(copy.model.parameters()))
                for total, g in zip(reference, grads):
                    total += g.double().view(-1) / world
            if k < worker.GAS - 1:
                engine.step()
        copy.reduce_gradients()
        handed = zero.partition_gradients(engine)
        errors.append(_partition_error(engine, copy, reference, handed))
        engine.step()
        copy.refresh_weights()
        rounded.append(all(torch.equal(p, zero.full_fp32_param(m).to(torch.bfloat16))
                           for p, m in zip(copy.model.parameters(), engine.module.parameters())))
        views.append(all(any(w.data_ptr() <= p.data_ptr() < w.data_ptr() + 2 * w.numel() for w in copy.weights)
                         for p in copy.model.parameters()))
    return {"errors": errors, "rounded": rounded, "views": views, "wrapper": type(engine.optimizer).__name__,
            "client_groups": len(client.param_groups)}


def _partition_error(engine, copy, reference: list[torch.Tensor], handed: list[torch.Tensor]) -> float:
    """The handed partitions against the elements of the exact average that this rank's flat fp32
    partition holds (the rank-th of equal parts, as DeepSpeed's partition sizes say; relative)."""
    import torch.distributed as dist

    from bert_ds import zero

    worst = 0.0
    names = {id(p): n for n, p in engine.module.named_parameters()}
    order = {n: i for i, n in enumerate(dict(copy.model.named_parameters()))}
    for group, part, grad in zip(zero.flat_groups(engine), zero.flat_partitions(engine), handed):
        exact = torch.zeros(group.flat.numel(), dtype=torch.float64)
        for master in group.params:
            offset = (master.data_ptr() - group.flat.data_ptr()) // master.element_size()
            exact[offset:offset + master.numel()] = reference[order[names[id(master)]]]
        size, rank = part.flat.numel(), dist.get_rank(group=part.group)
        exact = exact[rank * size:(rank + 1) * size]
        worst = max(worst, float((grad.double() - exact).norm() / exact.norm().clamp_min(1e-30)))
    return worst


def _resume_across_engines(stage: int, rank: int, world: int, folder: Path) -> dict:
    """A checkpoint of DeepSpeed's own bf16 engine loaded into the fp32 engine of the copy."""
    import torch.distributed as dist

    from bert_ds import zero
    from bert_ds.checkpoint import store
    from tests.bert_ds import lamb_zero_worker as worker

    theirs, _, none = _build(_config(stage, world, copy=False))
    assert none is None
    x, y = worker.batches()
    for k in range(worker.GAS):
        rows = _rows(rank, world)
        theirs.backward(F.cross_entropy(theirs(x[0, k, rows].to(torch.bfloat16)).float(), y[0, k, rows]))
        theirs.step()
    snapshot = store.optimizer_snapshot(theirs)
    saved = store.save(theirs, folder, 1, rank=rank, model_config={}, train_config={},
                       train_state={"step": 1, "world_size": world}, tokenizer_dir=None, keep_last=1,
                       optimizer=snapshot)
    ours, _, copy = _build(_config(stage, world, copy=True))
    store.load(ours, saved, rank=rank, world_size=world)
    copy.refresh_weights()
    after = store.optimizer_snapshot(ours)
    weights = all(torch.equal(zero.full_fp32_param(a), zero.full_fp32_param(b))
                  for a, b in zip(theirs.module.parameters(), ours.module.parameters()))
    state = (sorted(after.tensors) == sorted(snapshot.tensors)
             and all(torch.equal(after.tensors[k], snapshot.tensors[k]) for k in snapshot.tensors))
    copied = all(torch.equal(p, zero.full_fp32_param(m).to(torch.bfloat16))
                 for p, m in zip(copy.model.parameters(), ours.module.parameters()))
    dist.barrier()
    return {"theirs": type(theirs.optimizer).__name__, "ours": type(ours.optimizer).__name__,
            "weights": weights, "state": state, "copied": copied,
            "scheduler": ours.lr_scheduler.state_dict() == theirs.lr_scheduler.state_dict()}


def _probe(out: Path) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {f"zero{stage}": _train(stage, rank, world) for stage in (1, 2)}
    results["resume"] = _resume_across_engines(1, rank, world, out.parent / "checkpoints")
    (out.parent / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    if rank == 0:
        out.write_text(json.dumps([json.loads((out.parent / f"rank{r}.json").read_text()) for r in range(world)]))


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("bf16_copy") / "results.json"
    proc = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "-m", "tests.bert_ds.test_bf16_copy", "--probe", str(out)], timeout=600, env=cli_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = json.loads(out.read_text())
    for rank, result in enumerate(ranks):
        for stage in ("zero1", "zero2"):
            print(f"\nrank {rank} {stage}: handed gradient vs exact average, relative error per step "
                  f"{', '.join(f'{e:.2e}' for e in result[stage]['errors'])}")
    return ranks


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_each_rank_hands_the_step_the_average_of_every_ranks_fp32_sums(probed, stage):
    for result in probed:
        run = result[stage]
        assert run["wrapper"] == "DeepSpeedZeroOptimizer" and run["client_groups"] == 2
        # bf16 micro-batch gradients summed in fp32: the roundings of the sum and of the average
        assert max(run["errors"]) < 1e-5, run["errors"]


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_the_copy_computes_with_the_updated_fp32_weights_rounded(probed, stage):
    for result in probed:
        assert all(result[stage]["rounded"]) and all(result[stage]["views"]), result[stage]


def test_a_checkpoint_of_deepspeeds_bf16_engine_resumes_on_the_copy(probed):
    for result in probed:
        resume = result["resume"]
        assert resume["theirs"] == "BF16_Optimizer" and resume["ours"] == "DeepSpeedZeroOptimizer"
        assert resume["weights"] and resume["state"] and resume["copied"] and resume["scheduler"], resume


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--probe", type=Path, required=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _probe(parser.parse_args().probe)
