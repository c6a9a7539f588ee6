"""Does bert-ds train as well as an independent trainer? The same model, tokenizer, text and token
budget, trained by bert-ds and by transformers' ``Trainer``, scored by one evaluator.

    python -m bert_ds.tools.parity [--train-text FILE] [--heldout-text FILE] --output DIR
                                   [--preset tiny-h128] [--steps 600] [--seeds 3] [--lr 1e-3] ...

- **bert-ds**: ``python -m bert_ds.data_tools build`` (a WordPiece vocabulary trained on the
  training text), then ``python -m bert_ds.train`` as a user runs it: masked LM only
  (``--pair-task none``), AdamW, ZeRO-0 in fp32, linear warm-up and decay, gradient clipping
  at 1.0, weight decay 0.01; then its export.
- **transformers**: ``BertForMaskedLM`` of the same configuration, its own initialisation, the
  same tokenizer (the shards' folder), the training text tokenized line by line and grouped
  into blocks of ``--seq-len`` tokens (``run_mlm.py``'s ``group_texts``), its
  ``DataCollatorForLanguageModeling`` (15%, 80/10/10: BERT's masking, as bert-ds's), ``Trainer``
  with the same optimizer settings and schedule, and as many optimizer steps as give it the
  real tokens bert-ds trained on.
- **One evaluator** scores every model, loaded as ``BertForMaskedLM`` from its folder, on the
  held-out text two ways, each a fixed set of masked batches: transformers' blocks (its
  collator, seeded) and bert-ds's held-out samples (its loader, seeded); each trainer is at home
  on one of them. The figures: masked-LM loss and accuracy, per seed, their median and spread
  (max - min over seeds).

The verdict compares medians: bert-ds is "not worse" where its median held-out loss exceeds
transformers' by no more than the larger of the two seed spreads. Where it is worse, that is
the first thing to find out about. Everything goes to ``OUTPUT/parity.md`` and ``parity.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import UserError, guarded
from bert_ds.base.interrupts import import_whole

if TYPE_CHECKING:  # torch and transformers are imported where they run: --help needs neither
    import torch

SAMPLE = Path(__file__).resolve().parents[1] / "data_tools" / "sample"


def _env() -> dict[str, str]:
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def _cli(*args: str, log: Path) -> None:
    """A bert_ds command as a user runs it; its output kept in ``log``; one line if it fails."""
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, env=_env())
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"python -m {' '.join(args[:2])} failed (exit {proc.returncode}; {log}): {tail[0]}")


def build_data(args: argparse.Namespace) -> tuple[Path, Path]:
    data = args.output / "data"
    train, heldout = data / "train", data / "heldout"
    if not (train / "manifest.json").is_file():
        _cli("bert_ds.data_tools", "build", "--input", str(args.train_text), "--output", str(train), "--train-vocab",
             str(args.vocab_size), "--split-sentences", "--workers", "1", log=args.output / "build_train.log")
    if not (heldout / "manifest.json").is_file():
        _cli("bert_ds.data_tools", "build", "--input", str(args.heldout_text), "--output", str(heldout), "--vocab",
             str(train / "vocab.txt"), "--split-sentences", "--workers", "1", log=args.output / "build_heldout.log")
    return train, heldout


def train_bert_ds(args: argparse.Namespace, train: Path, seed: int) -> tuple[Path, int]:
    """Its export folder and the real tokens it trained on."""
    run, export = args.output / f"bert_ds-seed{seed}", args.output / f"bert_ds-seed{seed}-hf"
    if not (export / "config.json").is_file():
        _cli("bert_ds.train", "--data", str(train), "--output", str(run), "--preset", args.preset,
             "--seq-len", str(args.seq_len), "--global-batch-size", str(args.batch_size), "--micro-batch-size",
             str(args.batch_size), "--steps", str(args.steps), "--optimizer", "adamw", "--lr", str(args.lr),
             "--warmup-steps", str(args.warmup_steps), "--decay", "linear", "--weight-decay", "0.01",
             "--grad-clip", "1.0", "--pair-task", "none", "--ds-config", "zero0_fp32.json", "--seed", str(seed),
             "--num-workers", "0", "--no-progress", "--no-tensorboard", "--resume", "never", log=run.with_suffix(".log"))
        _cli("bert_ds.checkpoint.export", str(run), str(export),
             log=export.with_suffix(".log"))
    return export, int(json.loads((run / "summary.json").read_text())["tokens"])


def blocks(tokenizer, text: Path, seq_len: int) -> list[list[int]]:
    """``run_mlm.py``'s ``group_texts``: every non-empty line tokenized ([CLS] ... [SEP]),
    concatenated, cut into blocks of ``seq_len`` (the remainder dropped)."""
    lines = [line for line in text.read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = [t for row in tokenizer(lines)["input_ids"] for t in row]
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def train_transformers(args: argparse.Namespace, train: Path, seed: int, tokens: int) -> tuple[Path, int]:
    """transformers' Trainer on the same budget of real tokens: its model folder and its tokens."""
    import torch
    import transformers

    from bert_ds.checkpoint.export import to_hf_config
    from bert_ds.model.config import model_preset

    out = args.output / f"transformers-seed{seed}"
    tokenizer = transformers.AutoTokenizer.from_pretrained(train)
    data = [{"input_ids": b} for b in blocks(tokenizer, args.train_text, args.seq_len)]
    steps = max(1, round(tokens / (args.batch_size * args.seq_len)))
    if (out / "config.json").is_file():
        return out, steps * args.batch_size * args.seq_len
    config = to_hf_config(model_preset(args.preset, len(tokenizer), pad_token_id=tokenizer.pad_token_id))
    transformers.set_seed(seed)
    model = transformers.BertForMaskedLM(config)
    training = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=args.batch_size, max_steps=steps,
        learning_rate=args.lr, warmup_steps=args.warmup_steps, lr_scheduler_type="linear", weight_decay=0.01,
        max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-6, seed=seed, data_seed=seed,
        report_to=[], save_strategy="no", logging_steps=max(1, steps // 10), dataloader_num_workers=0,
        bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    transformers.Trainer(model=model, args=training, train_dataset=data, data_collator=collator).train()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, steps * args.batch_size * args.seq_len


def eval_batches(args: argparse.Namespace, train: Path, heldout: Path) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The two fixed held-out sets of masked batches: transformers' blocks and bert-ds's samples."""
    import transformers

    from bert_ds.config import BatchPlan, DataConfig
    from bert_ds.loader.pretraining import PretrainingLoader, open_pretraining_data

    tokenizer = transformers.AutoTokenizer.from_pretrained(train)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, seed=args.eval_seed)
    found = blocks(tokenizer, args.heldout_text, args.seq_len)[:args.eval_batches * args.batch_size]
    theirs = [collator([{"input_ids": b} for b in found[i:i + args.batch_size]])
              for i in range(0, len(found), args.batch_size)]
    cfg = DataConfig(train=[str(heldout)], max_seq_length=args.seq_len, pair_task="none", num_workers=0)
    dataset, _ = open_pretraining_data(cfg, args.eval_seed)
    loader = PretrainingLoader(dataset, BatchPlan.resolve(args.batch_size, args.batch_size, 1), rank=0, num_workers=0)
    n = min(args.eval_batches, dataset.num_samples // args.batch_size)
    ours = [{k: loader_batch[k] for k in ("input_ids", "token_type_ids", "attention_mask", "labels")}
            for loader_batch in (loader.next_step()[0] for _ in range(n))]
    return {"blocks (transformers' layout)": theirs, "samples (bert-ds's layout)": ours}


def evaluate(folder: Path, sets: dict[str, list[dict[str, torch.Tensor]]]) -> dict[str, dict[str, float]]:
    """Masked-LM loss (mean over masked tokens) and accuracy of the model in ``folder`` on each set."""
    import torch
    import transformers

    from bert_ds.checkpoint.hf_load import load_quietly

    model = load_quietly(transformers.BertForMaskedLM, folder).eval()
    scores = {}
    for name, batches in sets.items():
        loss_sum, correct, count = 0.0, 0, 0
        for batch in batches:
            labels = batch["labels"]
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            with torch.no_grad():
                logits = model(**inputs).logits
            masked = labels != -100
            loss_sum += torch.nn.functional.cross_entropy(logits[masked].float(), labels[masked], reduction="sum").item()
            correct += int((logits[masked].argmax(-1) == labels[masked]).sum())
            count += int(masked.sum())
        scores[name] = {"loss": loss_sum / count, "accuracy": correct / count, "masked_tokens": count}
    return scores


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "spread": max(values) - min(values), "values": values}


# What the data, the models and so their figures depend on: a rerun with other values would
# mix runs of two experiments, so it is refused (seeds may be added, evaluation redone).
TRAINING = ("train_text", "heldout_text", "preset", "vocab_size", "seq_len", "batch_size", "steps", "lr",
            "warmup_steps")


def _same_settings(args: argparse.Namespace) -> None:
    path = args.output / "settings.json"
    mine = {k: str(getattr(args, k).resolve()) if isinstance(getattr(args, k), Path) else getattr(args, k)
            for k in TRAINING}
    if path.is_file():
        try:
            theirs = json.loads(path.read_text())
        except ValueError:
            theirs = {}
        changed = [k for k in TRAINING if theirs.get(k) != mine[k]]
        if changed:
            raise UserError(f"--output {args.output} holds a parity run with other {', '.join(changed)} "
                            f"({', '.join(f'{k} {theirs.get(k)!r}' for k in changed)}); give another --output")
    elif any(args.output.iterdir()):
        raise UserError(f"--output {args.output} exists and holds no parity run; give a new or empty folder")
    else:
        atomic_write(path, json.dumps(mine, indent=2) + "\n")


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per trainer and held-out set: median and spread over seeds of the loss and the accuracy."""
    sets = list(next(iter(runs.values()))[0]["scores"])
    return {who: {name: {k: _spread([r["scores"][name][k] for r in rs]) for k in ("loss", "accuracy")}
                  for name in sets} for who, rs in runs.items()}


def verdicts(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per held-out set: bert-ds is not worse where its median loss exceeds transformers' by no
    more than the larger of the two seed spreads."""
    out = {}
    for name in summary["bert-ds"]:
        ours, theirs = summary["bert-ds"][name]["loss"], summary["transformers"][name]["loss"]
        allowed = max(ours["spread"], theirs["spread"])
        difference = ours["median"] - theirs["median"]
        out[name] = {"difference": difference, "allowed": allowed, "not_worse": difference <= allowed}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bert_ds.config import check_writable

    for flag, path in (("--train-text", args.train_text), ("--heldout-text", args.heldout_text)):
        if not path.is_file():
            raise UserError(f"{flag} {path}: no such file")
    check_writable(args.output, "--output", folder=True)
    args.output.mkdir(parents=True, exist_ok=True)
    _same_settings(args)
    import_whole("torch", "transformers")
    train, heldout = build_data(args)
    sets = eval_batches(args, train, heldout)
    runs: dict[str, list[dict[str, Any]]] = {"bert-ds": [], "transformers": []}
    for seed in range(args.seed, args.seed + args.seeds):
        ours, tokens = train_bert_ds(args, train, seed)
        theirs, their_tokens = train_transformers(args, train, seed, tokens)
        runs["bert-ds"].append({"seed": seed, "tokens": tokens, "scores": evaluate(ours, sets)})
        runs["transformers"].append({"seed": seed, "tokens": their_tokens, "scores": evaluate(theirs, sets)})
        print(f"seed {seed}: " + "; ".join(
            f"{who} loss " + "/".join(f"{s['loss']:.3f}" for s in r[-1]["scores"].values())
            for who, r in runs.items()), flush=True)
    summary = summarize(runs)
    report = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "eval_batches": {name: len(b) for name, b in sets.items()}, "runs": runs, "summary": summary,
              "verdicts": verdicts(summary)}
    atomic_write(args.output / "parity.json", json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    atomic_write(args.output / "parity.md", text)
    print(text, end="")
    return report


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    tokens = {who: statistics.median(r["tokens"] for r in rs) for who, rs in report["runs"].items()}
    lines = [f"## Parity: bert-ds against transformers' Trainer ({s['preset']}, seq {s['seq_len']}, batch "
             f"{s['batch_size']}, AdamW lr {s['lr']:g}, {s['seeds']} seeds)", "",
             "Tokens trained on (median over seeds): " + ", ".join(f"{who} {n:,.0f}" for who, n in tokens.items())
             + ". Held-out masked-LM loss and accuracy, median over seeds (spread = max - min):", "",
             "| held-out set | trainer | loss | loss spread | accuracy | accuracy spread |",
             "|---|---|---:|---:|---:|---:|"]
    for name in report["verdicts"]:
        for who, per_set in report["summary"].items():
            loss, acc = per_set[name]["loss"], per_set[name]["accuracy"]
            lines.append(f"| {name} | {who} | {loss['median']:.4f} | {loss['spread']:.4f} | "
                         f"{acc['median']:.4f} | {acc['spread']:.4f} |")
    lines.append("")
    for name, v in report["verdicts"].items():
        lines.append(f"- {name}: bert-ds - transformers = {v['difference']:+.4f} in loss, allowed "
                     f"{v['allowed']:.4f} (the larger seed spread): **{'not worse' if v['not_worse'] else 'WORSE'}**")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bert_ds.tools.parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--train-text", type=Path, default=SAMPLE / "valid.txt", help="training text (default: the sample)")
    p.add_argument("--heldout-text", type=Path, default=SAMPLE / "test.txt", help="held-out text")
    p.add_argument("--output", type=Path, required=True,
                   help="results folder, new or empty (the same command again keeps its finished runs)")
    p.add_argument("--preset", default="tiny-h128")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=600, help="bert-ds's optimizer steps; transformers gets its tokens")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=60)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval-batches", type=int, default=20, help="held-out batches per evaluation set")
    p.add_argument("--eval-seed", type=int, default=1234)
    args = p.parse_args(argv)
    for name in ("steps", "seeds", "batch_size", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def body() -> None:
        run(args)

    return guarded(body, interrupted=f"no report written to {args.output}")


if __name__ == "__main__":
    sys.exit(main())
