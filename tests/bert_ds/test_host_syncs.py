"""The training step reads nothing from the device: it queues each step's work, the update
included, and reads the step's statistics after the next step is queued; neither does
DeepSpeed inside it, in any shipped ZeRO-0/1/2 config.

On a GPU every read of a device value (``.item()``, ``float()``, ``bool()``, ``.cpu()``,
``.tolist()``) and every tensor made from host numbers (``torch.tensor(1, device=...)``)
waits for all the work queued before it; the GPU then idles while the host catches up.
DeepSpeed's ZeRO-1/2 wrapper alone made four such reads per step (its overflow check, its
norm and clipping), DeepSpeed's throughput timer two device synchronisations, the step's
statistics three host-made tensors per micro-batch, and the step's own skip decision one.

This test runs the trainer on a CPU (tiny BERT, two micro-batches a step, a loader worker
so that batches are made in another process, as on a GPU) with every such call counted by a
``sitecustomize`` module while steps 4 to 6 are launched, and names the caller of each. On a
CPU these calls cost nothing, so counting them is how a CPU machine holds the GPU path free
of them. It also records when each step's statistics are read: after the next step's launch.
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

FIRST, LAST, STEPS = 4, 6, 8
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

launch, finish = step_module.TrainStep.launch, step_module.TrainStep.finish
order = []


def counted_launch(self, step):
    active[0] = FIRST <= step <= LAST
    try:
        return launch(self, step)
    finally:
        active[0] = False
        order.append(["launch", step])


def recorded_finish(self, launched, state):
    order.append(["finish", launched.step])
    result = finish(self, launched, state)
    if launched.step == STEPS:
        with open(os.environ["SYNC_COUNTS"], "w") as out:
            json.dump({"per_step": {k: v / (LAST - FIRST + 1) for k, v in counts.items()}, "order": order,
                       "dynamo": "torch._dynamo" in sys.modules}, out)  # bert_ds.base.dynamo
    return result


step_module.TrainStep.launch = counted_launch
step_module.TrainStep.finish = recorded_finish
'''


@pytest.mark.parametrize("ds_config", ["zero1_bf16.json", "zero2_bf16.json", "zero0_fp32.json"])
def test_a_training_step_reads_nothing_from_the_device(sample_data, tmp_path, ds_config):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(COUNTER)
    counts = tmp_path / "counts.json"
    env = {**cli_env(), "PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{REPO}", "SYNC_COUNTS": str(counts),
           "REPO": str(REPO)}
    run_cli("bert_ds.train", "--data", str(sample_data["train"]), "--output", str(tmp_path / "run"),
            "--preset", "tiny", "--seq-len", "64", "--global-batch-size", "16", "--micro-batch-size", "8",
            "--steps", "8", "--save-every", "4", "--grad-clip", "1.0", "--num-workers", "1",
            "--ds-config", ds_config, "--no-progress", "--no-tensorboard", env=env)
    got = json.loads(counts.read_text())
    # nothing of ours: the skip, the clipping factor and the statistics stay on the device
    assert got["per_step"] == DEEPSPEEDS.get(ds_config, {}), got["per_step"]
    # each step is read once the next one is queued, or at once where a checkpoint is due (4, 8)
    assert got["order"] == [["launch", 1], ["launch", 2], ["finish", 1], ["launch", 3], ["finish", 2],
                            ["launch", 4], ["finish", 3], ["finish", 4], ["launch", 5], ["launch", 6], ["finish", 5],
                            ["launch", 7], ["finish", 6], ["launch", 8], ["finish", 7], ["finish", 8]], got["order"]
    # and a rank that compiles nothing never imports TorchDynamo (2-2.5 s of CPU at its start)
    assert got["dynamo"] is False


# DeepSpeed's own reads in a step, per config: none. (ZeRO-1 in bf16 with fp32 accumulation once
# went through DeepSpeed's BF16_Optimizer, which measured, checked and clipped the gradients with
# three reads a step that no setting turns off; bert_ds.train.bf16_copy runs that layout now.)
DEEPSPEEDS: dict[str, dict[str, float]] = {}
