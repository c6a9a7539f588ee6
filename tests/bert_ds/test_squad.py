"""``python -m bert_ds.eval squad`` end to end on CPU: a tiny export learns a made-up span task
well above chance, its predictions file gives its scores again, a rerun keeps its results, and
bad input is one line that trains nothing."""

from __future__ import annotations

import json
import random

import pytest

from tests.bert_ds.test_glue import WORDS, tiny_export  # noqa: F401 (a fixture)
from tests.bert_ds.test_squad_data import _official, _parquet
from tests.conftest import run_cli

COLORS = ("red", "black", "white")


def learnable_squad(root, version="1.1", seed=0, sizes=(320, 80), layout="official"):
    """SQuAD whose answer is the one color word in a context of filler words; under v2.0 a
    quarter of the questions have no color word and no answer. ``layout``: the official JSON, or
    Hugging Face's Parquet files in the hub's folder ("parquet")."""
    rng = random.Random(seed)

    def questions(_version, split):
        rows = []
        for i in range(sizes[0] if split == "train" else sizes[1]):
            words = rng.choices(WORDS, k=rng.randint(8, 20))
            answerable = version == "1.1" or rng.random() > 0.25
            if answerable:
                words.insert(rng.randrange(len(words)), rng.choice(COLORS))
            at = next((k for k, w in enumerate(words) if w in COLORS), None)
            start = len(" ".join(words[:at])) + (1 if at else 0) if at is not None else None
            rows.append({"id": f"{split}{i}", "title": f"t{i // 10}", "context": " ".join(words),
                         "question": "what color is it ?", "text": [] if at is None else [words[at]],
                         "start": [] if at is None else [start]})
        return rows

    if layout == "parquet":
        _parquet(root / ("squad_v2" if version == "2.0" else "plain_text"), version, rows_of=questions)
    else:
        _official(root, version, rows_of=questions)


def _eval(model, data, out, *extra, check=True):
    return run_cli("bert_ds.eval", "squad", "--model", str(model), "--data", str(data), "--output", str(out),
                   "--no-progress", "--max-seq-length", "48", "--doc-stride", "8", "--max-query-length", "24", *extra, check=check)


def test_a_tiny_export_learns_a_span_task_and_a_rerun_keeps_its_results(tiny_export, tmp_path):  # noqa: F811
    data, out = tmp_path / "squad", tmp_path / "results"
    learnable_squad(data, layout="parquet")  # the official JSON runs in the docs and phase-plan tests
    args = ("--seeds", "1", "--lr", "2e-3", "--epochs", "4")
    first = _eval(tiny_export, data, out, *args)
    assert "train_runtime" not in first.stdout + first.stderr  # the Trainer's own summary dict
    report = json.loads((out / "results.json").read_text())
    run = json.loads((out / "squad" / "seed1.json").read_text())
    print(f"SQuAD made-up span task, tiny export: {run['scores']}, {run['steps']} steps, {run['seconds']:.0f} s")
    assert report["task"] == "squad" and report["figures"]["exact_match"]["min"] >= 60.0  # chance: about 7
    assert run["train_questions"] == 320 and run["recipe"]["learning_rate"] == 2e-3
    assert "| exact_match |" in (out / "results.md").read_text()
    assert official_scores(data, out / "squad" / "seed1") == run["scores"]  # the official script's inputs
    assert not (out / "squad" / "seed1" / "null_odds.json").exists()  # v2.0's alone
    before = (out / "squad" / "seed1.json").read_text()
    again = _eval(tiny_export, data, out, *args)
    assert "kept from an earlier run" in again.stdout and (out / "squad" / "seed1.json").read_text() == before


def official_scores(data, folder):
    """The scores the official script gives a seed's ``predictions.json`` (and, v2.0, its
    ``null_odds.json`` as ``--na-prob-file``) on the dev questions in ``data``; every dev question
    has its answer there."""
    from bert_ds.eval.squad_data import find_layout, read_split
    from bert_ds.eval.squad_metrics import Question, evaluate

    dev = read_split(find_layout(data), "dev")
    predictions = json.loads((folder / "predictions.json").read_text())
    assert list(predictions) == [e.id for e in dev.examples]
    odds = json.loads((folder / "null_odds.json").read_text()) if dev.version == "2.0" else None
    return evaluate([Question(e.id, tuple(a.text for a in e.answers)) for e in dev.examples], predictions,
                    version=dev.version, no_answer_probability=odds)


def _moved_answer(folder):
    path = folder / "dev-v1.1.json"
    data = json.loads(path.read_text())
    data["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] += 1
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("change, message", [
    (_moved_answer, "dev-v1.1.json: question 'dev0': the answer"),
    (lambda d: (d / "train-v1.1.json").write_text('{"data": []}'), "train-v1.1.json: no questions"),
])
def test_bad_data_is_one_line_and_trains_nothing(tiny_export, tmp_path, change, message):  # noqa: F811
    data, out = tmp_path / "squad", tmp_path / "results"
    learnable_squad(data)
    change(data)
    proc = _eval(tiny_export, data, out, check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], proc.stderr
    assert not out.exists()


def test_bad_flags_and_folders_are_one_line(tiny_export, tmp_path):  # noqa: F811
    data = tmp_path / "squad"
    learnable_squad(data)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for extra, out, message in ((("--seeds", "0"), tmp_path / "a", "--seeds must be >= 1"),
                                (("--doc-stride", "30"), tmp_path / "b", "--doc-stride 30 must be under half"),
                                (("--max-query-length", "37"), tmp_path / "c",
                                 "--max-query-length 37, the 3 special tokens of a question and context pair and "
                                 "the 8 tokens of --doc-stride fill the window of 48"),
                                ((), mine, "exists and holds no SQuAD results")):
        proc = _eval(tiny_export, data, out, *extra, check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("command", ["squad", "ner", "glue"])
def test_a_model_folder_without_a_tokenizer_is_one_line_and_trains_nothing(tiny_export, tmp_path, command):  # noqa: F811
    """(transformers would make a tokenizer of the special tokens alone and train on [UNK]s)"""
    import shutil

    from tests.bert_ds.test_glue import learnable_sst2
    from tests.bert_ds.test_ner import learnable_conll

    model, data, out = tmp_path / "model", tmp_path / "data", tmp_path / "results"
    shutil.copytree(tiny_export, model)
    for path in model.iterdir():
        if "token" in path.name or path.name == "vocab.txt":
            path.unlink()
    {"squad": lambda: learnable_squad(data, sizes=(8, 8)), "ner": lambda: learnable_conll(data, sizes=(8, 8, 0)),
     "glue": lambda: learnable_sst2(data)}[command]()
    proc = run_cli("bert_ds.eval", command, "--model", str(model), "--data", str(data), "--output", str(out),
                   check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith(f"error: --model {model}: no tokenizer"), \
        proc.stderr
    assert not out.exists()


def test_a_tokenizer_that_is_not_a_fast_one_is_refused_in_one_line(tmp_path, monkeypatch):
    """(transformers 5 makes every BERT tokenizer a fast one; a folder's custom class may not be)"""
    import transformers

    from bert_ds.base.errors import UserError
    from bert_ds.eval import runs

    class SlowTokenizer:
        is_fast = False

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: SlowTokenizer())
    with pytest.raises(UserError, match=r"--model .*: its tokenizer \(SlowTokenizer\) is not a fast one; SQuAD needs "
                                        r"offsets \(save one with tokenizer.json in the folder\)"):
        runs.check_tokenizer(tmp_path, "SQuAD needs offsets")
