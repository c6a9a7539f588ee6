"""Does bert-ds train as well as an independent trainer? The same model, tokenizer, text and token
budget, trained by bert-ds and by transformers' ``Trainer``, scored by one evaluator.

    python -m bert_ds.tools.parity [--train-text FILE] [--heldout-text FILE] --output DIR
                                   [--preset tiny-h128] [--steps 600] [--seeds 3] [--lr 1e-3] ...

Either model family runs, the one ``--preset`` names (``tiny-h128``: BERT; ``modernbert-tiny``: a
ModernBERT-class encoder). What differs between them is read from the family's records in one
place, :func:`family`: its data settings, its transformers config and export class, and
transformers' masked-LM class of its model type.

- **The tokenizer**: for BERT a WordPiece vocabulary trained by ``python -m bert_ds.data_tools
  build --train-vocab``; for ModernBERT a byte-level BPE (its kind) trained here on the training
  text (:func:`train_bpe`, as the build trains none) and given to the build with ``--tokenizer``.
  Both of ``--vocab-size`` ids, both trainers' tokenizer (the shards' folder).
- **bert-ds**: ``python -m bert_ds.train`` as a user runs it, with the family's data defaults
  (BERT: sentence samples, 15% masking; ModernBERT: whole documents packed to a token budget, 30%),
  masked LM only (``--pair-task none``), AdamW, ZeRO-0 in fp32, linear warm-up and decay, gradient
  clipping at 1.0, weight decay 0.01; then its export.
- **transformers**: the family's masked-LM class (``BertForMaskedLM``, ``ModernBertForMaskedLM``)
  of the same configuration, made from ours by the export's mapping (``HfFamily.hf_config``, the
  special tokens' ids the tokenizer's), its own initialisation; the training text tokenized line by
  line and grouped into blocks of ``--seq-len`` tokens (``run_mlm.py``'s ``group_texts``), its
  ``DataCollatorForLanguageModeling`` at the family's masking rate (80/10/10, as bert-ds's),
  ``Trainer`` with the same optimizer settings and schedule, and as many optimizer steps as give
  it the real tokens bert-ds trained on.
- **One evaluator** scores every model, loaded as the family's masked-LM class from its folder, on
  the held-out text two ways, each a fixed set of masked batches at the family's masking rate:
  transformers' blocks (its collator, seeded) and bert-ds's held-out samples (its loader, seeded,
  the family's layout); each trainer is at home on one of them. The figures: masked-LM loss and
  accuracy, per seed, their median and spread (max - min over seeds).

The verdict compares medians: bert-ds is "not worse" where its median held-out loss exceeds
transformers' by no more than the larger of the two seed spreads. Where it is worse, that is
the first thing to find out about. Everything goes to ``OUTPUT/parity.md`` and ``parity.json``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import UserError, guarded
from bert_ds.base.interrupts import import_whole

if TYPE_CHECKING:  # torch and transformers are imported where they run: --help needs neither
    import torch

    from bert_ds.model.hf import HfFamily

SAMPLE = Path(__file__).resolve().parents[1] / "data_tools" / "sample"
BPE_SPECIALS = {"unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                "mask_token": "[MASK]"}  # ids 0-4 in this order: the pad at 3, not 0, so a trainer that took 0 shows


@dataclass(frozen=True)
class Family:
    """What parity needs of the preset's model family; :func:`family` makes it."""

    name: str  # the family (its arch), as the report names it
    hf: HfFamily  # transformers' side: hf_config (ours -> theirs), token_ids, the export's class
    mlm_class: str  # transformers' masked-LM class of the family: the independent trainer's model, the evaluator's
    data: dict[str, Any]  # bert-ds's data settings for the family (DataConfig fields), masked LM only
    bpe: bool  # the tokenizer: a byte-level BPE trained here (ModernBERT's kind), else the build's WordPiece

    @property
    def mask_rate(self) -> float:
        return self.data["mask_rate"]


def family(preset: str) -> Family:
    """The model family of ``preset``. The one place parity looks a family up: every other function
    takes what it needs from the :class:`Family` this returns."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    from bert_ds.model.families import family_of_preset

    record = family_of_preset(preset)
    # a family whose shards take a tokenizer folder (--tokenizer: ModernBERT's byte-level BPE) gets one
    # trained here; the build trains the other kind itself (BERT's WordPiece, --vocab)
    return Family(name=record.arch, hf=record.hf, mlm_class=MODEL_FOR_MASKED_LM_MAPPING_NAMES[record.hf.model_type],
                  data={**record.data_defaults, "pair_task": "none"}, bpe=record.vocab_flag == "--tokenizer")


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


def train_bpe(text: Path, vocab_size: int, folder: Path) -> Path:
    """A byte-level BPE of ``vocab_size`` ids trained on the lines of ``text``, ModernBERT's kind (no
    prefix space; ``[CLS] text [SEP]`` on encoding; :data:`BPE_SPECIALS`), saved in ``folder`` as
    transformers saves one, for ``build --tokenizer``. One already there is kept."""
    if (folder / "tokenizer.json").is_file():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=BPE_SPECIALS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = [line for line in text.read_text(encoding="utf-8").splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(BPE_SPECIALS.values()), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cls, sep = BPE_SPECIALS["cls_token"], BPE_SPECIALS["sep_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B {sep}",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))])
    tmp = folder.with_name(folder.name + ".tmp")  # a folder appears whole or not at all
    shutil.rmtree(tmp, ignore_errors=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, **BPE_SPECIALS).save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


def build_data(args: argparse.Namespace, fam: Family) -> tuple[Path, Path]:
    """The training and held-out shards, both of one tokenizer: the family's kind, of
    ``--vocab-size`` ids, trained on the training text."""
    data = args.output / "data"
    train, heldout = data / "train", data / "heldout"
    if fam.bpe:
        bpe = str(train_bpe(args.train_text, args.vocab_size, data / "tokenizer"))
        vocab = {train: ("--tokenizer", bpe), heldout: ("--tokenizer", bpe)}
    else:
        vocab = {train: ("--train-vocab", str(args.vocab_size)), heldout: ("--vocab", str(train / "vocab.txt"))}
    for folder, text in ((train, args.train_text), (heldout, args.heldout_text)):
        if not (folder / "manifest.json").is_file():
            _cli("bert_ds.data_tools", "build", "--input", str(text), "--output", str(folder), *vocab[folder],
                 "--split-sentences", "--workers", "1", log=args.output / f"build_{folder.name}.log")
    return train, heldout


def train_bert_ds(args: argparse.Namespace, train: Path, seed: int) -> tuple[Path, dict[str, Any]]:
    """Its export folder and how it trained, from its run's records: the real tokens, the steps,
    its data's layout and masking rate (the family's defaults)."""
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
    summary = json.loads((run / "summary.json").read_text())
    data = json.loads((run / "train_config.json").read_text())["data"]
    return export, {"tokens": int(summary["tokens"]), "steps": summary["steps"], "mask_rate": data["mask_rate"],
                    "layout": data["layout"], "token_budget": data["token_budget"]}


def blocks(tokenizer, text: Path, seq_len: int) -> list[list[int]]:
    """``run_mlm.py``'s ``group_texts``: every non-empty line tokenized ([CLS] ... [SEP]),
    concatenated, cut into blocks of ``seq_len`` (the remainder dropped)."""
    lines = [line for line in text.read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = [t for row in tokenizer(lines)["input_ids"] for t in row]
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def train_transformers(args: argparse.Namespace, fam: Family, train: Path, seed: int,
                       tokens: int) -> tuple[Path, dict[str, Any]]:
    """transformers' Trainer on the same budget of real tokens: its model folder and how it trained
    (the real tokens, the steps, the masking rate and the model's class, read off the objects that
    did), which ``trained.json``, written last, records."""
    import torch
    import transformers

    from bert_ds.model.families import model_preset

    out = args.output / f"transformers-seed{seed}"
    record = out / "trained.json"
    if record.is_file():
        return out, json.loads(record.read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(train)
    data = [{"input_ids": b} for b in blocks(tokenizer, args.train_text, args.seq_len)]
    steps = max(1, round(tokens / (args.batch_size * args.seq_len)))
    config = fam.hf.hf_config(model_preset(args.preset, len(tokenizer), pad_token_id=tokenizer.pad_token_id))
    for name, attribute in fam.hf.token_ids.items():  # the special tokens' ids, the tokenizer's, as the export's
        setattr(config, name, getattr(tokenizer, attribute))
    transformers.set_seed(seed)
    model = getattr(transformers, fam.mlm_class)(config)
    training = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=args.batch_size, max_steps=steps,
        learning_rate=args.lr, warmup_steps=args.warmup_steps, lr_scheduler_type="linear", weight_decay=0.01,
        max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-6, seed=seed, data_seed=seed,
        report_to=[], save_strategy="no", logging_steps=max(1, steps // 10), dataloader_num_workers=0,
        bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=fam.mask_rate)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=data, data_collator=collator)
    trainer.train()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    done = trainer.state.global_step  # every block is seq_len real tokens
    trained = {"tokens": done * args.batch_size * args.seq_len, "steps": done, "mask_rate": collator.mlm_probability,
               "model_class": type(model).__name__}
    atomic_write(record, json.dumps(trained, indent=2) + "\n")
    return out, trained


def eval_batches(args: argparse.Namespace, fam: Family, train: Path,
                 heldout: Path) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The two fixed held-out sets of masked batches at the family's masking rate: transformers'
    blocks and bert-ds's samples in the family's layout, ``--batch-size`` sequences each."""
    import transformers

    from bert_ds.config import BatchPlan, DataConfig
    from bert_ds.loader.pretraining import PretrainingLoader, open_pretraining_data

    tokenizer = transformers.AutoTokenizer.from_pretrained(train)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=fam.mask_rate,
                                                            seed=args.eval_seed)
    found = blocks(tokenizer, args.heldout_text, args.seq_len)[:args.eval_batches * args.batch_size]
    theirs = [collator([{"input_ids": b} for b in found[i:i + args.batch_size]])
              for i in range(0, len(found), args.batch_size)]
    # No token budget: the same samples, a fixed number to a batch
    cfg = DataConfig(train=[str(heldout)], max_seq_length=args.seq_len, num_workers=0,
                     **{**fam.data, "token_budget": False})
    dataset, _ = open_pretraining_data(cfg, args.eval_seed)
    loader = PretrainingLoader(dataset, BatchPlan.resolve(args.batch_size, args.batch_size, 1), rank=0, num_workers=0)
    n = min(args.eval_batches, dataset.num_samples // args.batch_size)
    ours = [{k: loader_batch[k] for k in ("input_ids", "token_type_ids", "attention_mask", "labels")}
            for loader_batch in (loader.next_step()[0] for _ in range(n))]
    return {"blocks (transformers' layout)": theirs, "samples (bert-ds's layout)": ours}


def evaluate(folder: Path, fam: Family,
             sets: dict[str, list[dict[str, torch.Tensor]]]) -> dict[str, dict[str, float]]:
    """Masked-LM loss (mean over masked tokens) and accuracy of the model in ``folder``, loaded as
    the family's masked-LM class, on each set."""
    import torch
    import transformers

    from bert_ds.checkpoint.hf_load import load_quietly

    model = load_quietly(getattr(transformers, fam.mlm_class), folder).eval()
    takes = inspect.signature(model.forward).parameters  # ModernBERT's takes no token_type_ids
    scores = {}
    for name, batches in sets.items():
        loss_sum, correct, count = 0.0, 0, 0
        for batch in batches:
            labels = batch["labels"]
            inputs = {k: v for k, v in batch.items() if k != "labels" and k in takes}
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
    import_whole("torch", "transformers")
    fam = family(args.preset)  # an unknown preset is refused here, before anything is written
    args.output.mkdir(parents=True, exist_ok=True)
    _same_settings(args)
    train, heldout = build_data(args, fam)
    sets = eval_batches(args, fam, train, heldout)
    runs: dict[str, list[dict[str, Any]]] = {"bert-ds": [], "transformers": []}
    for seed in range(args.seed, args.seed + args.seeds):
        ours, our_run = train_bert_ds(args, train, seed)
        theirs, their_run = train_transformers(args, fam, train, seed, our_run["tokens"])
        runs["bert-ds"].append({"seed": seed, **our_run, "scores": evaluate(ours, fam, sets)})
        runs["transformers"].append({"seed": seed, **their_run, "scores": evaluate(theirs, fam, sets)})
        print(f"seed {seed}: " + "; ".join(
            f"{who} loss " + "/".join(f"{s['loss']:.3f}" for s in r[-1]["scores"].values())
            for who, r in runs.items()), flush=True)
    summary = summarize(runs)
    report = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "family": {"name": fam.name, "export_class": fam.hf.transformers_class, "mlm_class": fam.mlm_class,
                         "tokenizer": "byte-level BPE" if fam.bpe else "WordPiece", "mask_rate": fam.mask_rate,
                         "layout": fam.data["layout"], "token_budget": fam.data["token_budget"]},
              "eval_batches": {name: len(b) for name, b in sets.items()}, "runs": runs, "summary": summary,
              "verdicts": verdicts(summary)}
    atomic_write(args.output / "parity.json", json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    atomic_write(args.output / "parity.md", text)
    print(text, end="")
    return report


def markdown(report: dict[str, Any]) -> str:
    s, f = report["settings"], report["family"]
    tokens = {who: (statistics.median(r["tokens"] for r in rs), statistics.median(r["steps"] for r in rs))
              for who, rs in report["runs"].items()}
    lines = [f"## Parity: bert-ds against transformers' Trainer ({s['preset']}, seq {s['seq_len']}, batch "
             f"{s['batch_size']}, AdamW lr {s['lr']:g}, {s['seeds']} seeds)", "",
             f"Family {f['name']}: bert-ds trains it on its {f['layout']} layout (token budget "
             f"{'on' if f['token_budget'] else 'off'}) and exports `{f['export_class']}`; transformers' `Trainer` "
             f"trains `{f['mlm_class']}`, as which the evaluator loads every model. Both mask {f['mask_rate']:.0%} "
             f"of the tokens; the tokenizer is a {s['vocab_size']:,}-id {f['tokenizer']} trained on the "
             "training text.", "",
             "Tokens trained on (median over seeds): " + ", ".join(f"{who} {n:,.0f} in {steps:,.0f} steps"
                                                                   for who, (n, steps) in tokens.items())
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
    p.add_argument("--preset", default="tiny-h128",
                   help="the model, of either family: tiny-h128 (BERT), modernbert-tiny, ... (default: tiny-h128)")
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
