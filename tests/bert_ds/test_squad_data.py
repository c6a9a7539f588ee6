"""SQuAD data in every layout users have (the official JSON of v1.1 and v2.0, Hugging Face's
Parquet and save_to_disk of squad and squad_v2) reads alike, and each kind of bad input is one
error naming the file and the question."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bert_ds.eval.squad_data import Answer, SquadDataError, find_layout, read_split

CONTEXTS = ["Denver Broncos won Super Bowl 50 in Santa Clara.", "The Eiffel Tower stands in Paris, France."]


def _questions(version: str, split: str) -> list[dict]:
    """Four made-up questions per split (the second article's last one unanswerable in v2.0)."""
    rows = []
    for article, (context, answers) in enumerate(zip(CONTEXTS, (["Denver Broncos", "Santa Clara"],
                                                                 ["Paris", "Eiffel Tower"]))):
        for i, text in enumerate(answers):
            rows.append({"id": f"{split}-{article}-{i}", "title": f"article {article}", "context": context,
                         "question": f"What is answer {i}?", "text": [text], "start": [context.index(text)]})
    if version == "2.0":
        rows[-1].update(text=[], start=[])
    return rows


def _official(folder: Path, version: str, rows_of=_questions) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev"):
        articles: dict[str, dict] = {}
        for row in rows_of(version, split):
            article = articles.setdefault(row["title"], {"title": row["title"], "paragraphs": []})
            if not article["paragraphs"] or article["paragraphs"][-1]["context"] != row["context"]:
                article["paragraphs"].append({"context": row["context"], "qas": []})
            qa = {"id": row["id"], "question": row["question"],
                  "answers": [{"text": t, "answer_start": s} for t, s in zip(row["text"], row["start"])]}
            if version == "2.0":
                qa["is_impossible"] = not row["text"]
            article["paragraphs"][-1]["qas"].append(qa)
        data = {"version": f"v{version}" if version == "2.0" else version, "data": list(articles.values())}
        (folder / f"{split}-v{version}.json").write_text(json.dumps(data))


def _table(rows):
    import pyarrow as pa
    return pa.table({"id": [r["id"] for r in rows], "title": [r["title"] for r in rows],
                     "context": [r["context"] for r in rows], "question": [r["question"] for r in rows],
                     "answers": [{"text": r["text"], "answer_start": r["start"]} for r in rows]})


def _parquet(folder: Path, version: str, rows_of=_questions) -> None:
    import pyarrow.parquet as pq
    folder.mkdir(parents=True)
    for split, hf in (("train", "train"), ("dev", "validation")):
        pq.write_table(_table(rows_of(version, split)), folder / f"{hf}-00000-of-00001.parquet")


def _saved(folder: Path, version: str) -> None:
    import datasets
    datasets.DatasetDict({hf: datasets.Dataset(_table(_questions(version, split)))
                          for split, hf in (("train", "train"), ("dev", "validation"))}).save_to_disk(str(folder))


@pytest.mark.parametrize("version", ["1.1", "2.0"])
def test_the_layouts_read_alike(tmp_path, version):
    hub = "squad_v2" if version == "2.0" else "plain_text"
    _official(tmp_path / "official", version)
    _parquet(tmp_path / "parquet" / hub, version)
    _saved(tmp_path / "saved" / ("squad_v2" if version == "2.0" else "squad"), version)
    read = {}
    for kind in ("official", "parquet", "saved"):
        layout = find_layout(tmp_path / kind)
        assert layout.version == version, kind
        read[kind] = {split: read_split(layout, split) for split in ("train", "dev")}
    for split in ("train", "dev"):
        official, others = read["official"][split], [read[k][split] for k in ("parquet", "saved")]
        assert len(official.examples) == 4
        assert all(o.examples == official.examples for o in others)
    dev = read["official"]["dev"].examples
    assert dev[0].answers == (Answer("Denver Broncos", 0),) and dev[1].answers == (Answer("Santa Clara", 36),)
    assert (dev[3].answers == ()) is (version == "2.0")


def test_both_versions_in_one_folder_need_version(tmp_path):
    _official(tmp_path, "1.1")
    _official(tmp_path, "2.0")
    with pytest.raises(SquadDataError, match="more than one SQuAD dataset.*--version"):
        find_layout(tmp_path)
    assert find_layout(tmp_path, "2.0").version == "2.0"


def _broken(version: str, split: str, change) -> list[dict]:
    rows = _questions(version, split)
    if split == "dev":
        change(rows)
    return rows


@pytest.mark.parametrize("version, change, message", [
    ("1.1", lambda rows: rows[1].update(start=[3]), r"dev-v1.1.json: question 'dev-0-1': the answer 'Santa Clara' "
                                                    r"is not at answer_start 3"),
    ("1.1", lambda rows: rows[2].update(text=[], start=[]), r"question 'dev-1-0': no answer, which SQuAD v1.1"),
    ("2.0", lambda rows: rows.clear(), r"dev-v2.0.json: no questions"),
    ("2.0", lambda rows: rows[3].update(question=" "), r"dev-v2.0.json: question 'dev-1-1': its question is empty"),
    ("2.0", lambda rows: rows[3].update(context="\n"), r"question 'dev-1-1': its context is empty"),
])
def test_bad_input_is_one_error_naming_file_and_question(tmp_path, version, change, message):
    _official(tmp_path, version, rows_of=lambda v, split: _broken(v, split, change))
    layout = find_layout(tmp_path)
    read_split(layout, "train")  # the good split reads
    with pytest.raises(SquadDataError, match=message):
        read_split(layout, "dev")


def test_a_missing_field_or_column_is_named(tmp_path):
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "dev-v1.1.json").write_text(json.dumps({"data": [{"paragraphs": [{"qas": []}]}]}))
    with pytest.raises(SquadDataError, match="dev-v1.1.json: an article, paragraph or question without its field "
                                             "'context'"):
        read_split(find_layout(tmp_path / "json"), "dev")
    import pyarrow.parquet as pq
    (tmp_path / "pq").mkdir()
    pq.write_table(_table(_questions("1.1", "dev")).drop(["answers"]), tmp_path / "pq" / "validation.parquet")
    with pytest.raises(SquadDataError, match="no column 'answers'"):
        read_split(find_layout(tmp_path / "pq"), "dev")
    with pytest.raises(SquadDataError, match="no SQuAD data"):
        find_layout(tmp_path / "json" / "nothing")
