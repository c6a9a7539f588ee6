"""Which part a build process makes (``--part`` and every launcher's variables), and
:func:`dataset_folders` on a parent of parts (completeness, one build, one tokenizer)."""

import pytest

from bert_ds.base.errors import ShardError, UserError
from bert_ds.data_tools.manifest import Manifest
from bert_ds.data_tools.partition import (
    Part, dataset_folders, parse_part, part_name, processes_per_host, resolve_part,
)


@pytest.mark.parametrize("env, want", [
    ({"RANK": "2", "WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": "x"}, Part(2, 3, "torchrun: RANK/WORLD_SIZE")),
    ({"RANK": "1", "WORLD_SIZE": "4"}, Part(1, 4, "launcher: RANK/WORLD_SIZE")),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
     Part(0, 2, "mpirun: OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE")),
    ({"PMI_RANK": "5", "PMI_SIZE": "8"}, Part(5, 8, "MPICH/Intel MPI: PMI_RANK/PMI_SIZE")),
    ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4"},
     Part(3, 4, "srun: SLURM_PROCID/SLURM_STEP_NUM_TASKS")),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, Part()),  # an sbatch script: the whole corpus
    ({"RANK": "0", "WORLD_SIZE": "1"}, Part()),  # one process: a plain build
    ({}, Part()),
    # torchrun first: under srun + torchrun the rank torchrun gives is the one that counts
    ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"},
     Part(1, 2, "launcher: RANK/WORLD_SIZE")),
])
def test_launcher_variables(env, want):
    assert resolve_part(None, env) == want


def test_flag_wins_and_must_agree_with_the_launcher():
    assert resolve_part("1/3", {}) == Part(1, 3, "--part")
    assert resolve_part("2/3", {"RANK": "0", "WORLD_SIZE": "3"}) == Part(2, 3, "--part")
    assert resolve_part("0/1", {}) == Part()
    with pytest.raises(UserError, match="names 2 parts, but .* started 3 processes"):
        resolve_part("0/2", {"RANK": "0", "WORLD_SIZE": "3"})


@pytest.mark.parametrize("text", ["3/3", "a/b", "-1/2", "0/0", "1", "1/100000"])
def test_bad_part_values(text):
    with pytest.raises(UserError, match="--part"):
        parse_part(text)


@pytest.mark.parametrize("env", [{"RANK": "0"}, {"WORLD_SIZE": "2"}, {"PMI_RANK": "1"},
                                 {"OMPI_COMM_WORLD_SIZE": "2"}, {"RANK": "x", "WORLD_SIZE": "2"},
                                 {"RANK": "2", "WORLD_SIZE": "2"}])
def test_bad_launcher_variables(env):
    with pytest.raises(UserError):
        resolve_part(None, env)


def _part(parent, index, count, key="k", fingerprint="f" * 64):
    folder = parent / part_name(index, count)
    folder.mkdir(parents=True)
    Manifest(vocab_size=100, token_dtype="uint16", lowercase=True,
             special_tokens=dict(pad=0, unk=1, cls=2, sep=3, mask=4), tokenizer_fingerprint=fingerprint,
             shards=[], totals=dict(docs=0, sentences=0, tokens=0),
             build={"partition": {"index": index, "count": count, "corpus_key": key}}).save(folder)
    return folder


def test_dataset_folders(tmp_path):
    assert part_name(2, 64) == "part-00002-of-00064"
    with pytest.raises(ShardError, match="not a dataset folder nor a parent of partitions$"):
        dataset_folders(tmp_path)
    held = tmp_path / "holder"
    for name in ("train", "heldout"):  # a run's data/ folder: the datasets it holds are named
        (held / name).mkdir(parents=True)
        (held / name / "manifest.json").write_text("{}")
    with pytest.raises(ShardError, match=f"parent of partitions; dataset folders in it: {held}/heldout, {held}/train$"):
        dataset_folders(held)
    folders = [_part(tmp_path, i, 8) for i in (0, 2, 3, 5, 6, 7)]
    (tmp_path / part_name(4, 8)).mkdir()  # started, unfinished
    with pytest.raises(ShardError, match=r": parts 1, 4 of 8 are missing or unfinished \(no manifest.json\); "
                                         "rerun their builds"):
        dataset_folders(tmp_path)
    folders[1:1] = [_part(tmp_path, 1, 8)]
    (tmp_path / part_name(4, 8)).rmdir()
    folders[4:4] = [_part(tmp_path, 4, 8)]
    assert dataset_folders(tmp_path) == folders
    assert dataset_folders(folders[3]) == [folders[3]]


def test_dataset_folders_refuses_a_mixed_parent(tmp_path):
    _part(tmp_path / "a", 0, 2)
    _part(tmp_path / "a", 1, 2, key="other")
    with pytest.raises(ShardError, match="part-00001-of-00002: built from other inputs"):
        dataset_folders(tmp_path / "a")
    _part(tmp_path / "b", 0, 2)
    _part(tmp_path / "b", 1, 2, fingerprint="e" * 64)
    with pytest.raises(ShardError, match="another tokenizer"):
        dataset_folders(tmp_path / "b")
    _part(tmp_path / "c", 0, 1 + 1)
    _part(tmp_path / "c", 0, 3)
    with pytest.raises(ShardError, match="holds parts of 2 and of 3 parts"):
        dataset_folders(tmp_path / "c")


def test_processes_per_host():
    assert processes_per_host({"LOCAL_WORLD_SIZE": "8"}) == 8
    assert processes_per_host({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4
    assert processes_per_host({"MPI_LOCALNRANKS": "2"}) == 2
    assert processes_per_host({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3"}) == 4
    assert processes_per_host({}) == 1
