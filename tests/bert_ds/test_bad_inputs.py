"""R5 and R18: damaged or invalid inputs, and writes that fail part-way, end in one
``error:`` line (exit 2) and leave the folder as it was."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bert_ds.config import BatchPlan, DataConfig
from bert_ds.loader.pretraining import PretrainingDataset, PretrainingLoader
from bert_ds.base.errors import ShardError
from bert_ds.data_tools.manifest import Manifest
from tests.conftest import REPO, cli_env


def _damaged_copy(sample_data, tmp_path: Path, offsets: slice | int, token_id: int) -> Path:
    """A copy of the train dataset whose first shard holds ``token_id`` at ``offsets``; its
    header (sizes, checksums, max id) is left as the build wrote it."""
    copy = tmp_path / "data"
    shutil.copytree(sample_data["train"], copy, ignore=shutil.ignore_patterns(".cache"))
    name = Manifest.load(copy).shards[0].name
    tokens = np.memmap(copy / f"{name}.bin", dtype="<u2", mode="r+")
    tokens[offsets] = token_id
    tokens.flush()
    return copy / name


def test_r5_a_token_past_the_vocabulary_names_the_shard_and_offset(sample_data, tmp_path):
    vocab = Manifest.load(sample_data["train"]).vocab_size
    probe = PretrainingDataset(sample_data["train"], DataConfig(train=str(sample_data["train"])), seed=7)
    shard, first, end = probe.chunk(3)
    assert shard == 0
    offsets = probe._sentence_offsets(shard, first, end)
    at = offsets[0] + (offsets[-1] - offsets[0]) // 2  # inside sample 3's tokens
    prefix = _damaged_copy(sample_data, tmp_path, at, vocab)  # the first id past the end
    ds = PretrainingDataset(prefix.parent, DataConfig(train=str(prefix.parent)), seed=7)  # opening reads no tokens
    ds.sample(0, 2)  # samples elsewhere in the shard are still served
    with pytest.raises(ShardError) as caught:
        ds.sample(0, 3)
    assert str(caught.value).startswith(f"{prefix}.bin: token id {vocab} at token offset {at} is outside "
                                        f"the vocabulary [0, {vocab})")


def test_r5_a_loader_worker_reports_the_damage_in_one_line(sample_data, tmp_path):
    prefix = _damaged_copy(sample_data, tmp_path, slice(None), 65535)  # every token damaged
    ds = PretrainingDataset(prefix.parent, DataConfig(train=str(prefix.parent)), seed=7)
    loader = PretrainingLoader(ds, BatchPlan.resolve(4, 4, 1), 0, num_workers=1)
    with pytest.raises(ShardError) as caught:
        loader.next_step()
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"{prefix}.bin: token id 65535 at token offset ")


# --------------------------------------------------------------------------- --ds-config

def _train_config(ds_config: str):
    from bert_ds.config import TrainConfig
    from bert_ds.model.families import model_preset

    return TrainConfig(model=model_preset("tiny", 1000), data=DataConfig(train="x"), ds_config=ds_config)


@pytest.mark.parametrize("ds, message", [
    ({"zero_optimization": {"stage": 7}}, "zero_optimization.stage must be 0, 1, 2 or 3, got 7"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage must be 0, 1, 2 or 3, got True"),
    ({"zero_optimization": {"stage": 1, "reduce_bucket_size": [50000000]}},
     "zero_optimization.reduce_bucket_size: Input should be a valid integer (got [50000000])"),
    ({"zero_optimization": {"stage": 1}, "fp16": {"enabled": True, "initial_scale_power": [16]}},
     "fp16.initial_scale_power: Input should be a valid integer (got [16])"),
    ({"zero_optimization": {"stage": 1, "overlap_comms": True}}, "zero_optimization.overlap_comms: Extra inputs"),
    ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "fp16": {"enabled": True}},
     "bf16 and fp16 are both enabled; enable at most one"),
    ({"zero_optimization": [1]}, "zero_optimization must be a JSON object, got [1]"),
    ({"zero_optimization": {"stage": 1}, "steps_per_print": [10]}, "steps_per_print must be an integer, got [10]"),
    ({"zero_optimization": {"stage": 1}, "communication_data_type": "fp8"}, "communication_data_type must be"),
    ([{"zero_optimization": {"stage": 1}}], "must hold a JSON object, got list"),
])
def test_r18_invalid_ds_config_values_are_one_config_error(tmp_path, ds, message):
    from bert_ds.config import deepspeed_config
    from bert_ds.base.errors import ConfigError

    path = tmp_path / "engine.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(ConfigError) as caught:
        deepspeed_config(_train_config(str(path)), BatchPlan.resolve(32, 32, 1))
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_every_bundled_ds_config_passes_the_check():
    from bert_ds.config import DS_CONFIG_DIR, check_engine_json

    bundled = sorted(DS_CONFIG_DIR.glob("*.json"))
    assert len(bundled) >= 10
    for path in bundled:
        check_engine_json(json.loads(path.read_text()), path)


# --------------------------------------------------------------------------- disk full during a save

def _enospc(name: str = "") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)


def _disk_full_at(point: str, monkeypatch) -> None:
    """Make one write of a checkpoint save fail the way a full disk fails it."""
    from safetensors import SafetensorError

    from bert_ds.checkpoint import store as checkpoint

    if point == "safetensors":  # safetensors' own error type
        def save_file(*args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        monkeypatch.setattr(checkpoint, "save_file", save_file)
    elif point == "torch.save":  # torch's zip writer: a RuntimeError, not an OSError
        def save(*args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 640 vs 534")
        monkeypatch.setattr(checkpoint.torch, "save", save)
    elif point == "latest":
        def point_latest(root, name):
            raise _enospc(str(root / ".latest.tmp"))
        monkeypatch.setattr(checkpoint, "_point_latest", point_latest)
    else:  # a SAVE_POINT: the write right after it fails
        def hook(reached, final):
            if reached == point and final.name == checkpoint.step_dir_name(20):
                raise _enospc(str(final / "x"))
        monkeypatch.setattr(checkpoint, "fault_hook", hook)


@pytest.mark.parametrize("point", ["engine_saved", "torch.save", "safetensors", "marked", "renamed", "latest"])
def test_r18_disk_full_during_a_save_keeps_the_previous_checkpoint_latest(tmp_path, monkeypatch, point):
    from bert_ds.checkpoint import store as checkpoint
    from tests.bert_ds.test_checkpoint import _save

    good = _save(tmp_path, 10)
    before = sorted(p.name for p in tmp_path.iterdir())
    _disk_full_at(point, monkeypatch)
    with pytest.raises(checkpoint.CheckpointSaveError) as caught:
        _save(tmp_path, 20)
    message = str(caught.value)
    assert message.startswith("step 20: checkpoint not saved (") and "\n" not in message
    assert message.endswith(f"MiB free there); newest checkpoint: {good.resolve()}")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary folder, no half-committed one
    assert checkpoint.find_latest(tmp_path) == good.resolve() == (tmp_path / "latest").resolve()
    monkeypatch.undo()
    assert _save(tmp_path, 20) == tmp_path / "step_00000020"  # the next save is not blocked by debris
    assert (tmp_path / "latest").resolve() == (tmp_path / "step_00000020").resolve()


# --------------------------------------------------------------------------- disk full during an export

def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("point", ["weights", "tokenizer"])
def test_r18_disk_full_during_an_export_leaves_the_earlier_export(tmp_path, monkeypatch, capsys, point):
    from safetensors import SafetensorError

    from bert_ds.checkpoint import store as checkpoint
    from bert_ds.checkpoint import export
    from tests.bert_ds.test_export import _config, _write_checkpoint

    _write_checkpoint(tmp_path / "ckpt", _config())
    out = tmp_path / "hf"
    assert export.main([str(tmp_path / "ckpt"), str(out)]) == 0
    before = _tree(out)
    if point == "weights":
        def save_file(*args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        monkeypatch.setattr(checkpoint, "save_file", save_file)
    else:
        def copyfile(src, dst):
            raise _enospc(str(dst))
        monkeypatch.setattr(export.shutil, "copyfile", copyfile)
    capsys.readouterr()
    assert export.main([str(tmp_path / "ckpt"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: export to {out} not written (")
    assert "No space left on device" in err and err.endswith(f"{out} is as it was\n")
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]  # no temporary folder


# --------------------------------------------------------------------------- --init-from

@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_r18_a_damaged_init_from_file_is_one_checkpoint_error(tmp_path, damage):
    from safetensors.torch import save_file

    from bert_ds.checkpoint import store as checkpoint

    file = tmp_path / "model.safetensors"
    save_file({"weight": torch.ones(64, 64)}, str(file))
    data = file.read_bytes()
    file.write_bytes({"truncated": data[:-100], "garbage": b"not a safetensors file" * 4, "empty": b""}[damage])
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.weights_file(file)
    message = str(caught.value)
    assert message.startswith(f"{file}: not a readable safetensors file (Error while deserializing header: ")
    assert "\n" not in message


def test_init_from_a_checkpoint_folder_names_the_damaged_file(tmp_path):
    from bert_ds.checkpoint import store as checkpoint
    from tests.bert_ds.test_checkpoint import _save

    final = _save(tmp_path, 10)
    assert checkpoint.weights_file(tmp_path / "latest") == final / checkpoint.WEIGHTS
    weights = final / checkpoint.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-4])
    with pytest.raises(checkpoint.CheckpointError, match=f"{weights}: size "):
        checkpoint.weights_file(final)


# --------------------------------------------------------------------------- the command line

def _one_line_refusal(sample_data, out: Path, *args: str) -> str:
    from tests.conftest import run_cli

    proc = run_cli("bert_ds.train", "--data", str(sample_data["train"]), "--output", str(out), "--steps", "1",
                   *args, check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), proc.stderr[-3000:]
    return err[0]


def test_r18_cli_refuses_bad_inputs_before_writing_anything(sample_data, tmp_path):
    out = tmp_path / "run"
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    assert _one_line_refusal(sample_data, out, "--ds-config", str(engine)) == \
        f"error: {engine}: zero_optimization.stage must be 0, 1, 2 or 3, got 7"
    assert _one_line_refusal(sample_data, out, "--log-samples", str(tmp_path)) == \
        f"error: --log-samples {tmp_path}: is a folder; give a file"
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x00" * 7)
    assert _one_line_refusal(sample_data, out, "--init-from", str(weights)).startswith(
        f"error: {weights}: not a readable safetensors file (Error while deserializing header: ")
    if not torch.cuda.is_available():  # the fused kernels asked for where no CUDA kernel can run
        assert _one_line_refusal(sample_data, out, "--kernels", "cuda").startswith(
            "error: kernels=cuda was requested but the fused CUDA kernels cannot load: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.json", "model.safetensors"]  # no run folder


def test_r18_an_output_folder_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    """A read-only mount (EROFS) is simulated: root writes through permission bits, so a chmod
    proves nothing to a test that may run as root."""
    import tempfile

    from bert_ds.config import check_writable
    from bert_ds.base.errors import ConfigError

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    check_writable(tmp_path / "new" / "run", "--output", folder=True)  # a creatable path passes
    assert not (tmp_path / "new").exists()  # and is not created by the check
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(ConfigError) as caught:
        check_writable(tmp_path / "run", "--output", folder=True)
    assert str(caught.value) == f"--output {tmp_path / 'run'}: cannot write there (Read-only file system)"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        check_writable(tmp_path / "file", "--output", folder=True)


def _train_main_alone(argv: list[str]) -> subprocess.CompletedProcess:
    """The train CLI's ``main(argv)`` in a fresh process, which prints its exit status and whether
    torch was imported."""
    script = ("import sys\nfrom bert_ds.train.cli import main\n"
              f"status = main({argv!r})\n"
              "print(status, 'torch' in sys.modules)")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=cli_env(),
                          timeout=120)


@pytest.mark.parametrize("flags, line", [
    (["--preset", "huge"], "error: unknown model preset 'huge'; choose one of "),
    (["--profile-steps", "3-x"], "error: --profile-steps must be STEP or FIRST-LAST (e.g. 11-13), got '3-x'"),
    (["--profile-steps", "2-1"], "error: --profile-steps 2-1: steps count from 1 and FIRST must not exceed LAST"),
    (["--profile-steps", "2-3"], "error: --profile-steps 2-3 starts after the run's last step (--steps 1)"),
])
def test_a_wrong_preset_or_profile_range_is_one_line_before_torch_is_imported(tmp_path, flags, line):
    """Flags whose check needs neither torch nor the data are refused at once, in one line."""
    proc = _train_main_alone(["--data", str(tmp_path / "data"), "--output", str(tmp_path / "run"), "--steps", "1",
                              *flags])
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(line), proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--data", "--output"])
def test_a_wrong_data_or_output_is_refused_before_torch_is_imported(tmp_path, flag):
    """The commonest slip, a mistyped path, is said at once: before the seconds torch takes to import."""
    (tmp_path / "file").write_text("x")
    paths = {"--data": str(tmp_path / "missing"), "--output": str(tmp_path / "run")}
    paths[flag] = str(tmp_path / "missing") if flag == "--data" else str(tmp_path / "file")
    proc = _train_main_alone(["--data", paths["--data"], "--output", paths["--output"], "--steps", "1"])
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: {paths[flag]}") or proc.stderr.startswith(f"error: {flag} {paths[flag]}"), \
        proc.stderr
