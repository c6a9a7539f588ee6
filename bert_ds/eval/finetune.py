"""Fine-tune one model on one GLUE task with one seed, and score it on the task's dev sets.

The model is transformers' ``AutoModelForSequenceClassification.from_pretrained(MODEL)``, the
way any user of an export loads it (the encoder and pooler from the folder, a new classifier
layer), and the tokenizer ``AutoTokenizer.from_pretrained(MODEL)``. The loop is plain PyTorch:
transformers' ``Trainer`` would add ``accelerate`` to the dependencies for what is here a
hundred lines, and this loop is the one place to read what fine-tuning does:

- **dynamic padding, length-grouped batches**: each epoch shuffles the examples, sorts
  them by length within windows of 50 batches and shuffles the batches (transformers'
  ``group_by_length``), so a batch pads to its own longest example, not the task's;
- AdamW (fused on a GPU), weight decay off for biases and LayerNorm weights, linear warm-up
  then linear decay to zero; bf16 autocast on a GPU, fp32 on a CPU;
- classification: cross-entropy, prediction = argmax; STS-B: mean squared error on a single
  output, prediction = that output;
- the dev sets are scored after the last epoch (the paper's protocol: no early stopping).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bert_ds.eval import metrics
from bert_ds.eval.glue_data import Examples, Task
from bert_ds.eval.recipe import Recipe

GROUP_WINDOW = 50  # batches per length-sorted window


@dataclass(frozen=True)
class Encoded:
    """A split tokenized once: token ids per example (unpadded) and labels."""

    ids: list[list[int]]
    types: list[list[int]]
    labels: list[float] | list[int]


def encode(tokenizer, examples: Examples, max_seq_length: int) -> Encoded:
    columns = list(zip(*examples.texts))
    enc = tokenizer(*columns, truncation="longest_first", max_length=max_seq_length,
                    return_token_type_ids=True, return_attention_mask=False)
    return Encoded(enc["input_ids"], enc["token_type_ids"], examples.labels)


def length_grouped_batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Every index once, in batches of ``batch_size`` (the last may be short) of similar lengths."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * GROUP_WINDOW
    batches = []
    for lo in range(0, len(order), window):
        chunk = sorted(order[lo:lo + window], key=lambda i: -lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(data: Encoded, indices: list[int], pad_id: int, device: torch.device, regression: bool):
    width = max(len(data.ids[i]) for i in indices)
    ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    types = torch.zeros((len(indices), width), dtype=torch.long)
    mask = torch.zeros((len(indices), width), dtype=torch.long)
    for row, i in enumerate(indices):
        n = len(data.ids[i])
        ids[row, :n] = torch.tensor(data.ids[i])
        types[row, :n] = torch.tensor(data.types[i])
        mask[row, :n] = 1
    labels = torch.tensor([data.labels[i] for i in indices], dtype=torch.float32 if regression else torch.long)
    return {"input_ids": ids.to(device), "token_type_ids": types.to(device), "attention_mask": mask.to(device),
            "labels": labels.to(device)}


def _optimizer(model: torch.nn.Module, recipe: Recipe, device: torch.device) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.learning_rate, fused=device.type == "cuda")


def _schedule(optimizer: torch.optim.Optimizer, total: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def load_quietly(model_class, folder: Path, **kwargs):
    """``model_class.from_pretrained(folder, **kwargs)`` without transformers' load report: it
    lists the pretraining heads a task model drops and the layer it adds, at every load, which
    is the point here; errors still show."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        return model_class.from_pretrained(folder, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()


@torch.no_grad()
def predict(model, data: Encoded, batch_size: int, pad_id: int, device: torch.device, regression: bool,
            autocast) -> list[float]:
    model.eval()
    order = sorted(range(len(data.ids)), key=lambda i: len(data.ids[i]))
    out: list[float] = [0.0] * len(order)
    for lo in range(0, len(order), batch_size):
        indices = order[lo:lo + batch_size]
        batch = collate(data, indices, pad_id, device, regression)
        batch.pop("labels")
        with autocast():
            logits = model(**batch).logits.float()
        values = logits[:, 0] if regression else logits.argmax(dim=-1)
        for i, v in zip(indices, values.tolist()):
            out[i] = v
    return out


def finetune(model_dir: Path, task: Task, train: Examples, evals: dict[str, Examples], recipe: Recipe, seed: int,
             device: torch.device, progress: bool = True) -> dict[str, Any]:
    """One fine-tuning run: its dev scores per eval set, and what it did."""
    import transformers
    from tqdm import tqdm

    start = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    regression = task.labels is None
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = load_quietly(transformers.AutoModelForSequenceClassification, model_dir, num_labels=task.num_labels,
                         problem_type="regression" if regression else "single_label_classification")
    model.to(device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_enc = encode(tokenizer, train, recipe.max_seq_length)
    eval_enc = {name: encode(tokenizer, ex, recipe.max_seq_length) for name, ex in evals.items()}
    lengths = [len(x) for x in train_enc.ids]
    steps_per_epoch = math.ceil(len(lengths) / recipe.batch_size)
    total = max(1, round(steps_per_epoch * recipe.epochs))
    optimizer = _optimizer(model, recipe, device)
    schedule = _schedule(optimizer, total, int(recipe.warmup_ratio * total))
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    model.train()
    bar = tqdm(total=total, desc=f"{task.name} seed {seed}", unit="step", disable=not progress, leave=False)
    step, losses, tokens = 0, [], 0
    while step < total:
        for indices in length_grouped_batches(lengths, recipe.batch_size, rng):
            if step == total:
                break
            batch = collate(train_enc, indices, pad_id, device, regression)
            tokens += sum(lengths[i] for i in indices)
            with autocast():
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0 or step == total:
                losses.append(loss.item())
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
            bar.update(1)
    bar.close()
    results = {}
    for name, enc in eval_enc.items():
        predictions = predict(model, enc, 2 * recipe.batch_size, pad_id, device, regression, autocast)
        results[name] = metrics.scores(task.metric, predictions, enc.labels)
    return {"task": task.name, "seed": seed, "scores": results, "train_examples": len(train), "steps": total,
            "train_tokens": tokens, "final_loss": losses[-1] if losses else math.nan,
            "eval_examples": {name: len(ex) for name, ex in evals.items()},
            "seconds": time.perf_counter() - start, "device": str(device), "bf16": bf16}
