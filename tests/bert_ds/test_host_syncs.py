"""The training step reads the device once: the all-reduce of its statistics (under ZeRO-1 in
bf16, DeepSpeed's BF16_Optimizer, which accumulates the gradients in fp32, adds three reads of
its own, listed by name below).

On a GPU every read of a device value (``.item()``, ``float()``, ``bool()``, ``.cpu()``,
``.tolist()``) and every tensor made from host numbers (``torch.tensor(1, device=...)``)
waits for all the work queued before it; the GPU then idles while the host catches up.
DeepSpeed's ZeRO-1/2 wrapper alone made four such reads per step (its overflow check, its
norm and clipping), DeepSpeed's throughput timer two device synchronisations, and the
step's statistics three host-made tensors per micro-batch: about 15 per step, each draining
the GPU's queue.

This test runs the trainer on a CPU (tiny BERT, two micro-batches a step, a loader worker
so that batches are made in another process, as on a GPU) with every such call counted by a
``sitecustomize`` module in steps 4 to 6, and names the caller of each. On a CPU these calls
cost nothing, so counting them is how a CPU machine holds the GPU path to one read per step.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO, cli_env, run_cli

COUNTER = r'''
import collections, json, os, sys, traceback
import torch
import bert_ds.train.step as step_module

FIRST, LAST = 4, 6
counts = collections.Counter()
active = [False]


def _caller():
    frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
    f = frames[-1]
    name = f.filename.split("site-packages/")[-1].replace(os.environ["REPO"] + "/", "")
    return f"{name} {f.name}"


def _counted(name, orig):
    def call(*args, **kwargs):
        if active[0]:
            counts[f"{name} in {_caller()}"] += 1
        return orig(*args, **kwargs)
    return call


for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
    setattr(torch.Tensor, name, _counted(name, getattr(torch.Tensor, name)))
for name in ("tensor", "as_tensor"):
    setattr(torch, name, _counted(f"torch.{name}", getattr(torch, name)))
import deepspeed.accelerator
accelerator = deepspeed.accelerator.get_accelerator()
type(accelerator).synchronize = _counted("accelerator.synchronize", type(accelerator).synchronize)

run_step = step_module.TrainStep.__call__


def counted_step(self, state):
    active[0] = FIRST <= state.step + 1 <= LAST
    try:
        return run_step(self, state)
    finally:
        active[0] = False
        if state.step == LAST:
            with open(os.environ["SYNC_COUNTS"], "w") as out:
                json.dump({k: v / (LAST - FIRST + 1) for k, v in counts.items()}, out)
            with open(os.environ["SYNC_COUNTS"] + ".dynamo", "w") as out:  # bert_ds.base.dynamo
                out.write(str("torch._dynamo" in sys.modules))


step_module.TrainStep.__call__ = counted_step
'''


@pytest.mark.parametrize("ds_config", ["zero1_bf16.json", "zero2_bf16.json", "zero1_fp32.json"])
def test_a_training_step_reads_the_device_once(sample_data, tmp_path, ds_config):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(COUNTER)
    counts = tmp_path / "counts.json"
    env = {**cli_env(), "PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{REPO}", "SYNC_COUNTS": str(counts),
           "REPO": str(REPO)}
    run_cli("bert_ds.train", "--data", str(sample_data["train"]), "--output", str(tmp_path / "run"),
            "--preset", "tiny", "--seq-len", "64", "--global-batch-size", "16", "--micro-batch-size", "8",
            "--steps", "7", "--num-workers", "1", "--ds-config", ds_config, "--no-progress", "--no-tensorboard",
            env=env)
    per_step = json.loads(counts.read_text())
    # The all-reduce's copy to the host (its .tolist() then reads host memory): nothing else of ours.
    ours = {"cpu in bert_ds/train/step.py all_reduce": 1.0, "tolist in bert_ds/train/step.py all_reduce": 1.0}
    assert per_step == {**ours, **DEEPSPEEDS.get(ds_config, {})}, per_step
    # and a rank that compiles nothing never imports TorchDynamo (2-2.5 s of CPU at its start)
    assert (tmp_path / "counts.json.dynamo").read_text() == "False"


# ZeRO-1 in bf16 accumulates in fp32 through DeepSpeed's BF16_Optimizer, which measures,
# checks and clips the gradients itself with three device reads a step that no setting turns
# off (ZeRO-2 keeps DeepSpeedZeroOptimizer, whose checks the step takes over).
DEEPSPEEDS = {"zero1_bf16.json": {"__bool__ in deepspeed/runtime/utils.py is_invalid_grad_norm": 1.0,
                                  "__bool__ in deepspeed/runtime/utils.py clip_tensors_by_global_norm": 1.0,
                                  "torch.tensor in deepspeed/runtime/utils.py mask_nan_or_inf_with_val_inplace": 1.0}}
