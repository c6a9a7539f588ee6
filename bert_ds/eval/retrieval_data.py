"""Retrieval data as people have it, read and checked before anything trains.

An evaluation folder is BEIR's layout:

    corpus.jsonl        {"_id": ..., "title": ..., "text": ...} per line (title optional)
    queries.jsonl       {"_id": ..., "text": ...} per line
    qrels/dev.tsv       query-id <TAB> corpus-id <TAB> score, after a header line of those names
    qrels/test.tsv      (either or both; scored as they are there)
    qrels/train.tsv     optional: training pairs (a query and each document it grades above 0)

Training data, where ``--train`` names it (else the folder's ``qrels/train.tsv``):

- MS MARCO-style triples, a ``.tsv``: ``query <TAB> positive <TAB> negative`` per line (texts; a
  line of two columns is a pair without a hard negative);
- a ``.jsonl`` of ``{"query": ..., "positive": ..., "negatives": [...]}`` (``negatives``
  optional; ``"negative": ...`` for one);
- a Hugging Face ``datasets`` folder (``save_to_disk``) with ``query`` and ``positive`` columns
  and optionally ``negative`` or ``negatives``.

Every mistake a file can hold is one :class:`~bert_ds.base.errors.ConfigError` naming the file
and line: a line that is not JSON, a missing ``_id`` or text, an id given twice, a qrel naming a
query or document absent from the corpus, a score that is not an integer, an evaluation split
without queries.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bert_ds.base.errors import ConfigError

EVAL_SPLITS = ("dev", "test")
QREL_HEADER = ("query-id", "corpus-id", "score")


@dataclass(frozen=True)
class TrainExample:
    query: str
    positive: str
    negatives: tuple[str, ...] = ()  # hard negatives, where the data has them


@dataclass
class RetrievalData:
    """An evaluation folder read: texts by id, each evaluation split's graded pairs, training examples."""

    corpus: dict[str, str]  # document id -> "title text" (BEIR's join), the text a model encodes
    queries: dict[str, str]  # query id -> text
    qrels: dict[str, dict[str, dict[str, int]]]  # split -> query id -> document id -> grade
    train: list[TrainExample] = field(default_factory=list)
    train_source: str = ""  # where the training examples came from, for the report


def read_retrieval(folder: Path, train: Path | None = None, *, need_train: bool = True) -> RetrievalData:
    """``folder``'s corpus, queries and evaluation qrels, and the training examples (``train``, else
    the folder's ``qrels/train.tsv``; ``need_train=False`` for a zero-shot score, which trains nothing)."""
    corpus = {doc: _document(row) for doc, row in _by_id(folder / "corpus.jsonl", ("text",))}
    if not corpus:
        raise ConfigError(f"{folder / 'corpus.jsonl'}: no documents")
    queries = {qid: row["text"] for qid, row in _by_id(folder / "queries.jsonl", ("text",))}
    if not queries:
        raise ConfigError(f"{folder / 'queries.jsonl'}: no queries")
    qrels = {split: read_qrels(folder / "qrels" / f"{split}.tsv", queries, corpus)
             for split in EVAL_SPLITS if (folder / "qrels" / f"{split}.tsv").is_file()}
    if not qrels:
        raise ConfigError(f"{folder}: no qrels/dev.tsv or qrels/test.tsv to score against")
    for split, graded in qrels.items():
        if not any(grade > 0 for docs in graded.values() for grade in docs.values()):
            raise ConfigError(f"{folder / 'qrels' / f'{split}.tsv'}: no query with a relevant document (score > 0)")
    data = RetrievalData(corpus, queries, qrels)
    if need_train:
        data.train, data.train_source = _training(folder, train, queries, corpus)
    return data


def _document(row: dict[str, Any]) -> str:
    title = row.get("title") or ""
    return f"{title} {row['text']}".strip() if title else row["text"]


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of ``path``."""
    try:
        handle = path.open(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{path}:{number}: not a line of JSON ({e.args[0].split(':')[0]})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{number}: a JSON object per line, got {type(row).__name__}")
            yield number, row


def _by_id(path: Path, texts: tuple[str, ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    seen: dict[str, int] = {}
    for number, row in read_jsonl(path):
        ident = row.get("_id")
        if not isinstance(ident, (str, int)) or isinstance(ident, bool) or str(ident) == "":
            raise ConfigError(f"{path}:{number}: no \"_id\" (a string or an integer)")
        ident = str(ident)
        if ident in seen:
            raise ConfigError(f"{path}:{number}: _id {ident!r} again (first on line {seen[ident]})")
        seen[ident] = number
        for name in texts:
            if not isinstance(row.get(name), str):
                raise ConfigError(f"{path}:{number}: no \"{name}\" string")
        yield ident, row


def read_qrels(path: Path, queries: dict[str, str], corpus: dict[str, str]) -> dict[str, dict[str, int]]:
    """query id -> document id -> grade, every id checked against the queries and the corpus."""
    graded: dict[str, dict[str, int]] = {}
    with path.open(encoding="utf-8", newline="") as handle:
        for number, row in enumerate(csv.reader(handle, delimiter="\t"), 1):
            if not row or not "".join(row).strip() or (number == 1 and tuple(row) == QREL_HEADER):
                continue
            if len(row) != 3:
                raise ConfigError(f"{path}:{number}: {len(row)} column(s); a qrel is query-id, corpus-id, score")
            qid, doc, score = row
            if qid not in queries:
                raise ConfigError(f"{path}:{number}: query-id {qid!r} is not in queries.jsonl")
            if doc not in corpus:
                raise ConfigError(f"{path}:{number}: corpus-id {doc!r} is not in corpus.jsonl")
            try:
                grade = int(score)
            except ValueError:
                raise ConfigError(f"{path}:{number}: score {score!r} is not an integer") from None
            graded.setdefault(qid, {})[doc] = grade
    if not graded:
        raise ConfigError(f"{path}: no queries")
    return graded


def _training(folder: Path, train: Path | None, queries: dict[str, str],
              corpus: dict[str, str]) -> tuple[list[TrainExample], str]:
    if train is None:
        path = folder / "qrels" / "train.tsv"
        if not path.is_file():
            raise ConfigError(f"{folder}: no qrels/train.tsv to fine-tune on; give --train (triples .tsv, "
                              ".jsonl or a datasets folder), or --no-finetune for the zero-shot score")
        graded = read_qrels(path, queries, corpus)
        examples = [TrainExample(queries[qid], corpus[doc]) for qid, docs in graded.items()
                    for doc, grade in docs.items() if grade > 0]
        source = str(path)
    elif not train.exists():
        raise ConfigError(f"--train {train}: no such file or folder")
    elif train.is_dir():
        examples, source = _from_datasets(train), str(train)
    elif train.suffix == ".jsonl":
        examples, source = _from_jsonl(train), str(train)
    elif train.suffix == ".tsv":
        examples, source = _from_triples(train), str(train)
    else:
        raise ConfigError(f"--train {train}: not a .tsv of triples, a .jsonl or a datasets folder")
    if not examples:
        raise ConfigError(f"{source}: no training examples")
    return examples, source


def _from_triples(path: Path) -> list[TrainExample]:
    examples = []
    with path.open(encoding="utf-8", newline="") as handle:
        for number, row in enumerate(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE), 1):
            if not row or not "".join(row).strip():
                continue
            if len(row) not in (2, 3) or not all(part.strip() for part in row):
                raise ConfigError(f"{path}:{number}: a line is query, positive[, negative] (texts, tab-separated); "
                                  f"got {len(row)} column(s)")
            examples.append(TrainExample(row[0], row[1], tuple(row[2:])))
    return examples


def _from_jsonl(path: Path) -> list[TrainExample]:
    return [_example(row, f"{path}:{number}") for number, row in read_jsonl(path)]


def _from_datasets(folder: Path) -> list[TrainExample]:
    try:
        import datasets

        table = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"--train {folder}: not a datasets folder ({str(e).splitlines()[0]})") from None
    if isinstance(table, datasets.DatasetDict):
        if "train" not in table:
            raise ConfigError(f"--train {folder}: a DatasetDict without a train split ({', '.join(table)})")
        table = table["train"]
    return [_example(row, f"{folder} row {i}") for i, row in enumerate(table)]


def _example(row: dict[str, Any], where: str) -> TrainExample:
    query, positive = row.get("query"), row.get("positive")
    if not isinstance(query, str) or not isinstance(positive, str) or not query.strip() or not positive.strip():
        raise ConfigError(f"{where}: needs \"query\" and \"positive\" texts")
    negatives = row.get("negatives", [row["negative"]] if row.get("negative") is not None else [])
    if not isinstance(negatives, list) or not all(isinstance(n, str) and n.strip() for n in negatives):
        raise ConfigError(f"{where}: \"negatives\" must be a list of texts")
    return TrainExample(query, positive, tuple(negatives))
