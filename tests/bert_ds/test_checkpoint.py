"""Atomic commit, the `latest` pointer, and damage detection, without a process group."""

import os
from pathlib import Path

import pytest
import torch

from bert_ds.checkpoint import store as checkpoint
from bert_ds.checkpoint.store import CheckpointError

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)


class _Engine:
    """The two things checkpoint.save needs from a DeepSpeed engine."""

    def __init__(self):
        self.module = torch.nn.Linear(3, 2)

    def save_checkpoint(self, save_dir, tag, save_latest):
        assert save_latest is False  # DeepSpeed would write `latest` in place
        d = Path(save_dir) / tag
        d.mkdir(parents=True)
        torch.save({"w": self.module.weight}, d / "engine.pt")


def _save(root, step, keep_last=3):
    return checkpoint.save(_Engine(), root, step, rank=0, model_config={"m": 1}, train_config={"t": 1},
                           train_state={"step": step}, tokenizer_dir=None, keep_last=keep_last)


def test_commit_moves_latest_and_keeps_last_k(tmp_path):
    for step in (10, 20, 30, 40):
        final = _save(tmp_path, step, keep_last=2)
        assert (final / checkpoint.MARKER).is_file()
        assert (tmp_path / "latest").resolve() == final.resolve()
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000030", "step_00000040"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_partial_folders_are_never_loaded(tmp_path):
    good = _save(tmp_path, 10)
    # a crash after the rename and before the pointer moved: newest marked folder wins
    newer = _save(tmp_path, 20)
    os.replace(tmp_path / "latest", tmp_path / "gone")
    (tmp_path / "latest").symlink_to(good.name)
    assert checkpoint.find_latest(tmp_path) == newer.resolve()
    # a crash before the marker: the folder (and a tmp folder) are ignored
    (tmp_path / "step_00000030").mkdir()
    (tmp_path / ".tmp-step_00000040").mkdir()
    assert checkpoint.find_latest(tmp_path) == newer.resolve()
    assert checkpoint.resolve(tmp_path / "latest") == newer.resolve()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoint.resolve(tmp_path / "step_00000030")


def test_flipped_byte_is_reported_with_the_file(tmp_path):
    final = _save(tmp_path, 10)
    checkpoint.verify(final)
    target = final / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: checksum mismatch"):
        checkpoint.verify(final)


def test_weights_are_saved_in_fp32_under_module_names(tmp_path):
    from safetensors.torch import load_file

    final = _save(tmp_path, 10)
    weights = load_file(final / "model.safetensors")
    assert set(weights) == {"weight", "bias"} and all(t.dtype == torch.float32 for t in weights.values())


def test_non_finite_weights_are_never_committed(tmp_path):
    """R16: a save of inf/NaN weights commits nothing and names the step and the newest checkpoint."""
    good = _save(tmp_path, 10)
    engine = _Engine()
    with torch.no_grad():
        engine.module.bias[1] = float("nan")
    with pytest.raises(checkpoint.NonFiniteWeightsError) as e:
        checkpoint.save(engine, tmp_path, 20, rank=0, model_config={}, train_config={}, train_state={"step": 20},
                        tokenizer_dir=None, keep_last=3)
    assert str(e.value) == (f"step 20: the weights hold inf or NaN (first in bias); nothing was saved; newest "
                            f"checkpoint: {good.resolve()}")
    assert checkpoint.find_latest(tmp_path) == good.resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000010"]


def test_checkpoint_files_follow_the_umask(tmp_path):
    """safetensors writes 0600; a checkpoint is readable as the umask allows (here 022: by all)."""
    old = os.umask(0o022)
    try:
        final = _save(tmp_path, 10)
    finally:
        os.umask(old)
    assert (final / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert final.stat().st_mode & 0o777 == 0o755
