"""``python -m bert_ds.eval ner``: fine-tune a model on named-entity tagging and score its entities.

    python -m bert_ds.eval ner --model DIR --data DIR --output DIR
                               [--seeds 3] [--recipe bert_paper] [--lr X] [--epochs N]
                               [--batch-size N] [--max-seq-length 128]

``--model`` is a bert_ds export or a Hugging Face BERT or ModernBERT folder with a fast
tokenizer (its character offsets put each word's label on the word's first sub-token);
``--data`` holds CoNLL-2003-style data in one of the layouts of :mod:`bert_ds.eval.ner_data`,
read and checked before anything trains. Each seed is one fine-tuning run: transformers'
``AutoModelForTokenClassification`` trained by its ``Trainer`` a sentence at a time, the BERT
paper's way (the first sub-token of each word labelled, the others ignored, no CRF), then the
dev (and test) sentences tagged and scored by conlleval's entity rules
(:mod:`bert_ds.eval.ner_metrics`): precision, recall and F1 over entities, and per entity type.
Results go to ``OUTPUT/ner/seedN.json``, ``results.md`` and ``results.json`` as for the other
evaluations; a rerun keeps the runs already done.

A sentence is tokenized as the text it is, its words joined by single spaces, and each token's
character offsets say its word: the tokens a model read in pretraining. Handing the tokenizer
the words one by one (``is_split_into_words``) gives those for WordPiece (BERT), whose
pre-tokenizer splits at spaces anyway, but not for a byte-level BPE (ModernBERT's): each word
would lose the space that starts it (``Ġyork`` read as ``york``, the form of a word that opens
a text).
"""

from __future__ import annotations

import argparse
import bisect
import functools
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_ds.eval import recipe as recipes, runs
from bert_ds.eval.ner_data import NerData, NerSplit, read_ner

TASK = "ner"


def add_arguments(p: argparse.ArgumentParser) -> None:
    runs.add_common_arguments(p, data="the folder holding CoNLL column files, or Hugging Face's conll2003 as "
                                      "Parquet or save_to_disk", recipes="ner", length="sentence length (128)")


STAGE_KEYS = runs.STAGE_KEYS


def stage_args(values: Any, model: Path, output: Path) -> argparse.Namespace:
    """A phase plan's ``"evaluate": {"ner": {...}}`` as this command's arguments: ``data``
    required; ``seeds``, ``seed``, ``recipe``, ``lr``, ``epochs``, ``batch_size``,
    ``max_seq_length`` as the flags; the model and output come from the plan."""
    return runs.stage_args("ner", add_arguments, values, model, output, STAGE_KEYS)


@dataclass
class Prepared:
    """An NER evaluation checked and read, before anything trains."""

    data: NerData
    recipe: recipes.Recipe
    seeds: list[int]
    identity: dict[str, str]


def prepare(args: argparse.Namespace, *, model_exists: bool = True) -> Prepared:
    """Every input checked and every split read (``model_exists=False``: a phase plan's export,
    still to be made, which has a fast tokenizer)."""
    runs.check_inputs(args, _ours_or_empty, model_exists=model_exists)
    recipe = recipes.load(args.recipe, recipes.NER_RECIPES).with_overrides(
        learning_rate=args.lr, epochs=args.epochs, batch_size=args.batch_size,
        max_seq_length=args.max_seq_length).for_task(TASK)
    data = read_ner(args.data)
    if model_exists:
        runs.check_length(args.model, recipe.max_seq_length)
        runs.check_tokenizer(args.model, "NER needs a fast tokenizer's character offsets")  # last: imports transformers
    identity = {"model": str(args.model.resolve()), "data": str(args.data.resolve())}
    return Prepared(data, recipe, list(range(args.seed, args.seed + args.seeds)), identity)


def run(args: argparse.Namespace, prepared: Prepared | None = None) -> dict[str, Any]:
    import torch

    p = prepared or prepare(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    recipe = p.recipe.to_dict()
    encoded = functools.cache(lambda: _encoded(args.model, p))  # once, for the seeds that train
    done = runs.run_seeds(args.output, TASK, p.seeds, p.identity, recipe,
                          lambda seed: finetune(args.model, p, seed, device, not args.no_progress, encoded()), _line)
    evals = [s for s in ("dev", "test") if s in p.data.splits]
    report = {**p.identity, "task": TASK, "labels": list(p.data.labels), "recipe": recipe, "seeds": p.seeds,
              "columns": {s: {"sentences": len(p.data.splits[s].tokens),
                              "figures": runs.figures([_flat(r["scores"][s]) for r in done])} for s in evals}}
    runs.write_report(args.output, report, markdown(report))
    return report


def _flat(scores: dict[str, Any]) -> dict[str, float]:
    """The micro figures and each type's F1 (``f1 PER``), for the table's medians."""
    return {**{k: v for k, v in scores.items() if k != "per_type"},
            **{f"f1 {kind}": s["f1"] for kind, s in scores["per_type"].items()}}


def encode(tokenizer, split: NerSplit, labels: tuple[str, ...], max_seq_length: int) -> tuple[list[dict], list]:
    """Each sentence tokenized once, as its words joined by single spaces, its words' labels on
    their first sub-tokens (-100 on the others and on the special tokens, which the loss
    ignores); and, per sentence, the position of each word's first sub-token (None for words cut
    off by ``max_seq_length``)."""
    texts = [" ".join(words) for words in split.tokens]
    enc = tokenizer(texts, truncation=True, max_length=max_seq_length, return_offsets_mapping=True,
                    return_token_type_ids=True)
    ids = {tag: i for i, tag in enumerate(labels)}
    features, firsts = [], []
    for s, tags in enumerate(split.tags):
        words = word_of_tokens(split.tokens[s], enc["offset_mapping"][s], enc.sequence_ids(s))
        first = [None] * len(tags)
        label = [-100] * len(words)
        for position, word in enumerate(words):
            if word is not None and first[word] is None:
                first[word] = position
                label[position] = ids[tags[word]]
        features.append({"input_ids": enc["input_ids"][s], "token_type_ids": enc["token_type_ids"][s],
                         "attention_mask": enc["attention_mask"][s], "labels": label})
        firsts.append(first)
    return features, firsts


def word_of_tokens(words: list[str], offsets: list[tuple[int, int]], sequence: list[int | None]) -> list[int | None]:
    """Per token of ``" ".join(words)``: the word its characters lie in, by their offsets (a
    token reaching over a space into a word, as a SentencePiece ``▁`` does, is that word's);
    None for the special tokens and for a token of spaces alone."""
    starts, at = [], 0
    for word in words:
        starts.append(at)
        at += len(word) + 1
    found: list[int | None] = []
    for (first, end), part in zip(offsets, sequence):
        if part is None or end <= first:
            found.append(None)
            continue
        word = bisect.bisect_right(starts, end - 1) - 1  # the word where the token's last character is
        found.append(word if end - 1 < starts[word] + len(words[word]) else None)
    return found


@dataclass(frozen=True)
class Encoded:
    """The model's tokenizer and every split encoded (features, first sub-tokens): the same for every seed."""

    tokenizer: Any
    splits: dict[str, tuple[list[dict], list]]


def _encoded(model_dir: Path, p: Prepared) -> Encoded:
    from bert_ds.eval.finetune import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return Encoded(tokenizer, {name: encode(tokenizer, split, p.data.labels, p.recipe.max_seq_length)
                               for name, split in p.data.splits.items()})


def finetune(model_dir: Path, p: Prepared, seed: int, device, progress: bool, encoded: Encoded) -> dict[str, Any]:
    """One fine-tuning run on the train split, scored on dev (and test)."""
    import transformers

    from bert_ds.checkpoint.hf_load import load_quietly
    from bert_ds.eval.finetune import quiet_trainer, training_arguments
    from bert_ds.eval.ner_metrics import entity_scores

    start = time.perf_counter()
    labels = p.data.labels
    transformers.set_seed(seed)  # the new tagging layer's initialisation
    model = load_quietly(transformers.AutoModelForTokenClassification, model_dir, num_labels=len(labels),
                         id2label=dict(enumerate(labels)), label2id={t: i for i, t in enumerate(labels)})
    tokenizer, (train, _) = encoded.tokenizer, encoded.splits["train"]
    with tempfile.TemporaryDirectory(prefix="bert_ds-ner-") as scratch:
        settings = training_arguments(p.recipe, seed, device, progress, scratch)
        tuner = quiet_trainer(model, settings, train, transformers.DataCollatorForTokenClassification(tokenizer))
        outcome = tuner.train()
    scores, cut = {}, {}
    for name in ("dev", "test"):
        if name not in p.data.splits:
            continue
        split = p.data.splits[name]
        features, firsts = encoded.splits[name]
        predicted = _tag(tuner.model, features, firsts, labels, tokenizer, device, 2 * p.recipe.batch_size,
                         settings.bf16)
        scores[name] = entity_scores(split.tags, predicted)
        cut[name] = sum(position is None for first in firsts for position in first)
    return {"task": TASK, "seed": seed, "scores": scores, "train_sentences": len(train),
            "words_cut_off": cut, "steps": outcome.global_step,
            "mean_train_loss": outcome.training_loss if math.isfinite(outcome.training_loss) else None,
            "seconds": time.perf_counter() - start, "device": str(device), "bf16": settings.bf16}


def _tag(model, features, firsts, labels, tokenizer, device, batch_size: int, bf16: bool) -> list[list[str]]:
    """Each sentence's predicted tags: the best label at each word's first sub-token; "O" for
    words beyond the window (they count as missed entities, as truncation does)."""
    import torch
    import transformers

    from bert_ds.eval.finetune import model_inputs

    collate = transformers.DataCollatorForTokenClassification(tokenizer)
    tags = []
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for first in range(0, len(features), batch_size):
            batch = {k: v.to(device) for k, v in collate(features[first:first + batch_size]).items() if k != "labels"}
            best = model(**model_inputs(model, batch)).logits.argmax(dim=-1).cpu().tolist()
            for row, positions in zip(best, firsts[first:first + batch_size]):
                tags.append([labels[row[i]] if i is not None else "O" for i in positions])
    return tags


def _ours_or_empty(output: Path) -> None:
    runs.ours_or_empty(output, TASK, "NER")


def _line(result: dict[str, Any]) -> str:
    scores = ", ".join(f"{name} F1 {s['f1']:.2f}" for name, s in result["scores"].items())
    return f"ner seed {result['seed']}: {scores} ({result['steps']} steps, {result['seconds']:.0f} s)"


def markdown(report: dict[str, Any]) -> str:
    r = report["recipe"]
    lines = [f"# NER results: {report['model']}", "",
             f"Recipe {r['name']} ({runs.recipe_summary(r)}, max length {r['max_seq_length']}); "
             f"seeds {report['seeds']}; tags {', '.join(report['labels'])}.",
             "Entity-level scores in percent, by conlleval's rules: the median over seeds, (min-max) over seeds.", "",
             "| split | sentences | F1 | min-max | precision | recall | F1 per type (median) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, c in report["columns"].items():
        f = c["figures"]
        types = ", ".join(f"{k.removeprefix('f1 ')} {v['median']:.2f}" for k, v in f.items() if k.startswith("f1 "))
        lines.append(f"| {name} | {c['sentences']} | {f['f1']['median']:.2f} | {f['f1']['min']:.2f}-"
                     f"{f['f1']['max']:.2f} | {f['precision']['median']:.2f} | {f['recall']['median']:.2f} | {types} |")
    return "\n".join(lines) + "\n"
