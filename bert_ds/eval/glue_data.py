"""The GLUE tasks and their data, read from the layouts users have, locally.

Three layouts, recognised per task folder under ``--data DIR``:

- **the classic GLUE distribution** (``SST-2/train.tsv``, ``SST-2/dev.tsv``, MNLI's
  ``dev_matched.tsv`` and ``dev_mismatched.tsv``): tab-separated, no quoting, read by the
  header's column names (CoLA has no header: by position);
- **Hugging Face ``glue`` configurations saved as Parquet**: one folder per configuration
  (``sst2/``), files named after the split (``train-00000-of-00001.parquet`` as on the hub, or
  ``train.parquet``), the hub's column names, labels already as ids;
- **``DatasetDict.save_to_disk``**: ``dataset_dict.json`` and one folder of Arrow files per split.

A folder is looked up under the task's classic name or its Hugging Face name (``SST-2`` or
``sst2``). Nothing is downloaded. A missing task or split, a missing column, a label outside
the task's labels, a row with the wrong number of fields: one line naming the file (and the
line), never a silently skipped example.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bert_ds.base.errors import UserError
from bert_ds.eval import hf_tables


class GlueDataError(UserError):
    """GLUE data that cannot be read as its task needs."""


@dataclass(frozen=True)
class Task:
    name: str  # the Hugging Face configuration: sst2
    classic: str  # the classic folder: SST-2
    columns: tuple[str, ...]  # the text columns, Hugging Face names
    tsv_columns: tuple[str | int, ...]  # the text columns in the classic TSV: header names, or positions
    tsv_label: str | int  # the label column in the classic TSV
    labels: tuple[str, ...] | None  # classic label strings in id order; None: a regression (STS-B)
    metric: str  # matthews | accuracy | f1 | spearman: the one BERT's paper reports
    evals: tuple[tuple[str, str, str], ...]  # (name in the results, classic dev file, Hugging Face split)

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)


def _dev(name: str) -> tuple[tuple[str, str, str], ...]:
    return ((name, "dev.tsv", "validation"),)


# In the BERT paper's column order. WNLI is left out, as the paper did (its dev set is adversarial
# to the train set: every system then scored below the majority class).
TASKS = {t.name: t for t in (
    Task("mnli", "MNLI", ("premise", "hypothesis"), ("sentence1", "sentence2"), "gold_label",
         ("entailment", "neutral", "contradiction"), "accuracy",
         (("mnli-m", "dev_matched.tsv", "validation_matched"),
          ("mnli-mm", "dev_mismatched.tsv", "validation_mismatched"))),
    Task("qqp", "QQP", ("question1", "question2"), ("question1", "question2"), "is_duplicate", ("0", "1"), "f1",
         _dev("qqp")),
    Task("qnli", "QNLI", ("question", "sentence"), ("question", "sentence"), "label",
         ("entailment", "not_entailment"), "accuracy", _dev("qnli")),
    Task("sst2", "SST-2", ("sentence",), ("sentence",), "label", ("0", "1"), "accuracy", _dev("sst2")),
    Task("cola", "CoLA", ("sentence",), (3,), 1, ("0", "1"), "matthews", _dev("cola")),
    Task("stsb", "STS-B", ("sentence1", "sentence2"), ("sentence1", "sentence2"), "score", None, "spearman",
         _dev("stsb")),
    Task("mrpc", "MRPC", ("sentence1", "sentence2"), ("#1 String", "#2 String"), "Quality", ("0", "1"), "f1",
         _dev("mrpc")),
    Task("rte", "RTE", ("sentence1", "sentence2"), ("sentence1", "sentence2"), "label",
         ("entailment", "not_entailment"), "accuracy", _dev("rte")),
)}
EXCLUDED = {"wnli": "left out, as in the BERT paper (its dev set is adversarial to its train set)"}


@dataclass
class Examples:
    """One split of a task: texts (one tuple per example) and labels (ids, or floats for STS-B)."""

    texts: list[tuple[str, ...]]
    labels: list[float] | list[int]
    source: Path  # the file or folder read, for messages

    def __len__(self) -> int:
        return len(self.labels)


def task_folder(data: Path, task: Task) -> Path:
    for name in (task.classic, task.name):
        for candidate in (data / name, data / name.lower()):
            if candidate.is_dir():
                return candidate
    raise GlueDataError(f"{data}: no folder for {task.name} (looked for {task.classic}/ and {task.name}/)")


def read_split(data: Path, task: Task, split: str) -> Examples:
    """``split``: ``train`` or one of the task's eval names (``sst2``, ``mnli-m``)."""
    folder = task_folder(data, task)
    tsv, hf_split = ("train.tsv", "train") if split == "train" else next(
        (file, hf) for name, file, hf in task.evals if name == split)
    if (folder / tsv).is_file():
        return _read_tsv(folder / tsv, task)
    if hf_tables.is_saved_dataset(folder):
        return _read_table(hf_tables.read_saved_split(folder, hf_split, GlueDataError), task, folder / hf_split)
    parquet = hf_tables.parquet_files(folder, hf_split)
    if parquet:
        return _read_table(hf_tables.read_parquet(parquet, GlueDataError), task, folder / f"{hf_split}*.parquet")
    raise GlueDataError(f"{folder}: no {tsv}, no {hf_split}*.parquet and no dataset_dict.json "
                        f"({task.name} needs its {split} split)")


# --------------------------------------------------------------------------- classic TSV

def _label_id(task: Task, value: str, where: str) -> float | int:
    if task.labels is None:
        try:
            score = float(value)
        except ValueError:
            raise GlueDataError(f"{where}: {task.name}'s score must be a number, got {value!r}") from None
        if not 0.0 <= score <= 5.0:
            raise GlueDataError(f"{where}: {task.name}'s score must be in [0, 5], got {score}")
        return score
    if value not in task.labels:
        raise GlueDataError(f"{where}: label {value!r} is not one of {task.name}'s {', '.join(task.labels)}")
    return task.labels.index(value)


def _read_tsv(path: Path, task: Task) -> Examples:
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # MRPC's files start with a byte-order mark
    except (OSError, UnicodeDecodeError) as e:
        raise GlueDataError(f"{path}: unreadable ({e})") from None
    first = 0
    if isinstance(task.tsv_label, str):  # a header names the columns
        if not lines:
            raise GlueDataError(f"{path}: empty (a header line and examples expected)")
        header = lines[0].split("\t")
        missing = [c for c in (*task.tsv_columns, task.tsv_label) if c not in header]
        if missing:
            raise GlueDataError(f"{path}: no column {missing[0]!r} in its header ({task.name} needs "
                                f"{', '.join(map(str, (*task.tsv_columns, task.tsv_label)))})")
        index = [header.index(c) for c in task.tsv_columns]
        label = header.index(task.tsv_label)
        fields, first = len(header), 1
    else:
        index, label = list(task.tsv_columns), task.tsv_label
        fields = None  # CoLA: four fields, no header
    texts, labels = [], []
    for number, line in enumerate(lines[first:], start=first + 1):
        if not line.strip():
            continue
        row = line.split("\t")
        where = f"{path}:{number}"
        expected = fields if fields is not None else max(*index, label) + 1
        if len(row) < expected or (fields is not None and len(row) > fields):
            raise GlueDataError(f"{where}: {len(row)} tab-separated fields, {expected} expected")
        texts.append(tuple(row[i] for i in index))
        labels.append(_label_id(task, row[label], where))
    if not labels:
        raise GlueDataError(f"{path}: no examples")
    return Examples(texts, labels, path)


# --------------------------------------------------------------------------- Hugging Face layouts

def _read_table(table, task: Task, source: Path) -> Examples:
    missing = [c for c in (*task.columns, "label") if c not in table.column_names]
    if missing:
        raise GlueDataError(f"{source}: no column {missing[0]!r} ({task.name} needs {', '.join(task.columns)}, label; "
                            f"it has {', '.join(table.column_names)})")
    columns = [table.column(c).to_pylist() for c in task.columns]
    labels = table.column("label").to_pylist()
    if not labels:
        raise GlueDataError(f"{source}: no examples")
    for row, label in enumerate(labels):
        bad = (not isinstance(label, (int, float)) or not 0 <= label <= 5 if task.labels is None
               else not isinstance(label, int) or not 0 <= label < task.num_labels)
        if bad:
            allowed = "a score in [0, 5]" if task.labels is None else f"an id in [0, {task.num_labels})"
            raise GlueDataError(f"{source}: row {row}: label {label!r} is not {allowed} "
                                "(a test split's -1 labels cannot be scored)")
    texts = list(zip(*columns))
    if any(not isinstance(t, str) for text in texts for t in text):
        raise GlueDataError(f"{source}: a text column holds a non-string value")
    return Examples(texts, [float(x) for x in labels] if task.labels is None else labels, source)
