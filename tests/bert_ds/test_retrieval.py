"""``python -m bert_ds.eval retrieval`` on a made-up BEIR-format task (tests/assets/retrieval/tiny-beir:
120 documents of invented words; a query names a document's kind and one of its two rare words):
a 2-layer model fine-tuned for a few steps beats its own zero-shot score, its runs are TREC run
files scored by trec_eval's measures, the saved sentence-transformers folder ranks as the run
did; the measures equal pytrec_eval's (MRR@10 cut at 10, trec_eval's order of ties); each bad
input is one line and trains nothing."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest

from bert_ds.eval.retrieval_metrics import ranked, read_run, score, write_run
from tests.conftest import REPO, run_cli

TASK = REPO / "tests" / "assets" / "retrieval" / "tiny-beir"
# sentence-transformers, datasets and pytrec_eval under the lowest and newest supported releases too
pytestmark = pytest.mark.lowest


# --------------------------------------------------------------------------- the measures

def _random_case(seed: int, queries: int = 30, docs: int = 60, depth: int = 40):
    rng = random.Random(seed)
    doc_ids = [f"d{i}" for i in range(docs)]
    qrels = {f"q{q}": {d: rng.choice([0, 1, 1, 2]) for d in rng.sample(doc_ids, rng.randint(1, 6))}
             for q in range(queries)}
    # scores of one decimal: ties, which trec_eval breaks by document id
    run = {qid: {d: round(rng.random(), 1) for d in rng.sample(doc_ids, depth)} for qid in qrels if qid != "q0"}
    return qrels, run


def _mrr_at_10(qrels, run) -> float:
    """MRR@10 from its definition: per query, 1 / the rank of the first relevant document among
    the first 10 in trec_eval's order (score, then document id, both descending), else 0."""
    total = 0.0
    for qid, graded in qrels.items():
        by_id = sorted(run.get(qid, {}).items(), key=lambda item: item[0], reverse=True)
        order = sorted(by_id, key=lambda item: item[1], reverse=True)  # stable: a tie keeps the id order
        first = next((rank for rank, (doc, _) in enumerate(order[:10], 1) if graded.get(doc, 0) > 0), None)
        total += 1.0 / first if first else 0.0
    return total / len(qrels)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_measures_are_pytrec_evals_and_mrr_is_cut_at_10(seed, tmp_path):
    import pytrec_eval

    qrels, run = _random_case(seed)
    got = score(qrels, run)
    direct = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"}).evaluate(run)
    # a query the run does not rank (q0) counts 0 in the mean, as trec_eval -c counts it
    for measure, name in (("ndcg@10", "ndcg_cut_10"), ("recall@100", "recall_100")):
        assert got[measure] == pytest.approx(sum(r[name] for r in direct.values()) / len(qrels), abs=1e-12)
    assert got["mrr@10"] == pytest.approx(_mrr_at_10(qrels, run), abs=1e-12)
    # where no query has more than 10 documents, MRR@10 is trec_eval's recip_rank itself (its own tie order)
    short = {qid: dict(ranked(docs)[:10]) for qid, docs in run.items()}
    reciprocal = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(short)
    assert score(qrels, short)["mrr@10"] == pytest.approx(
        sum(r["recip_rank"] for r in reciprocal.values()) / len(qrels), abs=1e-12)
    # and a run file scores as the run it was written from
    write_run(tmp_path / "dev.run", run, tag="test")
    lines = (tmp_path / "dev.run").read_text().splitlines()
    assert lines[0].split()[1] == "Q0" and lines[0].split()[3] == "1" and len(lines) == sum(map(len, run.values()))
    assert score(qrels, read_run(tmp_path / "dev.run")) == pytest.approx(got, abs=1e-6)


@pytest.mark.parametrize("other", ["d3", "d10", "c9"])
def test_a_tie_is_ordered_as_trec_eval_orders_it(other):
    import pytrec_eval

    run = {"q": {"d1": 0.5, other: 0.5}}
    theirs = pytrec_eval.RelevanceEvaluator({"q": {"d1": 1}}, {"recip_rank"}).evaluate(run)["q"]["recip_rank"]
    ours = 1.0 / (1 + [doc for doc, _ in ranked(run["q"])].index("d1"))
    assert ours == theirs and ours == (0.5 if other > "d1" else 1.0)


# --------------------------------------------------------------------------- the command

@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> Path:
    """A 2-layer BERT at random init, exported with a WordPiece vocabulary of the task's words."""
    import torch
    import transformers

    from bert_ds.checkpoint.export import export_hf
    from bert_ds.model.build import build_model
    from bert_ds.model.families import model_preset

    root = tmp_path_factory.mktemp("retrieval-model")
    words = set()
    for name in ("corpus.jsonl", "queries.jsonl"):
        for line in (TASK / name).read_text().splitlines():
            row = json.loads(line)
            words.update(f"{row.get('title', '')} {row['text']}".split())
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]
    transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(root / "tokenizer")
    config = model_preset("tiny", len(vocab), max_position_embeddings=64, kernels="torch", pad_token_id=0,
                          cls_token_id=2, sep_token_id=3, mask_token_id=4)
    torch.manual_seed(0)
    return export_hf(build_model(config).state_dict(), config, root / "tokenizer", root / "hf")


def _retrieval(model: Path, out: Path, *extra: str, data: Path = TASK, check: bool = True):
    return run_cli("bert_ds.eval", "retrieval", "--model", str(model), "--data", str(data), "--output", str(out),
                   "--max-seq-length", "32", "--no-progress", *extra, check=check, timeout=600)


@pytest.mark.long
def test_fine_tuning_beats_the_zero_shot_score_and_saves_a_sentence_transformers_folder(tiny_export, tmp_path):
    from sentence_transformers import SentenceTransformer

    from bert_ds.eval.retrieval import search

    zero = _retrieval(tiny_export, tmp_path / "zero", "--no-finetune")
    assert "retrieval-zero-shot seed 1: dev nDCG@10" in zero.stdout
    before = json.loads((tmp_path / "zero" / "results.json").read_text())["columns"]
    args = ("--seeds", "2", "--lr", "1e-3", "--epochs", "4", "--batch-size", "16")
    _retrieval(tiny_export, tmp_path / "ft", *args)
    report = json.loads((tmp_path / "ft" / "results.json").read_text())
    after = report["columns"]
    assert set(after) == {"dev", "test"} and after["dev"]["queries"] == 40 and report["train_examples"] == 160
    for split in ("dev", "test"):
        print(f"\n{split}: nDCG@10 zero-shot {before[split]['figures']['ndcg@10']['median']:.4f}, "
              f"fine-tuned {after[split]['figures']['ndcg@10']['median']:.4f}")
        assert after[split]["figures"]["ndcg@10"]["min"] > 2 * before[split]["figures"]["ndcg@10"]["median"]
    assert "| dev | 40 |" in (tmp_path / "ft" / "results.md").read_text()

    seed1 = json.loads((tmp_path / "ft" / "retrieval" / "seed1.json").read_text())
    qrels = {}
    for split in ("dev", "test"):
        for line in (TASK / "qrels" / f"{split}.tsv").read_text().splitlines()[1:]:
            qid, doc, grade = line.split("\t")
            qrels.setdefault(split, {}).setdefault(qid, {})[doc] = int(grade)
        ran = read_run(Path(seed1["run_files"][split]))
        assert score(qrels[split], ran) == pytest.approx(seed1["scores"][split], abs=1e-6)
    # the saved folder is a sentence-transformers model that ranks as the run did
    folder = Path(seed1["model_folder"])
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    assert pooling.get("pooling_mode") == "mean" or pooling.get("pooling_mode_mean_tokens") is True  # 6.x, 5.x
    assert (folder / "modules.json").is_file()
    loaded = SentenceTransformer(str(folder), device="cpu")
    corpus = [json.loads(line) for line in (TASK / "corpus.jsonl").read_text().splitlines()]
    queries = {row["_id"]: row["text"] for row in map(json.loads, (TASK / "queries.jsonl").read_text().splitlines())}
    docs = loaded.encode([f"{r['title']} {r['text']}" for r in corpus], convert_to_tensor=True,
                         normalize_embeddings=True)
    ids = sorted(qrels["dev"])
    again = search(loaded.encode([queries[q] for q in ids], convert_to_tensor=True, normalize_embeddings=True),
                   docs, ids, [r["_id"] for r in corpus], 1000)
    assert score(qrels["dev"], again) == pytest.approx(seed1["scores"]["dev"], abs=1e-6)

    rerun = _retrieval(tiny_export, tmp_path / "ft", *args)
    assert rerun.stdout.count("kept from an earlier run") == 2


def _task_copy(tmp_path: Path) -> Path:
    data = tmp_path / "task"
    shutil.copytree(TASK, data)
    return data


@pytest.mark.parametrize("plant,message", [
    (lambda d: (d / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq80\td80\t1\nq81\td999\t1\n"),
     r"qrels/dev.tsv:3: corpus-id 'd999' is not in corpus.jsonl"),
    (lambda d: (d / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nnope\td1\t1\n"),
     r"qrels/test.tsv:2: query-id 'nope' is not in queries.jsonl"),
    (lambda d: (d / "queries.jsonl").write_text(""), r"queries.jsonl: no queries"),
    (lambda d: (d / "corpus.jsonl").write_text('{"_id": "d0", "text": "a"}\n{"_id": "d1", "text": \n'),
     r"corpus.jsonl:2: not a line of JSON"),
    (lambda d: (d / "qrels" / "train.tsv").unlink(), r"no qrels/train.tsv to fine-tune on"),
], ids=["qrel-document", "qrel-query", "empty-queries", "malformed-jsonl", "no-training-data"])
def test_bad_data_is_one_line_naming_file_and_line_and_trains_nothing(tiny_export, tmp_path, plant, message):
    data = _task_copy(tmp_path)
    plant(data)
    proc = _retrieval(tiny_export, tmp_path / "out", data=data, check=False)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and re.search(message, line), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content,suffix,message", [
    ('{"query": "a", "positive": "b"}\n{"query": "a"}\n', ".jsonl", r"train.jsonl:2: needs \"query\" and \"positive\""),
    ("a query\ta positive\ta negative\textra\n", ".tsv", r"train.tsv:1: a line is query, positive\[, negative\]"),
    (None, ".tsv", r"--train .*train.tsv: no such file or folder"),
    ("query,positive\n", ".csv", r"train.csv: not a .tsv of triples, a .jsonl or a datasets folder"),
])
def test_bad_training_data_is_one_line(tiny_export, tmp_path, content, suffix, message):
    train = tmp_path / f"train{suffix}"
    if content is not None:
        train.write_text(content)
    proc = _retrieval(tiny_export, tmp_path / "out", "--train", str(train), check=False)
    assert proc.returncode == 2 and re.search(message, proc.stderr), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_model_of_no_supported_family_is_one_line(tmp_path, tiny_export):
    model = tmp_path / "gpt2"
    shutil.copytree(tiny_export, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    proc = _retrieval(model, tmp_path / "out", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"--model {model}: model_type 'gpt2'" in proc.stderr and "bert or modernbert" in proc.stderr
    assert not (tmp_path / "out").exists()


def _training_files(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, str]]:
    """The task's training pairs as people have them: triples (the first 40 with a hard negative),
    a JSONL with hard negatives, a datasets folder; and the documents' texts."""
    from datasets import Dataset

    corpus = {json.loads(line)["_id"]: json.loads(line) for line in (TASK / "corpus.jsonl").read_text().splitlines()}
    queries = {json.loads(line)["_id"]: json.loads(line)["text"]
               for line in (TASK / "queries.jsonl").read_text().splitlines()}
    text = {d: f"{r['title']} {r['text']}" for d, r in corpus.items()}
    triples = tmp_path / "triples.tsv"
    triples.write_text("".join(f"{queries[f'q{i}']}\t{text[f'd{i}']}\t{text[f'd{(i + 1) % 80}']}\n" for i in range(40))
                       + "".join(f"{queries[f'q{i}']}\t{text[f'd{i}']}\n" for i in range(40, 80)))
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"query": queries[f"r{i}"], "positive": text[f"d{i}"],
                                         "negatives": [text[f"d{(i + 7) % 80}"]]}) + "\n" for i in range(80)))
    saved = tmp_path / "train-dataset"
    Dataset.from_dict({"query": [queries[f"q{i}"] for i in range(80)], "positive": [text[f"d{i}"] for i in range(80)],
                       "negative": [text[f"d{(i + 3) % 80}"] for i in range(80)]}).save_to_disk(str(saved))
    return triples, jsonl, saved, text


def test_training_data_as_people_have_it_reads_as_its_examples(tmp_path):
    from bert_ds.eval.retrieval_data import read_retrieval

    triples, jsonl, saved, text = _training_files(tmp_path)
    read = {path.name: read_retrieval(TASK, path).train for path in (triples, jsonl, saved)}
    assert {name: len(examples) for name, examples in read.items()} == {
        "triples.tsv": 80, "train.jsonl": 80, "train-dataset": 80}
    assert read["triples.tsv"][0].negatives == (text["d1"],) and read["triples.tsv"][79].negatives == ()
    assert read["train.jsonl"][5].negatives == (text["d12"],) and read["train-dataset"][2].negatives == (text["d5"],)
    assert read["train-dataset"][2].positive == text["d2"]
    assert len(read_retrieval(TASK).train) == 160  # the folder's qrels/train.tsv


@pytest.mark.long
def test_pairs_and_triples_in_one_set_fine_tune(tiny_export, tmp_path):
    """Triples with and without a hard negative: two datasets the trainer draws from in turn."""
    triples, _, _, _ = _training_files(tmp_path)
    proc = _retrieval(tiny_export, tmp_path / "out", "--train", str(triples), "--seeds", "1", "--lr", "1e-3",
                      "--epochs", "1", "--batch-size", "16")
    assert "retrieval seed 1: dev nDCG@10" in proc.stdout
    assert json.loads((tmp_path / "out" / "results.json").read_text())["train"] == str(triples)
