"""The training entry point end to end on CPU (DeepSpeed, gloo), as a user runs it."""

import json
import os
import shutil

import pytest

from tests.conftest import cli_env, run_cli

REQUIRED = {"step", "loss", "lr", "tokens", "tokens_per_s", "mlm_acc", "nsp_acc", "grad_norm", "skipped_steps"}


def _train(data, out, *extra, nproc=1, launcher="torchrun", env=None):
    args = ["bert_ds.train", "--data", str(data["train"]), "--val-data", str(data["heldout"]), "--output", str(out),
            "--preset", "tiny", "--seq-len", "64", "--global-batch-size", "16", "--micro-batch-size", "8",
            "--lr", "3e-2", "--warmup-steps", "5", "--val-samples", "64", "--no-progress", "--no-tensorboard",
            "--num-workers", "0", *extra]
    return run_cli(*args, nproc=nproc, launcher=launcher, env=env)


def _records(out):
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "split" not in r], [r for r in lines if r.get("split") == "val"]


@pytest.mark.lowest
def test_single_process_trains_exports_and_loads_in_transformers(sample_data, tmp_path):
    out = tmp_path / "train"  # the main job's layout: RUN_DIR/train and RUN_DIR/hf, which the demo reads
    as_a_user = {k: v for k, v in cli_env().items() if k != "DS_ACCELERATOR"}  # the suite sets it; a user need not
    proc = _train(sample_data, out, "--steps", "40", "--val-every", "20", env=as_a_user)
    # DeepSpeed's warnings that say nothing true of the run: a GPU it "was unable to detect" on a
    # CPU machine, "an untested optimizer" of LAMB (bert_ds.zero says why)
    said = proc.stdout + proc.stderr  # DeepSpeed's logger writes to stdout
    assert "unable to detect" not in said and "untested optimizer" not in said, said
    train, val = _records(out)
    assert [r["step"] for r in train] == list(range(1, 41))
    assert all(REQUIRED <= set(r) for r in train)
    tokens = [r["tokens"] for r in train]
    assert all(b > a for a, b in zip(tokens, tokens[1:]))
    first, last = sum(r["loss"] for r in train[:5]) / 5, sum(r["loss"] for r in train[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert [r["step"] for r in val] == [20, 40] and 0.0 <= val[-1]["mlm_acc"] <= 1.0
    from bert_ds.data_tools.tokenizer import HF_FILES
    tokenizer_files = sorted(p.name for p in (out / "checkpoints" / "latest" / "tokenizer").iterdir())
    assert tokenizer_files == sorted(HF_FILES)  # the tokenizer travels with the checkpoint, the shards do not
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 40 and "training summary" in proc.stdout
    kernels = json.loads((out / "kernels.json").read_text())  # what kernels=auto ran, and why
    assert (kernels["setting"], kernels["backend"], kernels["seq"], kernels["ops"]) == ("auto", "torch", 64, {})
    assert kernels["reason"].startswith("no CUDA device to race on")
    said = [line for line in proc.stderr.splitlines() if line.startswith("[bert_ds] kernels=")]
    assert said == [f"[bert_ds] kernels=auto: the native PyTorch ops run ({kernels['reason']})"]
    assert not (out / "pids").exists()  # the pid file and its folder are gone with the run

    run_cli("bert_ds.checkpoint.export", str(out / "checkpoints" / "latest"), str(tmp_path / "hf"))
    from transformers import AutoTokenizer, BertForPreTraining

    model = BertForPreTraining.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size == tok.vocab_size == 2048

    demo = run_cli("bert_ds.tools.demo", str(tmp_path))  # the main job's last step
    assert demo.stdout.count("    -> ") == 3 and "== summary ==" in demo.stdout
    assert demo.stderr == ""  # nothing of transformers' loading (its bar, its report)


@pytest.mark.lowest
def test_zero3_trains_and_exports_what_transformers_loads(sample_data, tmp_path):
    """zero3_bf16.json (with AdamW, as ZeRO-3 requires) trains with its parameters partitioned
    (the model then projects Q, K and V in their own modules: test_model.py), and its sharded
    checkpoint exports whole."""
    out = tmp_path / "zero3"
    _train(sample_data, out, "--steps", "3", "--ds-config", "zero3_bf16.json", "--optimizer", "adamw", "--lr", "1e-3")
    train, _ = _records(out)
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["skipped_steps"] == 0 for r in train)
    run_cli("bert_ds.checkpoint.export", str(out / "checkpoints" / "latest"), str(tmp_path / "hf"))
    from transformers import BertForPreTraining

    model = BertForPreTraining.from_pretrained(tmp_path / "hf")
    query = model.bert.encoder.layer[0].attention.self.query.weight
    hidden = model.config.hidden_size
    assert query.shape == (hidden, hidden) and query.abs().sum() > 0  # whole, not a rank's empty shard


def test_resume_continues_with_identical_losses(sample_data, tmp_path):
    # Started in bf16 by name, resumed naming none: the resume keeps the checkpoint's engine config,
    # not this machine's default (fp32 on a CPU without bf16 instructions, which a resume refuses).
    whole, split = tmp_path / "whole", tmp_path / "split"
    _train(sample_data, whole, "--steps", "12", "--ds-config", "zero1_bf16.json")
    _train(sample_data, split, "--steps", "12", "--exit-after", "5", "--ds-config", "zero1_bf16.json")
    first_part, _ = _records(split)
    assert [r["step"] for r in first_part] == list(range(1, 6))
    assert (split / "checkpoints" / "step_00000005" / "COMPLETE").is_file()
    proc = _train(sample_data, split, "--steps", "12")
    assert "resuming from" in proc.stderr and "ds_config" not in proc.stderr + proc.stdout
    assert ", bf16, ZeRO-1," in proc.stderr + proc.stdout  # the starting line
    # bf16 runs on bert_ds.train.bf16_copy, not DeepSpeed's BF16_Optimizer and its 17 memory lines
    assert "bf16_optimizer" not in proc.stdout + proc.stderr and "Virtual Memory" not in proc.stdout + proc.stderr
    ref = [r["loss"] for r in _records(whole)[0]]
    got = [r["loss"] for r in _records(split)[0]]
    assert len(got) == 12
    assert got == ref  # bitwise: same world size, RNG and data cursor restored


def _unsearchable_path_dirs() -> list[str]:
    """PATH entries this user may not search (a PATH inherited through ``su`` from root)."""
    found = []
    for directory in filter(None, os.environ.get("PATH", "").split(os.pathsep)):
        try:
            os.stat(directory)
        except PermissionError:
            found.append(directory)
        except OSError:
            pass
    return found


@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.lowest), "deepspeed"])
def test_two_ranks_under_a_launcher(sample_data, tmp_path, launcher):
    blocked = _unsearchable_path_dirs()
    if launcher == "deepspeed" and blocked and shutil.which("numactl") is None:
        pytest.skip(f"DeepSpeed's launcher runs numactl on CPU, and PATH holds directories this user cannot "
                    f"search ({', '.join(blocked)}): subprocess raises PermissionError, not FileNotFoundError")
    out = tmp_path / "run2"
    proc = _train(sample_data, out, "--steps", "6", "--profile-steps", "4-5", nproc=2, launcher=launcher)
    train, val = _records(out)
    assert [r["step"] for r in train] == list(range(1, 7))
    assert len(val) == 1
    assert (out / "checkpoints" / "latest" / "COMPLETE").is_file()
    # --profile-steps: each rank profiles the same two steps of the engine's run
    assert f"profile written: {out / 'profile' / 'rank0.md'}" in proc.stderr  # the run's log lines
    for rank in (0, 1):
        record = json.loads((out / "profile" / f"rank{rank}.json").read_text())
        assert record["steps"] == "4-5" and record["rank"] == rank and record["summary"]["steps"] == 2
        assert record["summary"]["top_host_ops"] and record["summary"]["wall_ms_per_step"] > 0
        # the step's stages, each timed (the rest of the loop is one more row)
        stages = {r["stage"]: r["host_ms_per_step"] for r in record["summary"]["stages"]}
        assert {"data", "forward", "backward", "batch_stats", "gradient_checks", "all_reduce", "update"} <= set(stages)
        assert all(ms > 0 for ms in stages.values()), stages
        assert (out / "profile" / f"rank{rank}.trace.json.gz").stat().st_size > 0


@pytest.mark.parametrize("args,message", [
    (["--data", "/nonexistent/data"], "/nonexistent/data"),
    (["--global-batch-size", "30", "--micro-batch-size", "8"], "not a multiple"),
])  # --preset and --profile-steps: test_bad_inputs.py, before torch is imported
def test_bad_input_gives_one_line_error(sample_data, args, message):
    base = ["--data", str(sample_data["train"]), "--output", "/tmp/unused-run", "--steps", "1"]
    proc = run_cli("bert_ds.train", *base, *args, check=False)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], proc.stderr[-2000:]
