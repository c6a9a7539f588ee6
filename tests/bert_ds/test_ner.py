"""``python -m bert_ds.eval ner`` end to end on CPU: a tiny export learns a made-up tagging task
well above chance, a rerun keeps its results, and bad input is one line that trains nothing."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.bert_ds.test_glue import WORDS, tiny_export  # noqa: F401 (a fixture)
from tests.conftest import REPO, cli_env, end, run_cli, spawn, stop_signals_at_default

ENTITIES = {"PER": [["john"], ["king", "john"]], "LOC": [["new", "york"], ["river"]]}


def learnable_conll(folder, seed=0, sizes=(300, 60, 60), layout="conll"):
    """CoNLL-2003 whose entities are a few fixed names among filler words (BIO); ``sizes``:
    sentences in train, valid and test (0: no such split); ``layout``: column files ("conll") or
    Hugging Face's ``save_to_disk`` with the tag names in its features ("saved")."""
    rng = random.Random(seed)
    splits = {}
    for name, n in zip(("train", "validation", "test"), sizes):
        sentences = []
        for _ in range(n):
            words = [(w, "O") for w in rng.choices(WORDS, k=rng.randint(4, 10))]
            for _ in range(rng.randint(1, 2)):
                kind = rng.choice(sorted(ENTITIES))
                entity = rng.choice(ENTITIES[kind])
                at = rng.randrange(len(words) + 1)
                words[at:at] = [(w, ("B-" if i == 0 else "I-") + kind) for i, w in enumerate(entity)]
            sentences.append(words)
        if n:
            splits[name] = sentences
    if layout == "saved":
        import datasets

        names = ["O", *(f"{p}-{kind}" for kind in sorted(ENTITIES) for p in "BI")]
        features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                      "ner_tags": datasets.Sequence(datasets.ClassLabel(names=names))})
        datasets.DatasetDict({name: datasets.Dataset.from_dict(
            {"tokens": [[w for w, _ in s] for s in sentences],
             "ner_tags": [[names.index(t) for _, t in s] for s in sentences]}, features)
            for name, sentences in splits.items()}).save_to_disk(str(folder))
        return
    folder.mkdir(parents=True)
    for name, sentences in splits.items():
        lines = ["-DOCSTART- -X- -X- O", ""]
        for words in sentences:
            lines += [f"{w} NN O {tag}" for w, tag in words] + [""]
        (folder / {"train": "train.txt", "validation": "valid.txt", "test": "test.txt"}[name]).write_text(
            "\n".join(lines))


def _eval(model, data, out, *extra, check=True):
    return run_cli("bert_ds.eval", "ner", "--model", str(model), "--data", str(data), "--output", str(out),
                   "--no-progress", "--max-seq-length", "32", *extra, check=check)


def test_a_tiny_export_learns_a_tagging_task_and_a_rerun_keeps_its_results(tiny_export, tmp_path):  # noqa: F811
    data, out = tmp_path / "conll2003", tmp_path / "results"
    learnable_conll(data, layout="saved")  # the column files run in the docs and phase-plan tests
    args = ("--seeds", "1", "--lr", "3e-3", "--epochs", "8")
    first = _eval(tiny_export, data, out, *args)
    assert "train_runtime" not in first.stdout + first.stderr  # the Trainer's own summary dict
    report = json.loads((out / "results.json").read_text())
    run = json.loads((out / "ner" / "seed1.json").read_text())
    print(f"NER made-up tagging task, tiny export: dev F1 {run['scores']['dev']['f1']:.1f}, test F1 "
          f"{run['scores']['test']['f1']:.1f}, {run['steps']} steps, {run['seconds']:.0f} s")
    assert report["labels"] == ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]  # the dataset's ids, in its order
    for split in ("dev", "test"):  # chance: an entity's exact span and type by luck, near 0
        assert report["columns"][split]["figures"]["f1"]["min"] >= 60.0, report["columns"][split]
    assert set(run["scores"]["dev"]["per_type"]) == {"LOC", "PER"}
    assert "| dev | 60 |" in (out / "results.md").read_text()
    before = (out / "ner" / "seed1.json").read_text()
    again = _eval(tiny_export, data, out, *args)
    assert "kept from an earlier run" in again.stdout and (out / "ner" / "seed1.json").read_text() == before


def test_bad_data_and_folders_are_one_line_and_train_nothing(tiny_export, tmp_path):  # noqa: F811
    data = tmp_path / "conll"
    learnable_conll(data)
    lines = (data / "valid.txt").read_text().splitlines()
    lines[2] = lines[2].rsplit(" ", 1)[0] + " B-ORG"  # a tag the training set never uses
    (data / "valid.txt").write_text("\n".join(lines))
    proc = _eval(tiny_export, data, tmp_path / "a", check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "valid.txt:3: tag 'B-ORG' is not among" in err[0], proc.stderr
    assert not (tmp_path / "a").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.json").write_text("{}")
    proc = _eval(tiny_export, data, mine, check=False)
    assert proc.returncode == 2 and "holds no NER results" in proc.stderr


def test_ctrl_c_keeps_the_finished_runs_and_says_so_in_one_line(tiny_export, tmp_path):  # noqa: F811
    """Ctrl-C (SIGINT to the terminal's process group) once the first of ten seeds is done: exit
    130, one line naming what is kept, no traceback; every kept seed's file is whole. Three
    seeds left a window of two (~6 s), which a loaded machine once missed; ten leave nine."""
    data, out = tmp_path / "conll", tmp_path / "results"
    learnable_conll(data, sizes=(64, 16, 0))
    child = spawn([sys.executable, "-m", "bert_ds.eval", "ner", "--model", str(tiny_export), "--data", str(data),
                   "--output", str(out), "--no-progress", "--max-seq-length", "32", "--epochs", "40", "--seeds", "10"],
                  env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                  preexec_fn=stop_signals_at_default)
    try:
        deadline = time.monotonic() + 300
        while not (out / "ner" / "seed1.json").is_file() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / "ner" / "seed1.json").is_file(), "the first seed did not finish"
        # the child's signal masks (ignored, caught) when Ctrl-C comes: evidence should it be lost
        masks = [line for line in Path(f"/proc/{child.pid}/status").read_text().splitlines() if line.startswith("Sig")]
        os.killpg(child.pid, signal.SIGINT)
        stdout, stderr = child.communicate(timeout=120)
    finally:
        end(child)
    assert child.returncode == 130, (masks, stdout[-2000:] + stderr[-2000:])
    assert "Traceback" not in stderr
    kept = sorted(int(p.stem[len("seed"):]) for p in (out / "ner").glob("seed*.json"))
    assert kept == list(range(1, len(kept) + 1)) and len(kept) < 10, kept
    assert stderr.strip().splitlines()[-1] == (f"interrupted: {len(kept)} finished run(s) kept in {out}; the same "
                                               "command goes on from them")
    assert [json.loads((out / "ner" / f"seed{s}.json").read_text())["seed"] for s in kept] == kept