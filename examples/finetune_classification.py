"""Fine-tune an exported bert-ds model for sentence-pair classification with transformers.

    python examples/finetune_classification.py EXPORT_DIR [--output DIR] [--steps 200]

EXPORT_DIR is a Hugging Face folder written by ``python -m bert_ds.checkpoint.export`` (or
``./run.sh``, which writes ``runs/sample/hf``). It is loaded the way any user of the
export would: ``BertForSequenceClassification.from_pretrained(EXPORT_DIR, num_labels=2)``
(the encoder and pooler come from the export, the classifier layer is new) and
``AutoTokenizer.from_pretrained(EXPORT_DIR)``.

The task, built from the bundled WikiText sample (``data_tools/sample``): given two
sentences A and B, does B directly follow A in the same paragraph (label 1), or is it
a sentence from another article (label 0)? Pairs are balanced, so chance is 50%.
Training pairs come from ``valid.txt`` and evaluation pairs from ``test.txt``, whose
articles are different, so no sentence is seen in both. Articles start at a WikiText
title line (`` = Title = ``); sentences are split with ``bert_ds.data_tools.text.split_sentences``,
the rule the shard builder uses. The task is close to BERT's NSP on purpose: what the
pooled [CLS] output learned in pretraining is what the new classifier layer reads.

A plain PyTorch loop (AdamW, linear warm-up and decay; no ``Trainer``, so nothing
beyond torch and transformers is needed). Accuracy on the evaluation pairs is
measured before fine-tuning (new classifier: about chance) and after. Writes
``OUTPUT/results.json`` and, unless ``--no-save-model``, the fine-tuned model and its
tokenizer to ``OUTPUT/model``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from bert_ds.data_tools.text import heading_level, split_sentences

SAMPLE = Path(__file__).resolve().parent.parent / "data_tools" / "sample"
FOLLOWS, RANDOM = 1, 0  # labels


def read_articles(path: Path) -> list[list[list[str]]]:
    """Articles -> paragraphs -> sentences of a WikiText file (headings dropped)."""
    articles: list[list[list[str]]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        level = heading_level(line)
        if level == 1 or not articles:
            articles.append([])
        if level or not line.strip():
            continue
        sentences = split_sentences(line)
        if sentences:
            articles[-1].append(sentences)
    return [a for a in articles if a]


def sentence_pairs(path: Path, count: int, seed: int) -> list[tuple[str, str, int]]:
    """``count`` balanced (A, B, label) pairs from one file (fewer if the file is small)."""
    articles = read_articles(path)
    if len(articles) < 2:
        raise ValueError(f"{path}: need at least two articles (title lines ' = Title = ') for random-pair negatives")
    rng = random.Random(seed)
    consecutive = [(a, p[i], p[i + 1]) for a, article in enumerate(articles) for p in article
                   for i in range(len(p) - 1)]
    rng.shuffle(consecutive)
    pairs = []
    for k, (article, first, second) in enumerate(consecutive[:count]):
        if k % 2 == 0:
            pairs.append((first, second, FOLLOWS))
        else:
            other = rng.choice([i for i in range(len(articles)) if i != article])
            pairs.append((first, rng.choice(rng.choice(articles[other])), RANDOM))
    rng.shuffle(pairs)
    return pairs


def batches(pairs, tokenizer, batch_size: int, max_length: int, device):
    for lo in range(0, len(pairs), batch_size):
        chunk = pairs[lo: lo + batch_size]
        enc = tokenizer([a for a, _, _ in chunk], [b for _, b, _ in chunk], padding=True, truncation=True,
                        max_length=max_length, return_tensors="pt")
        enc["labels"] = torch.tensor([label for _, _, label in chunk])
        yield {k: v.to(device) for k, v in enc.items()}


@torch.no_grad()
def accuracy(model, pairs, tokenizer, batch_size: int, max_length: int, device) -> float:
    model.eval()
    correct = 0
    for batch in batches(pairs, tokenizer, batch_size, max_length, device):
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        correct += int((logits.argmax(dim=-1) == batch["labels"]).sum())
    model.train()
    return correct / len(pairs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Fine-tune a bert-ds export for sentence-pair classification.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("export_dir", type=Path, metavar="EXPORT_DIR", help="folder written by python -m bert_ds.checkpoint.export")
    p.add_argument("--output", type=Path, default=Path("runs/finetune"), help="results.json and model/ go here")
    p.add_argument("--train-text", type=Path, default=SAMPLE / "valid.txt", help="WikiText file for training pairs")
    p.add_argument("--eval-text", type=Path, default=SAMPLE / "test.txt", help="WikiText file for evaluation pairs")
    p.add_argument("--train-pairs", type=int, default=4000, help="training pairs (half of each label)")
    p.add_argument("--eval-pairs", type=int, default=500, help="evaluation pairs (half of each label)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="pairs per step")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--max-length", type=int, default=128, help="tokens per pair, [CLS] and [SEP]s included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-save-model", action="store_true", help="write results.json only")
    args = p.parse_args(argv)

    import transformers

    for name in ("config.json", "model.safetensors"):
        if not (args.export_dir / name).is_file():
            print(f"error: {args.export_dir} has no {name}; is it a python -m bert_ds.checkpoint.export folder?",
                  file=sys.stderr)
            return 2
    transformers.logging.set_verbosity_error()  # the "newly initialized classifier" notice: expected here
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.export_dir)
    model = transformers.BertForSequenceClassification.from_pretrained(args.export_dir, num_labels=2).to(device)
    try:
        train = sentence_pairs(args.train_text, args.train_pairs, args.seed)
        held_out = sentence_pairs(args.eval_text, args.eval_pairs, args.seed + 1)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(train)} training pairs from {args.train_text.name}, {len(held_out)} evaluation pairs from "
          f"{args.eval_text.name}; {device}", flush=True)

    eval_args = (held_out, tokenizer, 2 * args.batch_size, args.max_length, device)
    before = accuracy(model, *eval_args)
    print(f"accuracy before fine-tuning: {before:.3f}", flush=True)

    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.ndim >= 2 else no_decay).append(param)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr)
    warmup = min(args.warmup_steps, args.steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (args.steps - s) / max(1, args.steps - warmup)))
    rng = random.Random(args.seed)
    stream: list = []
    losses = []
    t0 = time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        if len(stream) < args.batch_size:  # a fresh shuffle each pass over the training pairs
            order = train[:]
            rng.shuffle(order)
            stream += order
        chunk, stream = stream[: args.batch_size], stream[args.batch_size:]
        batch = next(batches(chunk, tokenizer, args.batch_size, args.max_length, device))
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps:
            window = losses[-50:]
            print(f"step {step}/{args.steps}  loss {sum(window) / len(window):.4f}", flush=True)
    seconds = time.perf_counter() - t0

    after = accuracy(model, *eval_args)
    print(f"accuracy after fine-tuning:  {after:.3f} ({args.steps} steps, {seconds:.0f} s)", flush=True)
    args.output.mkdir(parents=True, exist_ok=True)
    results = {"export_dir": str(args.export_dir), "task": "does B directly follow A (1) or come from another article (0)",
               "train_pairs": len(train), "eval_pairs": len(held_out), "steps": args.steps,
               "batch_size": args.batch_size, "lr": args.lr, "accuracy_before": before, "accuracy_after": after,
               "loss_first": losses[0], "loss_last": sum(losses[-10:]) / len(losses[-10:]), "train_seconds": seconds}
    if not args.no_save_model:
        model.save_pretrained(args.output / "model")
        tokenizer.save_pretrained(args.output / "model")
        results["model"] = str(args.output / "model")
    (args.output / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
