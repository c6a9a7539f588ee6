"""SQuAD v1.1 and v2.0, read from the layouts users have, locally, and checked before training.

Under ``--data DIR``, one of:

- **the official JSON files** under their published names: ``train-v1.1.json`` and
  ``dev-v1.1.json``, or ``train-v2.0.json`` and ``dev-v2.0.json`` (articles, paragraphs,
  questions; v2.0's ``is_impossible``);
- **Hugging Face's ``squad`` or ``squad_v2`` as Parquet** (``train-00000-of-00001.parquet``,
  ``validation-...``), in DIR or in one folder below it (the hub's ``plain_text/`` or
  ``squad_v2/``);
- **``DatasetDict.save_to_disk``** of either, in DIR or one folder below it.

The version is the official file names' or, for the Hugging Face layouts, ``squad_v2`` in the
path (2.0) or not (1.1); ``--version`` settles a folder that holds both. Every answer is checked
against its context: its text must stand at its ``answer_start``. A v1.1 question without an
answer (or marked impossible), a v2.0 question marked impossible that has answers, an empty
split, a missing field: one line naming the file and the question id, never a question skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_ds.base.errors import UserError
from bert_ds.eval import hf_tables

VERSIONS = ("1.1", "2.0")
SPLITS = {"train": "train", "dev": "validation"}  # our name -> Hugging Face's


class SquadDataError(UserError):
    """SQuAD data that cannot be read or does not hold what it claims."""


@dataclass(frozen=True)
class Answer:
    text: str
    start: int  # character offset in the context


@dataclass(frozen=True)
class SquadExample:
    id: str
    question: str
    context: str
    answers: tuple[Answer, ...]  # none: unanswerable (v2.0)
    title: str = ""


@dataclass
class SquadSplit:
    examples: list[SquadExample]
    version: str  # "1.1" or "2.0"
    source: Path


@dataclass(frozen=True)
class Layout:
    """Where a SQuAD dataset lies under --data, and its version."""

    kind: str  # "json", "parquet" or "saved"
    folder: Path
    version: str


def find_layout(data: Path, version: str | None = None) -> Layout:
    """The layout under ``data`` (``version``: which one, where both are there)."""
    if version is not None and version not in VERSIONS:
        raise SquadDataError(f"--version must be 1.1 or 2.0, got {version!r}")
    found = [Layout("json", data, v) for v in VERSIONS if (data / f"dev-v{v}.json").is_file()
             or (data / f"train-v{v}.json").is_file()]
    if not found:
        for folder in (data, *sorted(p for p in data.iterdir() if p.is_dir())) if data.is_dir() else ():
            kind = ("saved" if hf_tables.is_saved_dataset(folder) else
                    "parquet" if hf_tables.parquet_files(folder, "validation") or hf_tables.parquet_files(folder, "train")
                    else None)
            if kind is not None:
                found.append(Layout(kind, folder, "2.0" if "squad_v2" in str(folder.resolve()) else "1.1"))
    if version is not None:
        matching = [f for f in found if f.version == version or f.kind != "json"]
        found = [Layout(f.kind, f.folder, version) for f in matching]
    if not found:
        raise SquadDataError(f"{data}: no SQuAD data (looked for train-v1.1.json/dev-v1.1.json, "
                             "train-v2.0.json/dev-v2.0.json, and Hugging Face's squad or squad_v2 as Parquet or "
                             "save_to_disk, in the folder or one below it)")
    if len(found) > 1:
        listed = ", ".join(f"{f.kind} v{f.version} in {f.folder}" for f in found)
        raise SquadDataError(f"{data}: more than one SQuAD dataset ({listed}); pass --version or a narrower --data")
    return found[0]


def read_split(layout: Layout, split: str) -> SquadSplit:
    """``split``: ``train`` or ``dev``; every example checked."""
    if layout.kind == "json":
        path = layout.folder / f"{split}-v{layout.version}.json"
        examples = _from_json(path)
    else:
        hf_split = SPLITS[split]
        if layout.kind == "saved":
            table, path = hf_tables.read_saved_split(layout.folder, hf_split, SquadDataError), layout.folder / hf_split
        else:
            files = hf_tables.parquet_files(layout.folder, hf_split)
            if not files:
                raise SquadDataError(f"{layout.folder}: no {hf_split}*.parquet (the {split} split)")
            table, path = hf_tables.read_parquet(files, SquadDataError), layout.folder / f"{hf_split}*.parquet"
        examples = _from_table(table, path)
    if not examples:
        raise SquadDataError(f"{path}: no questions")
    for example in examples:
        _check(example, layout.version, path)
    return SquadSplit(examples, layout.version, path)


def _check(example: SquadExample, version: str, path: Path) -> None:
    where = f"{path}: question {example.id!r}"
    if not isinstance(example.question, str) or not isinstance(example.context, str):
        raise SquadDataError(f"{where}: its question and context must be text, got {type(example.question).__name__} "
                             f"and {type(example.context).__name__}")
    for name, text in (("question", example.question), ("context", example.context)):
        if not text.strip():
            raise SquadDataError(f"{where}: its {name} is empty")
    if not example.answers and version == "1.1":
        raise SquadDataError(f"{where}: no answer, which SQuAD v1.1 does not have (a v2.0 file? pass --version 2.0)")
    for answer in example.answers:
        found = example.context[answer.start:answer.start + len(answer.text)]
        if not answer.text or found != answer.text:
            raise SquadDataError(f"{where}: the answer {answer.text!r} is not at answer_start {answer.start} of its "
                                 f"context (there: {found!r})")


# --------------------------------------------------------------------------- the official JSON

def _from_json(path: Path) -> list[SquadExample]:
    if not path.is_file():
        raise SquadDataError(f"{path}: no such file (the official files come in pairs: train-vX.json, dev-vX.json)")
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))["data"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise SquadDataError(f"{path}: not SQuAD's JSON (a top-level \"data\" list expected; {e})") from None
    examples = []
    try:
        for article in articles:
            for paragraph in article["paragraphs"]:
                context = paragraph["context"]
                for qa in paragraph["qas"]:
                    examples.append(_json_question(qa, context, article.get("title", ""), path))
    except (KeyError, TypeError) as e:
        raise SquadDataError(f"{path}: an article, paragraph or question without its field {e}") from None
    return examples


def _json_question(qa: dict[str, Any], context: str, title: str, path: Path) -> SquadExample:
    qid = str(qa["id"])
    answers = tuple(_answer(a["text"], a["answer_start"], path, qid) for a in qa.get("answers", []))
    if qa.get("is_impossible") and answers:
        raise SquadDataError(f"{path}: question {qid!r} is marked impossible but has answers")
    return SquadExample(qid, qa["question"], context, answers, title)


def _answer(text: Any, start: Any, path: Path, qid: str) -> Answer:
    if not isinstance(text, str) or isinstance(start, bool) or not isinstance(start, int):
        raise SquadDataError(f"{path}: question {qid!r}: an answer's text must be a string and its answer_start an "
                             f"integer, got {text!r} and {start!r}")
    return Answer(text, start)


# --------------------------------------------------------------------------- Hugging Face's columns

COLUMNS = ("id", "context", "question", "answers")


def _from_table(table, path: Path) -> list[SquadExample]:
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise SquadDataError(f"{path}: no column {missing[0]!r} (SQuAD needs {', '.join(COLUMNS)}; it has "
                             f"{', '.join(table.column_names)})")
    titles = table.column("title").to_pylist() if "title" in table.column_names else [""] * table.num_rows
    examples = []
    for qid, context, question, answers, title in zip(*(table.column(c).to_pylist() for c in COLUMNS), titles):
        try:
            texts, starts = answers["text"], answers["answer_start"]
        except (KeyError, TypeError):
            raise SquadDataError(f"{path}: question {qid!r}: answers must hold text and answer_start lists, got "
                                 f"{answers!r}") from None
        if len(texts) != len(starts):
            raise SquadDataError(f"{path}: question {qid!r}: {len(texts)} answer texts, {len(starts)} answer_starts")
        examples.append(SquadExample(str(qid), question, context,
                                     tuple(_answer(t, s, path, str(qid)) for t, s in zip(texts, starts)), title or ""))
    return examples


__all__ = ["VERSIONS", "Answer", "Layout", "SquadDataError", "SquadExample", "SquadSplit", "find_layout",
           "read_split"]
