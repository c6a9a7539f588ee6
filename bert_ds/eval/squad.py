"""``python -m bert_ds.eval squad``: fine-tune a model on SQuAD and score it as the paper does.

    python -m bert_ds.eval squad --model DIR --data DIR --output DIR
                                 [--version 1.1|2.0] [--seeds 3] [--recipe bert_paper]
                                 [--lr X] [--epochs N] [--batch-size N] [--max-seq-length 384]
                                 [--doc-stride 128] [--max-query-length 64] [--max-answer-length 30]
                                 [--n-best 20]

``--model`` is a bert_ds export or a Hugging Face BERT or ModernBERT folder with a fast
tokenizer (its character offsets map answers to tokens); ``--data`` holds SQuAD v1.1 or v2.0 in
one of the layouts of :mod:`bert_ds.eval.squad_data`, read and checked before anything trains.
Each seed is one fine-tuning run: transformers' ``AutoModelForQuestionAnswering`` (the span
head the model's family has, on the encoder) trained by its ``Trainer`` on the windows of
:mod:`bert_ds.eval.squad_features`, then the dev set's answers scored by the official scripts'
rules (:mod:`bert_ds.eval.squad_metrics`).
Scores go to ``OUTPUT/squad/seedN.json`` (v2.0: ``squad_v2/``) as each run ends, and the
official scripts' inputs to ``OUTPUT/squad/seedN/``: ``predictions.json`` (question id -> answer
text, "" for no answer) and, for v2.0, ``null_odds.json`` (question id -> the null score minus
the best span's, the ``--na-prob-file`` as transformers' ``run_qa.py`` writes it), from which the
scripts give the run's scores again. ``results.md`` and ``results.json`` hold the median over
seeds and the spread (min-max).

The same command run again keeps the runs already done when they were made from the same
model, data and recipe; a folder of other results is refused, never overwritten.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import ConfigError
from bert_ds.eval import recipe as recipes, runs
from bert_ds.eval.squad_data import Layout, SquadSplit, find_layout, read_split

TASKS = {"1.1": "squad", "2.0": "squad_v2"}  # the results' folder and the recipe's per_task key
HEADLINE = {"1.1": ("exact_match", "f1"), "2.0": ("exact", "f1")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    runs.add_common_arguments(p, data="the folder holding SQuAD (official JSON, Parquet or save_to_disk)",
                              recipes="squad", length="window length (384)")
    p.add_argument("--version", choices=("1.1", "2.0"), default=None,
                   help="which SQuAD, where --data holds both (default: the one there)")
    p.add_argument("--doc-stride", type=int, default=128, help="context tokens shared by consecutive windows")
    p.add_argument("--max-query-length", type=int, default=64,
                   help="a longer question keeps its first N tokens (BERT's run_squad.py)")
    p.add_argument("--max-answer-length", type=int, default=30, help="the longest answer predicted, in tokens")
    p.add_argument("--n-best", type=int, default=20, help="start and end candidates paired per window")


@dataclass
class Prepared:
    """A SQuAD evaluation checked and read, before anything trains."""

    layout: Layout
    train: SquadSplit
    dev: SquadSplit
    recipe: recipes.Recipe  # for this version's task, with the command line's overrides
    seeds: list[int]
    identity: dict[str, str]  # what a kept result must have been made from

    @property
    def task(self) -> str:
        return TASKS[self.layout.version]


def stage_args(values: Any, model: Path, output: Path) -> argparse.Namespace:
    """A phase plan's ``"evaluate": {"squad": {...}}`` as this command's arguments: ``data``
    required; ``version``, ``seeds``, ``seed``, ``recipe``, ``lr``, ``epochs``, ``batch_size``,
    ``max_seq_length``, ``doc_stride``, ``max_query_length``, ``max_answer_length``, ``n_best`` as the
    flags."""
    args = runs.stage_args("squad", add_arguments, values, model, output, STAGE_KEYS)
    if args.version not in (None, "1.1", "2.0"):
        raise ConfigError(f'phase plan: evaluate.squad.version must be "1.1" or "2.0", got {args.version!r}')
    return args


STAGE_KEYS = {**runs.STAGE_KEYS, "version": str, "doc_stride": int, "max_query_length": int,
              "max_answer_length": int, "n_best": int}


def prepare(args: argparse.Namespace, *, model_exists: bool = True) -> Prepared:
    """Every input checked and both splits read (``model_exists=False``: the model is still to be
    trained, by a phase plan that ends with this evaluation; its export has a fast tokenizer)."""
    for flag, value in (("--doc-stride", args.doc_stride), ("--max-query-length", args.max_query_length),
                        ("--max-answer-length", args.max_answer_length), ("--n-best", args.n_best)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    runs.check_inputs(args, _ours_or_empty, model_exists=model_exists)
    layout = find_layout(args.data, args.version)
    recipe = recipes.load(args.recipe, recipes.SQUAD_RECIPES).with_overrides(
        learning_rate=args.lr, epochs=args.epochs, batch_size=args.batch_size,
        max_seq_length=args.max_seq_length).for_task(TASKS[layout.version])
    if args.doc_stride >= recipe.max_seq_length // 2:
        raise ConfigError(f"--doc-stride {args.doc_stride} must be under half the window ({recipe.max_seq_length} "
                          "tokens): the question and the overlap must leave context to move on by")
    if model_exists:
        runs.check_length(args.model, recipe.max_seq_length)
    train, dev = read_split(layout, "train"), read_split(layout, "dev")
    specials = 3  # a phase plan's export has a BERT tokenizer: [CLS] question [SEP] context [SEP]
    if model_exists:  # last: imports transformers
        tokenizer = runs.check_tokenizer(args.model, "SQuAD needs a fast tokenizer's character offsets")
        specials = tokenizer.num_special_tokens_to_add(pair=True)
    if args.max_query_length >= recipe.max_seq_length - specials - args.doc_stride:  # before any training
        raise ConfigError(f"--max-query-length {args.max_query_length}, the {specials} special tokens of a question "
                          f"and context pair and the {args.doc_stride} tokens of --doc-stride fill the window of "
                          f"{recipe.max_seq_length}; lower --max-query-length or --doc-stride, or raise --max-seq-length")
    identity = {"model": str(args.model.resolve()), "data": str(layout.folder.resolve()),
                "windows": f"doc_stride {args.doc_stride}, max_query_length {args.max_query_length}, "
                           f"max_answer_length {args.max_answer_length}, n_best {args.n_best}"}
    return Prepared(layout, train, dev, recipe, list(range(args.seed, args.seed + args.seeds)), identity)


def run(args: argparse.Namespace, prepared: Prepared | None = None) -> dict[str, Any]:
    import torch

    p = prepared or prepare(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    recipe = p.recipe.to_dict()
    windows = functools.cache(lambda: _windows(args.model, p, args))  # once, for the seeds that train
    done = runs.run_seeds(args.output, p.task, p.seeds, p.identity, recipe,
                          lambda seed: finetune(args.model, p, seed, device, args, windows()),
                          lambda r: _line(p.task, r))
    report = {**p.identity, "task": p.task, "version": p.layout.version, "recipe": recipe, "seeds": p.seeds,
              "dev_questions": len(p.dev.examples), "figures": runs.figures([r["scores"] for r in done])}
    runs.write_report(args.output, report, markdown(report))
    return report


@dataclass(frozen=True)
class Encoded:
    """The model's tokenizer and both splits' windows: the same for every seed."""

    tokenizer: Any
    train: Any  # squad_features.Windows, with labels
    dev: Any  # squad_features.Windows


def _windows(model_dir: Path, p: Prepared, args: argparse.Namespace) -> Encoded:
    from bert_ds.eval.finetune import load_tokenizer
    from bert_ds.eval.squad_features import make_windows

    tokenizer = load_tokenizer(model_dir)
    return Encoded(tokenizer, *(make_windows(tokenizer, split.examples, p.recipe.max_seq_length, args.doc_stride,
                                             labels=split is p.train, max_query_length=args.max_query_length,
                                             source=split.source) for split in (p.train, p.dev)))


def finetune(model_dir: Path, p: Prepared, seed: int, device, args: argparse.Namespace,
             encoded: Encoded) -> dict[str, Any]:
    """One fine-tuning run on the train split, scored on the dev split."""
    import torch
    import transformers

    from bert_ds.checkpoint.hf_load import load_quietly
    from bert_ds.eval.finetune import quiet_trainer, training_arguments
    from bert_ds.eval.squad_features import predict_answers
    from bert_ds.eval.squad_metrics import Question, evaluate

    start = time.perf_counter()
    transformers.set_seed(seed)  # the new span head's initialisation
    model = load_quietly(transformers.AutoModelForQuestionAnswering, model_dir)
    tokenizer, train, dev = encoded.tokenizer, encoded.train, encoded.dev
    with tempfile.TemporaryDirectory(prefix="bert_ds-squad-") as scratch:
        settings = training_arguments(p.recipe, seed, device, not args.no_progress, scratch)
        tuner = quiet_trainer(model, settings, train.features, transformers.DataCollatorWithPadding(tokenizer))
        outcome = tuner.train()
    starts, ends = _span_scores(tuner.model, dev.features, tokenizer, device, 2 * p.recipe.batch_size, settings.bf16)
    predicted = predict_answers(p.dev.examples, dev, starts, ends, version=p.layout.version, n_best=args.n_best,
                                max_answer_length=args.max_answer_length)
    _write_predictions(runs.seed_folder(args.output, p.task, seed), predicted, p.layout.version)
    questions = [Question(e.id, tuple(a.text for a in e.answers)) for e in p.dev.examples]
    scores = evaluate(questions, predicted.answers, version=p.layout.version,
                      no_answer_probability=predicted.no_answer_score if p.layout.version == "2.0" else None)
    return {"task": p.task, "seed": seed, "scores": {k: float(v) for k, v in scores.items()},
            "train_questions": len(p.train.examples), "train_windows": len(train.features),
            "dev_windows": len(dev.features), "questions_cut": {"train": train.questions_cut, "dev": dev.questions_cut},
            "steps": outcome.global_step,
            "mean_train_loss": outcome.training_loss if math.isfinite(outcome.training_loss) else None,
            "seconds": time.perf_counter() - start, "device": str(device), "bf16": settings.bf16,
            "torch": torch.__version__}


def _write_predictions(folder: Path, predicted, version: str) -> None:
    """The official scripts' inputs: ``predictions.json`` and, for v2.0, ``null_odds.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "predictions.json", json.dumps(predicted.answers, indent=2, ensure_ascii=False) + "\n")
    if version == "2.0":
        atomic_write(folder / "null_odds.json", json.dumps(predicted.no_answer_score, indent=2) + "\n")


def _span_scores(model, features: list[dict[str, Any]], tokenizer, device, batch_size: int, bf16: bool):
    """The model's start and end scores of every window, in order, as (windows, longest) arrays."""
    import numpy as np
    import torch
    import transformers

    from bert_ds.eval.finetune import model_inputs

    collate = transformers.DataCollatorWithPadding(tokenizer)
    width = max(len(f["input_ids"]) for f in features)
    starts = np.full((len(features), width), -np.inf, dtype=np.float32)
    ends = np.full_like(starts, -np.inf)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for first in range(0, len(features), batch_size):
            batch = {k: v.to(device) for k, v in collate(features[first:first + batch_size]).items()}
            out = model(**model_inputs(model, batch))
            n, w = out.start_logits.shape
            starts[first:first + n, :w] = out.start_logits.float().cpu().numpy()
            ends[first:first + n, :w] = out.end_logits.float().cpu().numpy()
    return starts, ends


def _ours_or_empty(output: Path) -> None:
    runs.ours_or_empty(output, tuple(TASKS.values()), "SQuAD")


def _line(task: str, result: dict[str, Any]) -> str:
    scores = ", ".join(f"{k} {result['scores'][k]:.2f}" for k in ("exact_match", "exact", "f1", "best_f1")
                       if k in result["scores"])
    return f"{task} seed {result['seed']}: {scores} ({result['steps']} steps, {result['seconds']:.0f} s)"


def markdown(report: dict[str, Any]) -> str:
    r, version = report["recipe"], report["version"]
    lines = [f"# SQuAD v{version} dev results: {report['model']}", "",
             f"Recipe {r['name']} ({runs.recipe_summary(r)}, windows of {r['max_seq_length']} "
             f"tokens, {report['windows']}); seeds {report['seeds']}; {report['dev_questions']} dev questions.",
             "Scores in percent, as the official evaluation script computes them: the median over seeds, "
             "(min-max) over seeds.", "", "| figure | median | min-max |", "|---|---:|---:|"]
    for name, f in report["figures"].items():
        if name.endswith("total"):
            continue
        lines.append(f"| {name} | {f['median']:.2f} | {f['min']:.2f}-{f['max']:.2f} |")
    return "\n".join(lines) + "\n"
