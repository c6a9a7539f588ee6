"""bf16 runs accumulate gradients across micro-batches in fp32 (the shipped ZeRO configs).

BERT's recipe sums 16 micro-batches per optimizer step on 8 GPUs (and 64 on one). With the
model in bf16, DeepSpeed accumulates each micro-batch's gradient into a bf16 buffer unless
``data_types.grad_accum_dtype`` says fp32: every add then rounds the running sum to 8 bits
of mantissa, an error that grows with the number of micro-batches and is largest for the
small gradient components.

One probe process (``python -m tests.bert_ds.test_grad_accumulation --probe OUT``, one CPU
rank, gloo) builds an engine from each shipped bf16 ZeRO-1/2 config as it is and from the
same config without ``data_types`` (bf16 accumulation, what these configs held before),
runs one optimizer step of 16 micro-batches, and takes the gradient DeepSpeed hands the
optimizer. The reference is the exact (float64) sum of the same micro-batch gradients,
computed by a bf16 copy of the model on the same inputs: the micro-batch gradients are the
same bits, only the accumulation differs. The test prints the relative errors it measured.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, cli_env, run_command

MICRO_BATCHES = 16  # BERT's recipe on 8 GPUs: global batch 65,536 = 512 x 16 x 8
ROWS, IN, HIDDEN, OUT = 32, 64, 512, 64
CONFIGS = ("zero1_bf16.json", "zero2_bf16.json")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.LayerNorm(HIDDEN),
                               torch.nn.Linear(HIDDEN, OUT))


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(MICRO_BATCHES, ROWS, IN, generator=g)
    return x, torch.randint(0, OUT, (MICRO_BATCHES, ROWS), generator=g)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y)


def _engine_config(name: str, accumulate_in_bf16: bool) -> dict:
    from bert_ds.config import resolve_ds_config_path

    config = json.loads(resolve_ds_config_path(name).read_text())
    if accumulate_in_bf16:
        config.pop("data_types", None)
    config.update(train_micro_batch_size_per_gpu=ROWS, gradient_accumulation_steps=MICRO_BATCHES,
                  gradient_clipping=0.0, zero_allow_untested_optimizer=True, steps_per_print=10**9)
    return config


def _measure(name: str, accumulate_in_bf16: bool) -> dict:
    """One step of MICRO_BATCHES micro-batches: the relative error of the gradient the optimizer
    receives against the float64 sum of the micro-batch gradients, and DeepSpeed's wrapper."""

    from bert_ds import zero

    model = _model()
    client = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = zero.initialize(model=model, optimizer=client, config=_engine_config(name, accumulate_in_bf16))
    reference_model = copy.deepcopy(engine.module)  # the same bf16 weights
    handed: list[torch.Tensor] = []
    client.register_step_pre_hook(lambda opt, args, kwargs: handed.extend(
        p.grad.detach().clone() for g in opt.param_groups for p in g["params"]))

    x, y = _batches()
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in reference_model.parameters()]
    for k in range(MICRO_BATCHES):
        engine.backward(_loss(engine, x[k], y[k]))
        engine.step()
        # DeepSpeed divides each micro-batch's loss by the accumulation steps; so does the reference
        grads = torch.autograd.grad(_loss(reference_model, x[k], y[k]) / MICRO_BATCHES,
                                    list(reference_model.parameters()))
        for total, grad in zip(exact, grads):
            total += grad.double()

    got = [torch.zeros_like(t) for t in exact]
    for part, flat_grad in zip(zero.flat_partitions(engine), handed):
        for offset, numel, index in part.segments:
            got[index].view(-1)[:numel] = flat_grad[offset:offset + numel].double()
    error = torch.cat([(a - b).view(-1) for a, b in zip(got, exact)]).norm()
    return {"wrapper": type(engine.optimizer).__name__,
            "relative_error": float(error / torch.cat([t.view(-1) for t in exact]).norm())}


def _probe(out: Path) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    results = {f"{name} {'bf16' if bf16 else 'shipped'}": _measure(name, bf16)
               for name in CONFIGS for bf16 in (True, False)}
    out.write_text(json.dumps(results, indent=1))


# --------------------------------------------------------------------------- the test


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("accumulation") / "results.json"
    env = {**cli_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": _free_port()}
    proc = run_command([sys.executable, "-m", "tests.bert_ds.test_grad_accumulation", "--probe", str(out)],
                       timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    for run, figures in results.items():
        print(f"\n{run:26s} {figures['wrapper']:22s} relative error {figures['relative_error']:.3e}")
    return results


@pytest.mark.parametrize("name", CONFIGS)
def test_the_shipped_bf16_configs_accumulate_micro_batches_in_fp32(measured, name):
    shipped, bf16 = measured[f"{name} shipped"], measured[f"{name} bf16"]
    # bf16 accumulation of 16 micro-batches: ~1e-3 here; fp32: the few roundings of the fp32 sum
    assert bf16["relative_error"] > 1e-4, bf16  # the error the fix is for is there to be fixed
    assert shipped["relative_error"] < bf16["relative_error"] / 100, (shipped, bf16)
    assert shipped["relative_error"] < 1e-5, shipped


def test_every_shipped_bf16_config_asks_for_fp32_accumulation():
    for path in sorted((REPO / "ds_configs").glob("*_bf16.json")):
        config = json.loads(path.read_text())
        stage = config["zero_optimization"]["stage"]
        if stage == 0:  # DeepSpeed has no fp32 accumulation for ZeRO-0 in bf16 (and LAMB does not run there)
            assert "data_types" not in config, path.name
        else:
            assert config.get("data_types") == {"grad_accum_dtype": "fp32"}, path.name


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--probe", type=Path, required=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _probe(parser.parse_args().probe)
