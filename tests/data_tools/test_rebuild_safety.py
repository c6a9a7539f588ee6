"""R12: a build never replaces data it was not asked to.

A rerun of the same build into a finished dataset leaves it as it is; a build of other
inputs or options into a dataset, into an interrupted build of another, or into a
non-empty folder that is no dataset refuses with one line (and leaves every byte) unless
--overwrite is given; a folder a build was killed in is resumed by the same build."""

import os
import shutil
from pathlib import Path

import pytest

import bert_ds.data_tools.build as build_module
from bert_ds.data_tools.__main__ import main
from bert_ds.data_tools.build import JOURNAL_NAME, BuildOptions, build
from bert_ds.data_tools.manifest import MANIFEST_NAME, Manifest

SAMPLE = Path(__file__).resolve().parents[2] / "data_tools" / "sample" / "valid.txt"
OPTS = dict(train_vocab=2048, split_sentences=True, shard_tokens=100_000, progress=False, workers=1)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """{name: (bytes, mtime_ns)} of every file in a folder."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("r12") / "data"
    build(BuildOptions(inputs=[str(SAMPLE)], output=str(out), **OPTS))
    return out


@pytest.fixture
def copy(dataset, tmp_path):
    dst = tmp_path / "data"
    shutil.copytree(dataset, dst)
    return dst


@pytest.fixture
def small(tmp_path):
    src = tmp_path / "small.txt"
    src.write_text("A short document.\nIt has two sentences.\n")
    return src


def build_cli(*args: str) -> int:
    return main(["build", *args, "--workers", "1", "--no-progress"])


def test_the_same_build_into_its_finished_dataset_writes_nothing(copy, capsys):
    before = snapshot(copy)
    rc = build_cli("--input", str(SAMPLE), "--output", str(copy), "--train-vocab", "2048", "--split-sentences",
                   "--shard-tokens", "100000")
    assert rc == 0
    assert "already built from these inputs and options" in capsys.readouterr().out
    assert snapshot(copy) == before


def test_other_inputs_into_a_finished_dataset_are_refused_in_one_line(copy, small, capsys):
    """The command that once replaced a 30-shard dataset with one tiny shard, exit 0."""
    before = snapshot(copy)
    rc = build_cli("--input", str(small), "--output", str(copy), "--vocab", str(copy / "tokenizer.json"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    tokens = Manifest.load(copy).totals["tokens"]
    assert err == [f"error: {copy} already holds a finished dataset ({len(Manifest.load(copy).shards)} shard(s), "
                   f"{tokens:,} tokens) built from other inputs or options; choose another --output, or pass "
                   "--overwrite to replace it"]
    assert snapshot(copy) == before


def test_other_options_into_a_finished_dataset_are_refused(copy, capsys):
    before = snapshot(copy)
    rc = build_cli("--input", str(SAMPLE), "--output", str(copy), "--vocab", str(copy / "vocab.txt"),
                   "--split-sentences", "--shard-tokens", "50000")
    assert rc == 2 and "built from other inputs or options" in capsys.readouterr().err
    assert snapshot(copy) == before


@pytest.mark.parametrize("change", [
    "inputs", "split_sentences", "documents", "join_wrapped", "shard_tokens", "train_vocab", "lowercase"])
def test_other_inputs_or_options_are_refused_before_a_vocabulary_is_trained(copy, small, monkeypatch, change):
    """A vocabulary of 30,522 on a large corpus takes long: a build that will be refused is
    refused first; the same build is found done without training one."""
    def no_training(*args, **kwargs):
        raise AssertionError("a vocabulary was trained before the refusal")

    monkeypatch.setattr(build_module, "train_vocab", no_training)
    changed = {"inputs": {"inputs": [str(small)]}, "split_sentences": {"split_sentences": False},
               "documents": {"documents": "file"}, "join_wrapped": {"join_wrapped": True},
               "shard_tokens": {"shard_tokens": 50_000}, "train_vocab": {"train_vocab": 1024},
               "lowercase": {"lowercase": False}}[change]
    with pytest.raises(build_module.UserError, match="already holds a finished dataset"):
        build(BuildOptions(**{"inputs": [str(SAMPLE)], "output": str(copy), **OPTS, **changed}))
    assert build(BuildOptions(inputs=[str(SAMPLE)], output=str(copy), **OPTS)).already_built


def test_overwrite_replaces_the_dataset(copy, small, capsys):
    rc = build_cli("--input", str(small), "--output", str(copy), "--vocab", str(copy / "vocab.txt"), "--overwrite")
    assert rc == 0, capsys.readouterr().err
    manifest = Manifest.load(copy)
    assert manifest.totals["docs"] == 1 and len(manifest.shards) == 1
    assert sorted(p.name for p in copy.glob("shard_*")) == ["shard_00000.bin", "shard_00000.idx"]
    assert not (copy / JOURNAL_NAME).exists()


def test_a_folder_that_is_no_dataset_is_refused_unless_overwrite(tmp_path, small, dataset, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    rc = build_cli("--input", str(small), "--output", str(folder), "--vocab", str(dataset / "vocab.txt"))
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {folder} is not empty and holds no bert-ds dataset; choose a new or empty --output, or pass "
        "--overwrite to build into it"]
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]

    rc = build_cli("--input", str(small), "--output", str(folder), "--vocab", str(dataset / "vocab.txt"),
                   "--overwrite")
    assert rc == 0
    assert (folder / MANIFEST_NAME).exists() and (folder / "notes.txt").read_text() == "keep me"


def test_an_empty_existing_folder_is_built_into(tmp_path, small, dataset):
    folder = tmp_path / "empty"
    folder.mkdir()
    result = build(BuildOptions(inputs=[str(small)], output=str(folder), vocab=str(dataset / "vocab.txt"),
                                progress=False, workers=1))
    assert not result.already_built and (folder / MANIFEST_NAME).exists()


def test_a_build_killed_before_its_first_shard_is_resumed_and_another_refused(tmp_path, small, dataset, monkeypatch):
    folder = tmp_path / "o"

    def killed(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(build_module, "install_tokenizer", killed)
    opts = dict(vocab=str(dataset / "vocab.txt"), progress=False, workers=1)
    with pytest.raises(build_module.UserError):
        build(BuildOptions(inputs=[str(small)], output=str(folder), **opts))
    monkeypatch.undo()
    assert (folder / JOURNAL_NAME).exists() and not (folder / MANIFEST_NAME).exists()

    with pytest.raises(build_module.UserError, match="holds an interrupted build of other inputs or options"):
        build(BuildOptions(inputs=[str(SAMPLE)], output=str(folder), **opts))
    result = build(BuildOptions(inputs=[str(small)], output=str(folder), **opts))
    assert not result.already_built and Manifest.load(folder).totals["docs"] == 1


def test_a_dataset_whose_manifest_does_not_load_is_only_replaced_with_overwrite(copy, small):
    (copy / MANIFEST_NAME).write_text("{ not json")
    with pytest.raises(build_module.UserError, match="a dataset whose manifest does not load"):
        build(BuildOptions(inputs=[str(small)], output=str(copy), vocab=str(copy / "vocab.txt"), progress=False,
                           workers=1))
    assert os.path.getsize(copy / MANIFEST_NAME) == len("{ not json")
