"""CoNLL-2003-style named-entity data, read from the layouts users have, locally, and checked.

Under ``--data DIR``, one of:

- **CoNLL column files**: ``train.txt``, ``valid.txt`` and ``test.txt``, or the original
  ``eng.train``, ``eng.testa`` and ``eng.testb``. One token per line, the token in the first
  column and its tag in the last (CoNLL-2003's part-of-speech and chunk columns between are
  ignored), as many columns on every token line of a file (a line short of one would be read
  with its chunk column as the tag), a blank line between sentences, ``-DOCSTART-`` lines
  between documents. Tags in
  BIO or IOB1 (both are read by conlleval's rules, :mod:`bert_ds.eval.ner_metrics`); the label
  set is the training file's tags.
- **Hugging Face's ``conll2003``** as Parquet (``train-…``, ``validation-…``, ``test-…``) or
  ``save_to_disk``, in DIR or one folder below it: ``tokens`` and integer ``ner_tags``, their
  names from the dataset's features (the Parquet files' metadata, ``dataset_info.json``) or
  from a ``labels.txt`` beside the files (one name per line, in id order).

The test split is optional. A line without a tag column, a line with other columns than the
file's first token line, a malformed tag, a tag outside the label set, an empty split: one line
naming the file and the line (or row), never a sentence skipped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from bert_ds.base.errors import UserError
from bert_ds.eval import hf_tables

CONLL_FILES = {"train": ("train.txt", "eng.train"), "dev": ("valid.txt", "eng.testa"),
               "test": ("test.txt", "eng.testb")}
HF_SPLITS = {"train": "train", "dev": "validation", "test": "test"}
_TAG = re.compile(r"^(O|[BIES]-\S+)$")


class NerDataError(UserError):
    """NER data that cannot be read or does not hold what it claims."""


@dataclass
class NerSplit:
    tokens: list[list[str]]  # per sentence
    tags: list[list[str]]  # per sentence, one per token
    source: Path
    lines: list[int] | None = None  # a column file's line of each sentence's first token, for errors


@dataclass(frozen=True)
class NerData:
    labels: tuple[str, ...]  # the tag set, in id order
    splits: dict[str, NerSplit]  # train, dev and, where there is one, test


def read_ner(data: Path) -> NerData:
    """Every split under ``data``, checked against the label set."""
    if not data.is_dir():
        raise NerDataError(f"--data {data}: {'not a folder' if data.exists() else 'no such folder'}")
    files = {split: next((data / n for n in names if (data / n).is_file()), None)
             for split, names in CONLL_FILES.items()}
    if files["train"] is not None or files["dev"] is not None:
        return _from_conll(files)
    for folder in (data, *sorted(p for p in data.iterdir() if p.is_dir())):
        if hf_tables.is_saved_dataset(folder) or hf_tables.parquet_files(folder, "train"):
            return _from_hf(folder)
    raise NerDataError(f"{data}: no NER data (looked for train.txt/valid.txt/test.txt, eng.train/eng.testa/eng.testb, "
                       "and Hugging Face's conll2003 as Parquet or save_to_disk, in the folder or one below it)")


# --------------------------------------------------------------------------- CoNLL column files

def _from_conll(files: dict[str, Path | None]) -> NerData:
    for split in ("train", "dev"):
        if files[split] is None:
            raise NerDataError(f"no {split} file beside {next(f for f in files.values() if f)} (looked for "
                               f"{' and '.join(CONLL_FILES[split])})")
    splits = {split: _read_conll(path) for split, path in files.items() if path is not None}
    labels = tuple(sorted({t for sentence in splits["train"].tags for t in sentence}, key=lambda t: (t != "O", t)))
    for split in ("dev", "test"):
        if split in splits:
            _check_labels(splits[split], labels, splits["train"].source)
    return NerData(labels, splits)


def _read_conll(path: Path) -> NerSplit:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise NerDataError(f"{path}: unreadable ({e})") from None
    tokens, tags, sentence, sentence_tags, where = [], [], [], [], []
    columns: tuple[int, int] | None = None  # (count, line) of the file's first token line
    for number, line in enumerate([*lines, ""], start=1):
        fields = line.split()
        if not fields or fields[0] == "-DOCSTART-":
            if sentence:
                tokens.append(sentence)
                tags.append(sentence_tags)
                where.append(number - len(sentence))
            sentence, sentence_tags = [], []
            continue
        if len(fields) < 2:
            raise NerDataError(f"{path}:{number}: {fields[0]!r} has no tag column (token first, tag last)")
        columns = columns or (len(fields), number)
        if len(fields) != columns[0]:
            raise NerDataError(f"{path}:{number}: {len(fields)} columns, where line {columns[1]} has {columns[0]} "
                               "(every token line holds the same columns, the token first and the tag last)")
        if not _TAG.match(fields[-1]):
            raise NerDataError(f"{path}:{number}: {fields[-1]!r} is not a tag (O, or B-/I-/E-/S- and a type)")
        sentence.append(fields[0])
        sentence_tags.append(fields[-1])
    if not tokens:
        raise NerDataError(f"{path}: no sentences")
    return NerSplit(tokens, tags, path, where)


def _check_labels(split: NerSplit, labels: tuple[str, ...], train: Path) -> None:
    known = set(labels)
    for i, sentence in enumerate(split.tags):
        for j, tag in enumerate(sentence):
            if tag not in known:
                where = f"{split.source}:{split.lines[i] + j}" if split.lines else f"{split.source}: sentence {i + 1}"
                raise NerDataError(f"{where}: tag {tag!r} is not among the training set's tags ({train}: "
                                   f"{', '.join(labels)})")


# --------------------------------------------------------------------------- Hugging Face's conll2003

def _from_hf(folder: Path) -> NerData:
    saved = hf_tables.is_saved_dataset(folder)
    splits, names = {}, None
    for split, hf in HF_SPLITS.items():
        if saved:
            if split == "test" and not (folder / hf).is_dir():
                continue  # the test split is optional
            table, source = hf_tables.read_saved_split(folder, hf, NerDataError), folder / hf
            names = names or _names_from_info(folder / hf / "dataset_info.json")
        else:
            files = hf_tables.parquet_files(folder, hf)
            if not files and split == "test":
                continue
            if not files:
                raise NerDataError(f"{folder}: no {hf}*.parquet (the {split} split)")
            table, source = hf_tables.read_parquet(files, NerDataError), folder / f"{hf}*.parquet"
            names = names or _names_from_metadata(table)
        splits[split] = (table, source)
    names = names or _names_from_file(folder)
    return NerData(tuple(names), {split: _from_table(table, source, names) for split, (table, source) in splits.items()})


def _names_from_info(path: Path) -> list[str] | None:
    try:
        return list(json.loads(path.read_text())["features"]["ner_tags"]["feature"]["names"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _names_from_metadata(table) -> list[str] | None:
    metadata = (table.schema.metadata or {}).get(b"huggingface")
    try:
        return list(json.loads(metadata)["info"]["features"]["ner_tags"]["feature"]["names"])
    except (TypeError, ValueError, KeyError):
        return None


def _names_from_file(folder: Path) -> list[str]:
    path = folder / "labels.txt"
    if not path.is_file():
        raise NerDataError(f"{folder}: the tag names are in neither the dataset's features nor a labels.txt (one "
                           "name per line, in id order)")
    names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    bad = [n for n in names if not _TAG.match(n)]
    if not names or bad:
        raise NerDataError(f"{path}: {'no names' if not names else repr(bad[0]) + ' is not a tag'}")
    return names


def _from_table(table, source: Path, names: list[str]) -> NerSplit:
    missing = [c for c in ("tokens", "ner_tags") if c not in table.column_names]
    if missing:
        raise NerDataError(f"{source}: no column {missing[0]!r} (NER needs tokens and ner_tags; it has "
                           f"{', '.join(table.column_names)})")
    tokens, ids = table.column("tokens").to_pylist(), table.column("ner_tags").to_pylist()
    tags = []
    for row, (words, sentence) in enumerate(zip(tokens, ids)):
        if len(words) != len(sentence):
            raise NerDataError(f"{source}: row {row}: {len(words)} tokens, {len(sentence)} tags")
        bad = next((t for t in sentence if not isinstance(t, int) or not 0 <= t < len(names)), None)
        if bad is not None:
            raise NerDataError(f"{source}: row {row}: tag id {bad!r} is outside the {len(names)} tags "
                               f"({', '.join(names)})")
        tags.append([names[t] for t in sentence])
    kept = [(w, t) for w, t in zip(tokens, tags) if w and w != ["-DOCSTART-"]]  # document breaks, where kept
    if not kept:
        raise NerDataError(f"{source}: no sentences")
    return NerSplit([w for w, _ in kept], [t for _, t in kept], source)


__all__ = ["CONLL_FILES", "NerData", "NerDataError", "NerSplit", "read_ner"]
