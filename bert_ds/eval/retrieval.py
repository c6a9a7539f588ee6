"""``python -m bert_ds.eval retrieval``: fine-tune a model as a bi-encoder and score its retrieval.

    python -m bert_ds.eval retrieval --model DIR --data DIR --output DIR
                                     [--train FILE|DIR] [--no-finetune] [--seeds 3]
                                     [--recipe single_vector] [--lr X] [--epochs N]
                                     [--batch-size N] [--max-seq-length 512]

``--model`` is a bert_ds export or a Hugging Face BERT or ModernBERT folder; ``--data`` a
BEIR-format folder (:mod:`bert_ds.eval.retrieval_data`), read and checked before anything
trains. Each seed is one run:

- **the bi-encoder** is sentence-transformers' own of a transformers folder (its encoder, the
  pretraining heads left out, and mean pooling): one encoder for queries and documents, cosine
  similarity;
- **fine-tuning** is its ``SentenceTransformerTrainer`` with ``MultipleNegativesRankingLoss``:
  each query against its positive, the batch's other positives and the example's hard negatives
  where the training data has them (as many per example as the example with the fewest has);
  batches without duplicate texts (a duplicate would be its own in-batch negative);
- **retrieval** encodes the corpus and each split's queries (sentence-transformers sorts a
  list by length and encodes it in batches of like lengths, so padding stays small at 8,192
  tokens too; a progress bar over each), and ranks every document by exact cosine similarity,
  keeping each query's top 1,000;
- **scores**: each ranking is written as a TREC run file (``OUTPUT/retrieval/seedN/SPLIT.run``)
  and scored by trec_eval's measures through ``pytrec_eval``
  (:mod:`bert_ds.eval.retrieval_metrics`): nDCG@10, Recall@100, MRR@10;
- the fine-tuned bi-encoder is saved as a sentence-transformers folder
  (``OUTPUT/retrieval/seedN/model``: ``modules.json``, ``1_Pooling/config.json``), which
  ``SentenceTransformer(path)`` loads as it was.

``--no-finetune`` scores the model as it is, mean-pooled (the zero-shot figure; one run, in
``OUTPUT/retrieval-zero-shot``). Results go to ``results.md`` and ``results.json``, the median
and min-max over seeds, as for the other evaluations; a rerun keeps the runs already done.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_ds.base.errors import UserError
from bert_ds.eval import recipe as recipes, runs
from bert_ds.eval.retrieval_data import RetrievalData, TrainExample, read_retrieval
from bert_ds.eval.retrieval_metrics import score, write_run

TASK = "retrieval"
ZERO_SHOT = "retrieval-zero-shot"
TOP_K = 1000  # documents ranked per query: Recall@100 and the run files need no more
DEFAULT_RECIPE = "single_vector"


def add_arguments(p: argparse.ArgumentParser) -> None:
    runs.add_common_arguments(p, data="a BEIR-format folder: corpus.jsonl, queries.jsonl, qrels/dev.tsv and/or "
                                      "qrels/test.tsv (qrels/train.tsv: what it fine-tunes on without --train)",
                              recipes="retrieval", length="query and document length (512)")
    p.set_defaults(recipe=DEFAULT_RECIPE)
    p.add_argument("--train", type=Path, default=None,
                   help="training data instead of the folder's qrels/train.tsv: MS MARCO-style triples (.tsv: query, "
                        "positive, negative), a .jsonl of {query, positive, negatives}, or a datasets folder")
    p.add_argument("--no-finetune", action="store_true",
                   help="score the model as it is, mean-pooled (the zero-shot figure)")


STAGE_KEYS = {**runs.STAGE_KEYS, "train": str}


def stage_args(values: Any, model: Path, output: Path) -> argparse.Namespace:
    """A phase plan's ``"evaluate": {"retrieval": {...}}`` as this command's arguments: ``data``
    required; ``train`` (a path), ``seeds``, ``seed``, ``recipe``, ``lr``, ``epochs``,
    ``batch_size``, ``max_seq_length`` as the flags; the model and output come from the plan."""
    args = runs.stage_args(TASK, add_arguments, values, model, output, STAGE_KEYS)
    if isinstance(args.train, str):
        args.train = Path(args.train)
    return args


@dataclass
class Prepared:
    """A retrieval evaluation checked and read, before anything trains."""

    data: RetrievalData
    recipe: recipes.Recipe
    seeds: list[int]
    identity: dict[str, str]
    task: str  # TASK, or ZERO_SHOT with --no-finetune


def prepare(args: argparse.Namespace, *, model_exists: bool = True) -> Prepared:
    """Every input checked and read (``model_exists=False``: a phase plan's export, still to be made)."""
    runs.check_inputs(args, _ours_or_empty, model_exists=model_exists)
    recipe = recipes.load(args.recipe, recipes.RETRIEVAL_RECIPES).with_overrides(
        learning_rate=args.lr, epochs=args.epochs, batch_size=args.batch_size,
        max_seq_length=args.max_seq_length).for_task(TASK)
    data = read_retrieval(args.data, args.train, need_train=not args.no_finetune)
    if model_exists:
        check_family(args.model)
        runs.check_length(args.model, recipe.max_seq_length)
        runs.check_tokenizer(args.model)  # last: imports transformers
    identity = {"model": str(args.model.resolve()), "data": str(args.data.resolve()),
                "train": "" if args.no_finetune else data.train_source}
    seeds = [args.seed] if args.no_finetune else list(range(args.seed, args.seed + args.seeds))
    return Prepared(data, recipe, seeds, identity, ZERO_SHOT if args.no_finetune else TASK)


def check_family(model: Path) -> None:
    """``model`` is a model of a family bert-ds has (its config.json's ``model_type``), or one line says what it is."""
    from bert_ds.model.families import FAMILIES

    supported = sorted(family.hf.model_type for family in FAMILIES.values())
    try:
        model_type = json.loads((model / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"--model {model}: config.json is unreadable ({e})") from None
    if model_type not in supported:
        raise UserError(f"--model {model}: model_type {model_type!r} in its config.json; retrieval takes a "
                        f"{' or '.join(supported)} model")


def run(args: argparse.Namespace, prepared: Prepared | None = None) -> dict[str, Any]:
    import torch

    p = prepared or prepare(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    recipe = p.recipe.to_dict()
    progress = not getattr(args, "no_progress", False)
    done = runs.run_seeds(args.output, p.task, p.seeds, p.identity, recipe,
                          lambda seed: evaluate(args.model, p, seed, device, progress, args.output), _line)
    report = {**p.identity, "task": p.task, "recipe": recipe, "seeds": p.seeds,
              "corpus": len(p.data.corpus), "train_examples": len(p.data.train),
              "columns": {split: {"queries": len(graded), "figures": runs.figures([r["scores"][split] for r in done])}
                          for split, graded in p.data.qrels.items()}}
    runs.write_report(args.output, report, markdown(report))
    return report


def bi_encoder(model_dir: Path, max_seq_length: int, device):
    """sentence-transformers' bi-encoder of ``model_dir``, as it makes one of a transformers folder: the
    encoder (the pretraining heads left out) and mean pooling; padding and truncation on the right."""
    import logging

    from sentence_transformers import SentenceTransformer

    from bert_ds.checkpoint.hf_load import quiet_loading

    said = logging.getLogger("sentence_transformers")
    level = said.level
    said.setLevel(logging.ERROR)  # "no sentence-transformers model found, creating one with mean pooling": the point
    try:
        with quiet_loading():  # transformers' list of the heads the encoder does not take
            model = SentenceTransformer(str(model_dir), device=str(device))
    finally:
        said.setLevel(level)
    model.max_seq_length = max_seq_length
    model.tokenizer.padding_side = model.tokenizer.truncation_side = "right"
    return model


def evaluate(model_dir: Path, p: Prepared, seed: int, device, progress: bool, output: Path) -> dict[str, Any]:
    """One run: fine-tuned (unless zero-shot) and saved, then every split retrieved and scored."""
    import transformers

    from bert_ds.checkpoint.hf_load import quiet_loading

    start = time.perf_counter()
    transformers.set_seed(seed)
    model = bi_encoder(model_dir, p.recipe.max_seq_length, device)
    folder = runs.seed_folder(output, p.task, seed)
    folder.mkdir(parents=True, exist_ok=True)
    steps = 0
    if p.task == TASK:
        steps = finetune(model, p.data.train, p.recipe, seed, device, progress)
        with quiet_loading():  # transformers' bar over writing one shard; no model card (its widget examples)
            model.save(str(folder / "model"), create_model_card=False)
    doc_ids = list(p.data.corpus)
    docs = _encode(model, [p.data.corpus[d] for d in doc_ids], p.recipe.batch_size, progress)
    scores = {}
    for split, graded in p.data.qrels.items():
        query_ids = sorted(graded)
        queries = _encode(model, [p.data.queries[q] for q in query_ids], p.recipe.batch_size, progress)
        ranking = search(queries, docs, query_ids, doc_ids, TOP_K)
        write_run(folder / f"{split}.run", ranking, tag=f"bert_ds-{p.task}-seed{seed}")
        scores[split] = score(graded, ranking)
    return {"task": p.task, "seed": seed, "scores": scores, "steps": steps, "train_examples": len(p.data.train),
            "run_files": {split: str(folder / f"{split}.run") for split in p.data.qrels},
            "model_folder": str(folder / "model") if p.task == TASK else None,
            "seconds": time.perf_counter() - start, "device": str(device)}


def _encode(model, texts: list[str], batch_size: int, progress: bool):
    """Unit-length embeddings (cosine similarity is then a dot product), as one fp32 tensor."""
    return model.encode(texts, batch_size=2 * batch_size, convert_to_tensor=True, normalize_embeddings=True,
                        show_progress_bar=progress).float()


def search(queries, docs, query_ids: list[str], doc_ids: list[str], k: int,
           chunk: int = 256) -> dict[str, dict[str, float]]:
    """Each query's ``k`` most similar documents by exact dot product: query id -> document id -> score."""
    k = min(k, len(doc_ids))
    ranking = {}
    for first in range(0, len(query_ids), chunk):
        values, indices = (queries[first:first + chunk] @ docs.T).topk(k, dim=1)
        for row, qid in enumerate(query_ids[first:first + chunk]):
            ranking[qid] = {doc_ids[i]: float(v) for v, i in zip(values[row].tolist(), indices[row].tolist())}
    return ranking


def finetune(model, examples: list[TrainExample], recipe: recipes.Recipe, seed: int, device, progress: bool) -> int:
    """sentence-transformers' trainer with MultipleNegativesRankingLoss on ``examples``; its steps."""
    import torch
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses
    from sentence_transformers.training_args import BatchSamplers

    from bert_ds.eval.finetune import quieten

    with tempfile.TemporaryDirectory(prefix="bert_ds-retrieval-") as scratch:
        settings = SentenceTransformerTrainingArguments(
            output_dir=scratch, per_device_train_batch_size=recipe.batch_size, learning_rate=recipe.learning_rate,
            num_train_epochs=recipe.epochs, warmup_steps=recipe.warmup_ratio, lr_scheduler_type="linear",
            weight_decay=recipe.weight_decay, seed=seed, data_seed=seed,
            bf16=device.type == "cuda" and torch.cuda.is_bf16_supported(), use_cpu=device.type == "cpu",
            batch_sampler=BatchSamplers.NO_DUPLICATES, report_to=[], save_strategy="no", logging_strategy="no",
            dataloader_num_workers=0, disable_tqdm=not progress)
        class Trainer(SentenceTransformerTrainer):
            def add_model_card_callback(self, default_args_dict):  # the documented way to leave the model card
                pass  # out: no card is saved, and its widget examples are a progress bar of noise

        trainer = quieten(Trainer(model=model, args=settings, train_dataset=training_set(examples),
                                  loss=losses.MultipleNegativesRankingLoss(model)))
        return trainer.train().global_step


def training_set(examples: list[TrainExample]):
    """The examples as the trainer's columns: (anchor, positive) pairs, and (anchor, positive,
    negative_1..n) rows for those with hard negatives (n: the fewest any of them has); both kinds
    present, a DatasetDict of the two, which the trainer draws batches from in turn."""
    from datasets import Dataset, DatasetDict

    parts = {}
    pairs = [e for e in examples if not e.negatives]
    if pairs:
        parts["pairs"] = Dataset.from_dict({"anchor": [e.query for e in pairs], "positive": [e.positive for e in pairs]})
    hard = [e for e in examples if e.negatives]
    if hard:
        n = min(len(e.negatives) for e in hard)
        columns = {"anchor": [e.query for e in hard], "positive": [e.positive for e in hard]}
        columns.update({f"negative_{i + 1}": [e.negatives[i] for e in hard] for i in range(n)})
        parts["hard_negatives"] = Dataset.from_dict(columns)
    return next(iter(parts.values())) if len(parts) == 1 else DatasetDict(parts)


def _ours_or_empty(output: Path) -> None:
    runs.ours_or_empty(output, (TASK, ZERO_SHOT), "retrieval")


def _line(result: dict[str, Any]) -> str:
    scores = ", ".join(f"{split} nDCG@10 {s['ndcg@10']:.4f}" for split, s in result["scores"].items())
    trained = f"{result['steps']} steps, " if result["task"] == TASK else "not fine-tuned, "
    return f"{result['task']} seed {result['seed']}: {scores} ({trained}{result['seconds']:.0f} s)"


def markdown(report: dict[str, Any]) -> str:
    r = report["recipe"]
    how = ("not fine-tuned: the model mean-pooled as it is" if report["task"] == ZERO_SHOT else
           f"fine-tuned on {report['train_examples']:,} examples, recipe {r['name']} ({runs.recipe_summary(r)})")
    lines = [f"# Retrieval results: {report['model']}", "",
             f"{how}; max length {r['max_seq_length']}; seeds {report['seeds']}; {report['corpus']:,} documents, "
             f"top {TOP_K:,} by exact cosine similarity.",
             "trec_eval's measures (pytrec_eval): the median over seeds, (min-max) over seeds.", "",
             "| split | queries | nDCG@10 | min-max | Recall@100 | MRR@10 |", "|---|---:|---:|---:|---:|---:|"]
    for name, c in report["columns"].items():
        f = c["figures"]
        lines.append(f"| {name} | {c['queries']} | {f['ndcg@10']['median']:.4f} | {f['ndcg@10']['min']:.4f}-"
                     f"{f['ndcg@10']['max']:.4f} | {f['recall@100']['median']:.4f} | {f['mrr@10']['median']:.4f} |")
    return "\n".join(lines) + "\n"
