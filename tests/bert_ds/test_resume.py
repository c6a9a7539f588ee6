"""R15 (resume with a changed recipe) and the rerun edges of a run folder: a finished run
rerun, a damaged newest checkpoint, a folder without its COMPLETE marker, ``--output``
naming a file. The trainer runs as processes, the way a user runs it (tiny BERT, sequence
length 64, one rank); one short trained run is shared by the tests, each on its own copy.

Each test prints the figure it measured (``pytest -s`` shows them) and asserts it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from bert_ds.checkpoint import store as checkpoint
from bert_ds.checkpoint import resume
from bert_ds.config import DataConfig, OptimConfig, TrainConfig
from bert_ds.base.errors import ConfigError
from bert_ds.model.families import model_preset
from bert_ds.train.cli import model_from_args, parse_args
from tests.conftest import run_cli

STEPS, SAVE_EVERY = 6, 2


def _args(data, out, *extra) -> list[str]:
    """The trained fixture's command, without --preset: the default must not matter on resume."""
    return ["bert_ds.train", "--data", str(data["train"]), "--output", str(out), "--seq-len", "64",
            "--global-batch-size", "8", "--micro-batch-size", "8", "--lr", "3e-2", "--warmup-steps", "2",
            "--no-progress", "--no-tensorboard", "--num-workers", "0", *extra]


@pytest.fixture(scope="module")
def trained(sample_data, tmp_path_factory) -> Path:
    """A finished tiny run of STEPS steps with a checkpoint every SAVE_EVERY (steps 2, 4, 6)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    run_cli(*_args(sample_data, out, "--preset", "tiny", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)))
    return out


def _copy(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained, out, symlinks=True)
    return out


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / checkpoint.step_dir_name(step)


# --------------------------------------------------------------------------- the table

def test_every_config_field_has_one_class():
    fields = {resume.WORLD_SIZE}
    for preset in ("tiny", "modernbert-tiny"):  # both model families' fields
        cfg = TrainConfig(model=model_preset(preset, 128), data=DataConfig(train=["d"], pair_task="none"))
        fields |= set(resume.flatten(cfg.to_dict()))
    assert fields == set(resume.FIELDS)
    assert set(resume.FIELDS.values()) == {resume.REFUSED, resume.RECORDED, resume.IGNORED}


def _saved_checkpoint(tmp_path: Path, cfg: TrainConfig, world_size: int = 1) -> Path:
    """A checkpoint folder holding only the files the comparison reads."""
    ckpt = tmp_path / "checkpoints" / checkpoint.step_dir_name(4)
    ckpt.mkdir(parents=True)
    (ckpt / "train_config.json").write_text(json.dumps(cfg.to_dict()))
    (ckpt / "train_state.json").write_text(json.dumps({"step": 4, "world_size": world_size}))
    return ckpt


def test_refused_changes_are_one_line_naming_each(tmp_path):
    saved = TrainConfig(model=model_preset("tiny", 128), data=DataConfig(train=["d"]))
    ckpt = _saved_checkpoint(tmp_path, saved)
    changed = dataclasses.replace(saved, model=model_preset("mini", 128), global_batch_size=16,
                                  optim=OptimConfig(name="adamw", lr=1e-3),
                                  data=DataConfig(train=["d"], pair_task="sop", mask_rate=0.2, max_seq_length=64))
    with pytest.raises(ConfigError) as e:
        resume.changes(ckpt, changed, world_size=1)
    message = str(e.value)
    print(f"R15: {message}")
    assert "\n" not in message
    for field, saved_value, requested in [("model.hidden_size", 64, 256), ("model.num_layers", 2, 4),
                                          ("optim.name", "lamb", "adamw"), ("data.pair_task", "nsp", "sop"),
                                          ("data.mask_rate", 0.15, 0.2), ("data.max_seq_length", 128, 64),
                                          ("global_batch_size", 32, 16)]:
        assert f"{field}: saved {saved_value}, requested {requested}" in message
    assert "optim.lr" not in message  # a safe change is not among the refused ones


def test_safe_changes_are_returned_and_an_unchanged_recipe_has_none(tmp_path):
    saved = TrainConfig(model=model_preset("tiny", 128), data=DataConfig(train=["d"]))
    ckpt = _saved_checkpoint(tmp_path, saved, world_size=2)
    assert resume.changes(ckpt, saved, world_size=2) == []
    changed = dataclasses.replace(saved, steps=2000, micro_batch_size=8, save_every=50, output="elsewhere",
                                  optim=OptimConfig(lr=1e-3), data=DataConfig(train=["d"], num_workers=4))
    got = {c["field"]: (c["saved"], c["requested"]) for c in resume.changes(ckpt, changed, world_size=1)}
    assert got == {"steps": (1000, 2000), "micro_batch_size": (32, 8), "save_every": (0, 50),
                   "optim.lr": (6e-3, 1e-3), "data.num_workers": (1, 4), "world_size": (2, 1)}


@pytest.mark.parametrize("flags, want", [
    ([], {"hidden_size": 64, "hidden_dropout": 0.0}),  # all from the checkpoint
    (["--preset", "tiny"], {"hidden_size": 64, "hidden_dropout": 0.0}),  # the same preset keeps the rest as saved
    (["--preset", "mini", "--dropout", "0.2"], {"hidden_size": 256, "hidden_dropout": 0.2}),  # R15 refuses the size
])
def test_resume_takes_each_model_field_not_given_from_the_checkpoint(flags, want):
    saved = model_preset("tiny", 128, hidden_dropout=0.0).to_dict()
    args = parse_args(["--data", "d", *flags])
    from_data = {"vocab_size": 128, "pad_token_id": 0}
    model = model_from_args(args, from_data, saved)
    assert {k: getattr(model, k) for k in want} == want
    assert model_from_args(args, from_data, None).hidden_size == (64 if "tiny" in flags else 256)  # fresh: default mini


# --------------------------------------------------------------------------- the trainer

def test_a_finished_run_rerun_says_so_and_leaves_its_files(sample_data, trained, tmp_path):
    out = _copy(trained, tmp_path)
    before = {name: (out / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}
    proc = run_cli(*_args(sample_data, out, "--preset", "tiny", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)))
    lines = proc.stdout.strip().splitlines()
    print(f"finished rerun -> exit {proc.returncode}: {lines}")
    assert len(lines) == 1 and "finished at step 6" in lines[0]
    assert {name: (out / name).read_bytes() for name in before} == before
    assert not (out / resume.LOG_NAME).exists()

    # Killed between its last checkpoint and its summary: finished too, and no NaN summary appears.
    (out / "summary.json").unlink()
    proc = run_cli(*_args(sample_data, out, "--preset", "tiny", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)))
    assert "finished at step 6" in proc.stdout and "no summary.json" in proc.stdout
    assert not (out / "summary.json").exists() and (out / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]


def test_a_changed_recipe_is_refused_in_one_line(sample_data, trained, tmp_path):
    out = _copy(trained, tmp_path)
    proc = run_cli(*_args(sample_data, out, "--preset", "mini", "--optimizer", "adamw", "--mask-rate", "0.2",
                          "--steps", "8"), check=False)
    err = _errors(proc.stderr)
    print(f"R15: --preset mini --optimizer adamw --mask-rate 0.2 on a tiny LAMB run -> exit {proc.returncode}: {err}")
    assert proc.returncode == 2 and len(err) == 1
    assert all(f in err[0] for f in ("model.hidden_size: saved 64, requested 256", "optim.name: saved lamb, requested adamw",
                                     "data.mask_rate: saved 0.15, requested 0.2"))
    assert "Traceback" not in proc.stderr


def test_output_naming_a_file_is_one_line(sample_data, tmp_path):
    file = tmp_path / "not-a-folder"
    file.write_text("keep me\n")
    proc = run_cli(*_args(sample_data, file, "--steps", "2"), check=False)
    err = _errors(proc.stderr)
    print(f"--output FILE -> exit {proc.returncode}: {err}")
    assert proc.returncode == 2 and len(err) == 1 and str(file) in err[0]
    assert file.read_text() == "keep me\n"


def test_damaged_newest_checkpoint_names_the_previous_and_the_hint_works(sample_data, trained, tmp_path):
    """Step 6 lost its marker (skipped, with a note), step 4 has a flipped byte (refused, naming
    step 2); moving step 4 aside as the hint says resumes from step 2, takes the checkpoint's
    model without --preset, and records the safe changes."""
    out = _copy(trained, tmp_path)
    (_ckpt(out, 6) / checkpoint.MARKER).unlink()
    weights = _ckpt(out, 4) / checkpoint.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))

    proc = run_cli(*_args(sample_data, out, "--steps", "8"), check=False)
    err = _errors(proc.stderr)
    notes = [line for line in proc.stderr.splitlines() if "no COMPLETE marker" in line]
    print(f"damaged step 4, unmarked step 6 -> exit {proc.returncode}: {err}; {notes}")
    assert proc.returncode == 2 and len(err) == 1 and len(notes) == 1 and _ckpt(out, 6).name in notes[0]
    assert str(_ckpt(out, 2)) in err[0] and "mv " in err[0]

    _ckpt(out, 4).rename(out / f"{_ckpt(out, 4).name}.damaged")
    proc = run_cli(*_args(sample_data, out, "--steps", "8", "--micro-batch-size", "4"))
    assert f"resuming from {_ckpt(out, 2)}" in proc.stdout + proc.stderr
    model = json.loads((_ckpt(out, 8) / "model_config.json").read_text())
    assert (model["hidden_size"], model["num_layers"]) == (64, 2)  # tiny, as saved, not the default preset
    log = [json.loads(line) for line in (out / resume.LOG_NAME).read_text().splitlines()]
    print(f"resume from step 2 recorded: {log}")
    assert len(log) == 1 and log[0]["step"] == 2
    assert {c["field"]: c["requested"] for c in log[0]["changes"]} == {"steps": 8, "micro_batch_size": 4, "save_every": 0}
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_an_unreadable_saved_recipe_names_the_fallback(tmp_path):
    saved = TrainConfig(model=model_preset("tiny", 128), data=DataConfig(train=["d"]))
    newest = _saved_checkpoint(tmp_path, saved)
    (newest / "train_config.json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="no earlier complete checkpoint"):
        resume.changes(newest, saved, world_size=1)
    older = newest.with_name(checkpoint.step_dir_name(2))
    older.mkdir()
    (older / checkpoint.MARKER).write_text("{}")
    with pytest.raises(checkpoint.CheckpointError, match=f"previous complete checkpoint is {older}"):
        resume.changes(newest, saved, world_size=1)
