"""The golden run: a fixed tiny CPU training run, one rank and two, reproduced step by step.

The per-step metrics of ``bert_ds.train`` (tiny preset, ZeRO-1 fp32, LAMB, dropout on,
a periodic validation pass and save, one injected NaN step that is skipped) are stored in
``tests/assets/golden_run.json`` with the exact commands that made them. Any change of the
trainer that moves one of them changes what training does, and needs its own reason.

Tolerance: none. Loss, accuracies, gradient norm, learning rate and token counts must be
bitwise equal: on one machine with one torch build, every operation of this run (CPU
kernels with ``OMP_NUM_THREADS=1``, gloo's sum of two ranks) is deterministic, so any
difference is a change of behaviour. ZeRO-1 in fp32: bf16 on CPU would be as deterministic,
but fp32 keeps the figures meaningful to read. A torch or DeepSpeed version other than the
recorded one may round differently; the test then skips, naming both versions.

Regenerate (only with a reason: a deliberate change of the sample order, the model, the
optimizer, or a new torch):

    PYTHONPATH=$PWD python -m tests.bert_ds.test_golden_run --record
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, SAMPLE, cli_env, run_cli

GOLDEN = REPO / "tests" / "assets" / "golden_run.json"
STEP_FIELDS = ("step", "loss", "mlm_acc", "nsp_acc", "lr", "grad_norm", "loss_scale", "skipped_steps", "tokens",
               "samples")
VAL_FIELDS = ("step", "loss", "mlm_loss", "mlm_acc", "nsp_acc")
WORLD_SIZES = (1, 2)


def build_commands(root: Path) -> list[list[str]]:
    """``python -m`` arguments that build the train and held-out shards under ``root``."""
    return [
        ["bert_ds.data_tools", "build", "--input", str(SAMPLE / "valid.txt"), "--output", str(root / "train"),
         "--train-vocab", "2048", "--split-sentences", "--workers", "1"],
        ["bert_ds.data_tools", "build", "--input", str(SAMPLE / "test.txt"), "--output", str(root / "heldout"),
         "--vocab", str(root / "train" / "vocab.txt"), "--split-sentences", "--workers", "1"],
    ]


def train_args(root: Path, out: Path) -> list[str]:
    """``python -m`` arguments of the golden training run (the same on one rank and two)."""
    return ["bert_ds.train", "--data", str(root / "train"), "--val-data", str(root / "heldout"),
            "--output", str(out), "--preset", "tiny", "--seq-len", "64", "--global-batch-size", "16",
            "--micro-batch-size", "8", "--steps", "24", "--lr", "3e-2", "--warmup-steps", "5",
            "--optimizer", "lamb", "--ds-config", "zero1_fp32.json", "--seed", "1234",
            "--val-every", "8", "--val-samples", "32", "--save-every", "12", "--num-workers", "0",
            "--debug-inject-nan-at", "6", "--resume", "never", "--no-progress", "--no-tensorboard"]


def _relative(args: list[str], root: Path) -> list[str]:
    """Arguments with the temporary folder and the checkout written as placeholders."""
    return [a.replace(str(root), "$TMP").replace(str(REPO), "$REPO") for a in args]


def _versions() -> dict[str, str]:
    import deepspeed
    import torch

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__}


def run_golden(root: Path) -> dict[str, dict[str, list[dict]]]:
    """Build the data under ``root`` and train on each world size: {world: {"train": [...], "val": [...]}}."""
    for cmd in build_commands(root):
        run_cli(*cmd)
    runs = {}
    for world in WORLD_SIZES:
        out = root / f"run_{world}"
        run_cli(*train_args(root, out), nproc=world)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[str(world)] = {
            "train": [{k: r[k] for k in STEP_FIELDS} for r in records if "split" not in r],
            "val": [{k: r[k] for k in VAL_FIELDS} for r in records if r.get("split") == "val"],
        }
    return runs


def _same(a, b) -> bool:
    """Bitwise equality of two metrics, NaN (the injected step's loss) equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _differences(want: list[dict], got: list[dict]) -> list[str]:
    if len(want) != len(got):
        return [f"{len(got)} records, recorded {len(want)}"]
    return [f"step {w['step']} {k}: {g[k]!r} != recorded {w[k]!r}"
            for w, g in zip(want, got) for k in w if not _same(w[k], g[k])]


def test_golden_run_reproduces_bitwise(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    if golden["versions"] != _versions():
        pytest.skip(f"recorded with {golden['versions']}, running {_versions()}: re-record (see the docstring)")
    got = run_golden(tmp_path)
    for world in map(str, WORLD_SIZES):
        for split in ("train", "val"):
            diff = _differences(golden["runs"][world][split], got[world][split])
            assert not diff, f"{world} rank(s), {split}: " + "; ".join(diff[:8])
    # The run exercises what it claims to: a skipped NaN step, validation passes, and
    # the two world sizes training on the same global batches.
    one = golden["runs"]["1"]["train"]
    assert [r["skipped_steps"] for r in one][4:6] == [0, 1] and math.isnan(one[5]["loss"])
    assert [r["step"] for r in golden["runs"]["1"]["val"]] == [8, 16, 24]
    assert [r["tokens"] for r in one] == [r["tokens"] for r in golden["runs"]["2"]["train"]]


def record() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = run_golden(root)
        golden = {
            "about": "per-step metrics of the golden run; see tests/bert_ds/test_golden_run.py",
            "versions": _versions(),
            "environment": {k: cli_env()[k] for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS")},
            "build": [_relative(["python", "-m", *c], root) for c in build_commands(root)],
            "train": {str(w): _relative((["python", "-m"] if w == 1 else
                                         ["torchrun", "--standalone", f"--nproc-per-node={w}", "-m"])
                                        + train_args(root, root / f"run_{w}"), root) for w in WORLD_SIZES},
            "runs": runs,
        }
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help=f"run the golden run and write {GOLDEN}")
    if parser.parse_args().record:
        record()
    sys.exit(0)
