"""python -m bert_ds.eval glue: GLUE data in each layout users have, the metrics against
hand-computed values, a task a tiny export learns, a rerun that keeps what is done, and bad
input as one line."""

import json
import math
import random

import pytest
import torch

from bert_ds.checkpoint.export import export_hf
from bert_ds.data_tools.manifest import Manifest
from bert_ds.eval import finetune, metrics
from bert_ds.eval.glue_data import TASKS, GlueDataError, read_split
from bert_ds.eval.recipe import load as load_recipe
from bert_ds.model.bert.model import BertForPreTraining
from bert_ds.model.families import model_preset
from tests.conftest import run_cli

WORDS = "the of and in to was for on as with by he at from his an were is which it".split()


def _rows(task, n, seed):
    """``n`` examples of ``task``: texts, and labels as the Hugging Face layouts hold them."""
    rng = random.Random(seed)
    texts = [tuple(" ".join(rng.choices(WORDS, k=rng.randint(3, 9))) for _ in task.columns) for _ in range(n)]
    labels = ([round(rng.uniform(0, 5), 2) for _ in range(n)] if task.labels is None
              else [rng.randrange(task.num_labels) for _ in range(n)])
    return texts, labels


def _classic(folder, task, splits):
    """The classic GLUE files: headers as GLUE ships them (CoLA: none; MRPC: with a byte-order mark)."""
    folder.mkdir(parents=True)
    for file, (texts, labels) in splits.items():
        raw = [str(x) if task.labels is None else task.labels[x] for x in labels]
        if task.name == "cola":
            lines = [f"gj04\t{y}\t\t{t[0]}" for t, y in zip(texts, raw)]
        elif task.name == "mrpc":
            lines = ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"] + [
                f"{y}\t1\t2\t{a}\t{b}" for (a, b), y in zip(texts, raw)]
        else:
            header = ["index", *task.tsv_columns, task.tsv_label]
            lines = ["\t".join(header)] + [f"{i}\t" + "\t".join(t) + f"\t{y}" for i, (t, y) in enumerate(zip(texts, raw))]
        (folder / file).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _table(task, texts, labels):
    import pyarrow as pa
    return pa.table({**{c: [t[i] for t in texts] for i, c in enumerate(task.columns)}, "label": labels,
                     "idx": list(range(len(labels)))})


def _parquet(folder, task, splits):
    import pyarrow.parquet as pq
    folder.mkdir(parents=True)
    for split, (texts, labels) in splits.items():
        pq.write_table(_table(task, texts, labels), folder / f"{split}-00000-of-00001.parquet")


def _saved(folder, task, splits):
    import datasets
    datasets.DatasetDict({split: datasets.Dataset(_table(task, *rows)) for split, rows in splits.items()}
                         ).save_to_disk(str(folder))


@pytest.mark.parametrize("name", ["cola", "mrpc", "stsb", "mnli"])
def test_the_three_layouts_read_alike(tmp_path, name):
    task = TASKS[name]
    train, dev = _rows(task, 12, 1), _rows(task, 5, 2)
    hf_splits = {"train": train, **{hf: dev for _, _, hf in task.evals}}
    classic_files = {"train.tsv": train, **{file: dev for _, file, _ in task.evals}}
    _classic(tmp_path / "classic" / task.classic, task, classic_files)
    _parquet(tmp_path / "parquet" / task.name, task, hf_splits)
    _saved(tmp_path / "saved" / task.name, task, hf_splits)
    for layout in ("classic", "parquet", "saved"):
        for split, (texts, labels) in [("train", train)] + [(n, dev) for n, _, _ in task.evals]:
            examples = read_split(tmp_path / layout, task, split)
            assert examples.texts == texts and examples.labels == labels, (layout, split)


@pytest.mark.parametrize("content,message", [
    ("sentence\tlabel\nthe cat\t2\n", "train.tsv:2: label '2' is not one of sst2's 0, 1"),
    ("sentence\tlabel\nthe cat\n", "train.tsv:2: 1 tab-separated fields, 2 expected"),
    ("text\tlabel\nthe cat\t1\n", "train.tsv: no column 'sentence' in its header"),
    ("sentence\tlabel\n", "train.tsv: no examples"),
])
def test_bad_classic_data_names_the_file_and_line(tmp_path, content, message):
    (tmp_path / "SST-2").mkdir()
    (tmp_path / "SST-2" / "train.tsv").write_text(content)
    with pytest.raises(GlueDataError, match=message):
        read_split(tmp_path, TASKS["sst2"], "train")


def test_bad_hugging_face_data_is_one_line(tmp_path):
    task = TASKS["rte"]
    texts, _ = _rows(task, 3, 0)
    _parquet(tmp_path / "rte", task, {"train": (texts, [0, 1, -1])})
    with pytest.raises(GlueDataError, match=r"row 2: label -1 is not an id in \[0, 2\) \(a test split's -1 labels"):
        read_split(tmp_path, task, "train")
    with pytest.raises(GlueDataError, match="no validation\\*.parquet"):
        read_split(tmp_path, task, "rte")
    import pyarrow.parquet as pq
    pq.write_table(_table(task, texts, [0, 1, 1]).drop(["sentence2"]), tmp_path / "rte" / "train-00000-of-00001.parquet")
    with pytest.raises(GlueDataError, match="no column 'sentence2'"):
        read_split(tmp_path, task, "train")


def test_metrics_against_hand_computed_values():
    # confusion: tp 3, tn 2, fp 1, fn 2 -> MCC (3*2 - 1*2) / sqrt(4*5*3*4) = 4 / sqrt(240)
    labels = [1, 1, 1, 1, 1, 0, 0, 0]
    predictions = [1, 1, 1, 0, 0, 1, 0, 0]
    mcc = metrics.scores("matthews", predictions, labels)
    assert mcc["score"] == pytest.approx(100 * 4 / math.sqrt(240)) and mcc["accuracy"] == pytest.approx(62.5)
    f1 = metrics.scores("f1", predictions, labels)  # precision 3/4, recall 3/5
    assert f1["score"] == pytest.approx(100 * 2 * 0.75 * 0.6 / (0.75 + 0.6))
    sts = metrics.scores("spearman", [1.0, 2.0, 3.0, 5.0], [0.5, 1.0, 4.0, 2.0])
    assert sts["spearman"] == pytest.approx(100 * (1 - 6 * (0 + 0 + 1 + 1) / (4 * 15)))  # ranks 1234 vs 1243
    assert sts["pearson"] == pytest.approx(100 * torch.corrcoef(torch.tensor([[1.0, 2, 3, 5], [0.5, 1, 4, 2]]))[0, 1].item(),
                                           rel=1e-5)
    assert metrics.scores("spearman", [2.0, 2.0, 2.0], [1.0, 2.0, 3.0])["score"] == 0.0
    value, missing = metrics.average({name: 80.0 for name in metrics.AVERAGE_OF[:-1]} | {"rte": 62.0})
    assert value == pytest.approx((8 * 80 + 62) / 9) and missing == []


def test_recipes_load_and_refuse_bad_values(tmp_path):
    paper = load_recipe("bert_paper")
    assert (paper.learning_rate, paper.batch_size, paper.epochs, paper.warmup_ratio) == (2e-5, 32, 3, 0.1)
    roberta = load_recipe("roberta_style")
    assert roberta.for_task("rte").batch_size == 16 and roberta.for_task("sst2").batch_size == 32
    assert roberta.with_overrides(batch_size=8).for_task("rte").batch_size == 8  # the command line wins
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**paper.to_dict(), "learning_rate": 3}))
    with pytest.raises(Exception, match="learning_rate: must be in"):
        load_recipe(str(bad))
    with pytest.raises(Exception, match="no such recipe file"):
        load_recipe("nonexistent")


@pytest.fixture(scope="module")
def tiny_export(sample_data, tmp_path_factory):
    """A tiny untrained bert_ds model, exported with the sample data's tokenizer."""
    torch.manual_seed(0)
    config = model_preset("tiny", Manifest.load(sample_data["train"]).vocab_size, kernels="torch")
    return export_hf(BertForPreTraining(config).state_dict(), config, sample_data["train"],
                     tmp_path_factory.mktemp("export") / "model")


def learnable_sst2(root, seed=0):
    """SST-2 in the classic layout whose label is whether 'good' or 'bad' is in the sentence."""
    rng = random.Random(seed)
    folder = root / "SST-2"
    folder.mkdir(parents=True)
    for file, n in (("train.tsv", 480), ("dev.tsv", 160)):
        rows = ["sentence\tlabel"]
        for _ in range(n):
            label = rng.randrange(2)
            words = rng.choices(WORDS, k=rng.randint(4, 10))
            words.insert(rng.randrange(len(words)), "good" if label else "bad")
            rows.append(f"{' '.join(words)}\t{label}")
        (folder / file).write_text("\n".join(rows) + "\n")


def _eval(model, data, out, *extra, check=True):
    return run_cli("bert_ds.eval", "glue", "--model", str(model), "--data", str(data), "--output", str(out),
                   "--no-progress", *extra, check=check)


@pytest.mark.lowest
def test_a_tiny_export_learns_a_task_and_a_rerun_keeps_its_results(tiny_export, tmp_path):
    data, out = tmp_path / "glue", tmp_path / "results"
    learnable_sst2(data)
    args = ("--tasks", "sst2", "--seeds", "2", "--lr", "1e-3", "--epochs", "3")
    first = _eval(tiny_export, data, out, *args)
    assert "train_runtime" not in first.stdout + first.stderr  # the Trainer's own summary dict
    report = json.loads((out / "results.json").read_text())
    column = report["columns"]["sst2"]
    assert column["seeds"] == 2 and column["figures"]["score"]["min"] >= 80.0  # chance: 50
    assert report["average_missing"] == [name for name in metrics.AVERAGE_OF if name != "sst2"]
    runs = [json.loads((out / "sst2" / f"seed{s}.json").read_text()) for s in (1, 2)]
    assert [r["steps"] for r in runs] == [45, 45] and runs[0]["recipe"]["learning_rate"] == 1e-3
    assert "| sst2 | accuracy |" in (out / "results.md").read_text()

    before = {p.name: p.read_text() for p in (out / "sst2").iterdir()}
    again = _eval(tiny_export, data, out, *args)
    assert again.stdout.count("kept from an earlier run") == 2
    assert {p.name: p.read_text() for p in (out / "sst2").iterdir()} == before
    other = _eval(tiny_export, data, out, "--tasks", "sst2", "--seeds", "2", "--lr", "2e-3", "--epochs", "3",
                  check=False)
    assert other.returncode == 2 and "made from another model, data or recipe" in other.stderr
    assert {p.name: p.read_text() for p in (out / "sst2").iterdir()} == before


@pytest.mark.lowest
def test_the_trainer_keeps_its_bar_and_prints_no_summary_dict(tmp_path, capsys):
    """transformers' Trainer prints ``{'train_runtime': ...}`` at the end of a run, through its
    progress bar or, without one, its printer callback; ``quiet_trainer`` prints neither."""
    import transformers

    config = transformers.BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                     intermediate_size=8)
    recipe = load_recipe("bert_paper").with_overrides(batch_size=2, epochs=1)
    data = [{"input_ids": [1, 2, 3], "labels": 0}] * 4
    for progress in (True, False):
        args = finetune.training_arguments(recipe, 1, torch.device("cpu"), progress, str(tmp_path))
        for build, summary in ((transformers.Trainer, True), (finetune.quiet_trainer, False)):
            tuner = build(model=transformers.BertForSequenceClassification(config), args=args, train_dataset=data)
            tuner.train()
            printed = capsys.readouterr()
            assert ("train_runtime" in printed.out + printed.err) is summary, (build, progress)
        assert [type(c).__name__ for c in tuner.callback_handler.callbacks].count("ProgressBar") == progress


def test_sts_b_regression_and_mnli_two_dev_sets_run_end_to_end(tiny_export, tmp_path):
    """STS-B (one output, mean squared error, Pearson/Spearman) from save_to_disk, MNLI (three
    labels, matched and mismatched dev sets) from Parquet: every dev set scored, in the table."""
    stsb, mnli = TASKS["stsb"], TASKS["mnli"]
    _saved(tmp_path / "glue" / "stsb", stsb, {"train": _rows(stsb, 40, 1), "validation": _rows(stsb, 20, 2)})
    _parquet(tmp_path / "glue" / "mnli", mnli, {"train": _rows(mnli, 40, 3), "validation_matched": _rows(mnli, 12, 4),
                                                "validation_mismatched": _rows(mnli, 14, 5)})
    out = tmp_path / "results"
    _eval(tiny_export, tmp_path / "glue", out, "--tasks", "stsb,mnli", "--seeds", "1", "--epochs", "1")
    report = json.loads((out / "results.json").read_text())
    assert list(report["columns"]) == ["stsb", "mnli-m", "mnli-mm"]
    assert set(report["columns"]["stsb"]["figures"]) == {"score", "pearson", "spearman"}
    run = json.loads((out / "mnli" / "seed1.json").read_text())
    assert run["eval_examples"] == {"mnli-m": 12, "mnli-mm": 14} and run["steps"] == 2  # 40 examples, batch 32


@pytest.mark.parametrize("args,message", [
    (["--tasks", "wnli"], "wnli is left out, as in the BERT paper"),
    (["--tasks", "squad"], "unknown task 'squad'"),
    (["--tasks", "sst2,rte"], "no folder for rte (looked for RTE/ and rte/)"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--recipe", "nope"], "--recipe nope: no such recipe file"),
])
def test_bad_input_is_one_line_and_trains_nothing(tiny_export, tmp_path, args, message):
    data, out = tmp_path / "glue", tmp_path / "results"
    learnable_sst2(data)
    proc = _eval(tiny_export, data, out, "--tasks", "sst2", *args, check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], proc.stderr
    assert not (out / "sst2").exists()


def test_an_output_folder_of_other_files_is_refused_and_left_as_it_was(tiny_export, tmp_path):
    data, out = tmp_path / "glue", tmp_path / "mine"
    learnable_sst2(data)
    out.mkdir()
    (out / "results.json").write_text('{"my": "own results"}')
    proc = _eval(tiny_export, data, out, "--tasks", "sst2", check=False)
    assert proc.returncode == 2 and "exists and holds no GLUE results" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["results.json"] and "own results" in (out / "results.json").read_text()


def test_a_folder_without_config_json_is_refused(tmp_path):
    proc = _eval(tmp_path, tmp_path, tmp_path / "out", check=False)
    assert proc.returncode == 2 and "not a Hugging Face model folder (no config.json)" in proc.stderr
