"""NER data in every layout users have (CoNLL column files under both naming schemes, Hugging
Face's conll2003 as Parquet, with or without its features, and save_to_disk) reads alike, and
each kind of bad input is one error naming the file and the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from bert_ds.base.errors import UserError
from bert_ds.eval.ner_data import NerDataError, read_ner

NAMES = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
SENTENCES = {  # (tokens, tags) per split
    "train": [(["John", "lives", "in", "New", "York"], ["B-PER", "O", "O", "B-LOC", "I-LOC"]),
              (["Mary", "Ann", "left"], ["B-PER", "I-PER", "O"])],
    "dev": [(["Paris", "is", "big"], ["B-LOC", "O", "O"])],
    "test": [(["Ann", "visited", "Rome"], ["B-PER", "O", "B-LOC"])],
}


def _conll(folder: Path, names=("train.txt", "valid.txt", "test.txt"), sentences=SENTENCES) -> None:
    """Column files as CoNLL-2003 ships them: -DOCSTART-, part-of-speech and chunk columns."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, split in zip(names, ("train", "dev", "test")):
        lines = ["-DOCSTART- -X- -X- O", ""]
        for tokens, tags in sentences[split]:
            lines += [f"{t} NNP B-NP {tag}" for t, tag in zip(tokens, tags)] + [""]
        (folder / name).write_text("\n".join(lines))


def _dataset(split: str):
    import datasets
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "ner_tags": datasets.Sequence(datasets.ClassLabel(names=NAMES))})
    rows = SENTENCES[split]
    return datasets.Dataset.from_dict({"tokens": [t for t, _ in rows],
                                       "ner_tags": [[NAMES.index(x) for x in tags] for _, tags in rows]}, features)


def _hf_parquet(folder: Path, with_features: bool = True) -> None:
    import pyarrow.parquet as pq
    folder.mkdir(parents=True)
    for split, hf in (("train", "train"), ("dev", "validation"), ("test", "test")):
        path = folder / f"{hf}-00000-of-00001.parquet"
        _dataset(split).to_parquet(str(path))
        if not with_features:  # the bare columns, as another tool writes them
            pq.write_table(pq.read_table(path).replace_schema_metadata(None), path)
    if not with_features:
        (folder / "labels.txt").write_text("\n".join(NAMES) + "\n")


def _saved(folder: Path) -> None:
    import datasets
    datasets.DatasetDict({hf: _dataset(split) for split, hf in (("train", "train"), ("dev", "validation"),
                                                                ("test", "test"))}).save_to_disk(str(folder))


def test_the_layouts_read_alike(tmp_path):
    _conll(tmp_path / "conll")
    _conll(tmp_path / "original", names=("eng.train", "eng.testa", "eng.testb"))
    _hf_parquet(tmp_path / "parquet" / "conll2003")
    _hf_parquet(tmp_path / "bare", with_features=False)
    _saved(tmp_path / "saved")
    read = {kind: read_ner(tmp_path / kind) for kind in ("conll", "original", "parquet", "bare", "saved")}
    for kind, data in read.items():
        for split, rows in SENTENCES.items():
            got = data.splits[split]
            assert list(zip(got.tokens, got.tags)) == [(t, g) for t, g in rows], (kind, split)
    assert read["parquet"].labels == read["bare"].labels == read["saved"].labels == tuple(NAMES)
    assert read["conll"].labels == ("O", "B-LOC", "B-PER", "I-LOC", "I-PER")  # the training file's tags


def test_the_test_split_is_optional(tmp_path):
    _conll(tmp_path, names=("train.txt", "valid.txt", "unused.txt"))
    assert set(read_ner(tmp_path).splits) == {"train", "dev"}


@pytest.mark.parametrize("change, message", [
    (lambda rows: rows["dev"].append((["Bob"], ["B-ORG"])), r"valid.txt:\d+: tag 'B-ORG' is not among the training"),
    (lambda rows: rows["dev"].append((["Bob"], ["X-PER"])), r"valid.txt:\d+: 'X-PER' is not a tag"),
    (lambda rows: rows["dev"].clear(), r"valid.txt: no sentences"),
])
def test_bad_column_files_name_the_file_and_line(tmp_path, change, message):
    sentences = {split: list(rows) for split, rows in SENTENCES.items()}
    change(sentences)
    _conll(tmp_path, sentences=sentences)
    with pytest.raises(NerDataError, match=message):
        read_ner(tmp_path)


def test_a_line_without_its_tag_column_is_named(tmp_path):
    _conll(tmp_path)
    lines = (tmp_path / "train.txt").read_text().splitlines()
    lines[3] = "lives"
    (tmp_path / "train.txt").write_text("\n".join(lines))
    with pytest.raises(NerDataError, match=r"train.txt:4: 'lives' has no tag column"):
        read_ner(tmp_path)


@pytest.mark.parametrize("line, columns", [("lives NNP O", 3), ("lives VBZ B-VP O extra", 5)])
def test_a_line_with_other_columns_than_the_files_is_named(tmp_path, line, columns):
    """(a 3-column line among 4-column ones would be read with its chunk column, O, as the tag)"""
    _conll(tmp_path)
    lines = (tmp_path / "valid.txt").read_text().splitlines()
    assert lines[2].startswith("Paris ")  # the first token line, line 3
    lines[3] = line
    (tmp_path / "valid.txt").write_text("\n".join(lines))
    with pytest.raises(NerDataError, match=rf"valid.txt:4: {columns} columns, where line 3 has 4 \(every token line"):
        read_ner(tmp_path)


def test_a_tag_id_outside_the_names_and_missing_names_are_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    folder = tmp_path / "pq"
    folder.mkdir()
    for hf in ("train", "validation"):
        pq.write_table(pa.table({"tokens": [["a", "b"]], "ner_tags": [[0, 7]]}), folder / f"{hf}.parquet")
    with pytest.raises(NerDataError, match="neither the dataset's features nor a labels.txt"):
        read_ner(folder)
    (folder / "labels.txt").write_text("\n".join(NAMES))
    with pytest.raises(NerDataError, match=r"row 0: tag id 7 is outside the 5 tags"):
        read_ner(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NerDataError, match="no NER data"):
        read_ner(tmp_path / "empty")


def test_a_data_path_that_is_a_file_or_missing_is_named_as_such(tmp_path):
    import argparse

    from bert_ds.eval.runs import check_inputs

    (tmp_path / "train.txt").write_text("EU B-ORG\n")
    for path, what in ((tmp_path / "train.txt", "not a folder"), (tmp_path / "nope", "no such folder")):
        with pytest.raises(NerDataError, match=f"--data {path}: {what}$"):
            read_ner(path)
        args = argparse.Namespace(seeds=1, model=tmp_path, data=path, output=tmp_path / "out")
        with pytest.raises(UserError, match=f"--data {path}: {what}$"):  # glue's and squad's check
            check_inputs(args, lambda output: None, model_exists=False)


def test_a_training_run_given_as_the_model_is_told_the_export_command(tmp_path):
    import argparse

    from bert_ds.eval.runs import check_inputs

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for model, advice in ((run, f"export its newest checkpoint with python -m bert_ds.checkpoint.export {run} "
                                f"{run / 'hf'}$"),
                          (tmp_path, "export a checkpoint with python -m bert_ds.checkpoint.export$")):
        args = argparse.Namespace(seeds=1, model=model, data=tmp_path, output=tmp_path / "out")
        with pytest.raises(UserError, match=f"--model {model}: not a Hugging Face model folder .*; {advice}"):
            check_inputs(args, lambda output: None, model_exists=True)
