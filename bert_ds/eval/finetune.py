"""Fine-tune one model on one GLUE task with one seed, and score it on the task's dev sets.

The model is transformers' ``AutoModelForSequenceClassification.from_pretrained(MODEL)``, the
way any user of an export loads it: the encoder from the folder and the class head the model's
family has (BERT's pooler and a new classifier layer; ModernBERT's head on the first token, or
the tokens' mean, and a new classifier layer), and the tokenizer
``AutoTokenizer.from_pretrained(MODEL)``, padding and truncating on the right whatever its
settings say (the commands read scores by position from the left). Nothing here names a model
family: a model gets the inputs its ``forward`` takes (``token_type_ids`` for BERT, none for
ModernBERT), as the Trainer gives them. Training is transformers' ``Trainer``, the fine-tuning
loop users know (and the one that takes a DeepSpeed config when a model outgrows one GPU), set
to the recipe:

- **dynamic padding, length-grouped batches**: ``DataCollatorWithPadding`` pads each batch
  to its own longest example, ``train_sampling_strategy="group_by_length"`` puts examples
  of similar length together;
- AdamW (fused on a GPU), weight decay off for biases and LayerNorm weights (the Trainer's
  rule), linear warm-up over ``warmup_ratio`` of the steps then linear decay to zero; bf16 on a
  GPU that has it, fp32 on a CPU;
- classification: cross-entropy, prediction = argmax; STS-B: mean squared error on a single
  output, prediction = that output;
- the dev sets are scored after the last epoch (the paper's protocol: no early stopping),
  nothing is saved but the scores.
"""

from __future__ import annotations

import inspect
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bert_ds.checkpoint.hf_load import load_quietly
from bert_ds.eval import metrics
from bert_ds.eval.glue_data import Examples, Task
from bert_ds.eval.recipe import Recipe


def encode(tokenizer, examples: Examples, max_seq_length: int) -> list[dict[str, Any]]:
    """Each example tokenized once (the longer text of a pair truncated first), with its label."""
    columns = list(zip(*examples.texts))
    enc = tokenizer(*columns, truncation="longest_first", max_length=max_seq_length, return_token_type_ids=True)
    return [{"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": label}
            for ids, types, mask, label in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"],
                                               examples.labels)]


def load_tokenizer(folder: Path):
    """``AutoTokenizer.from_pretrained(folder)``, padding and truncating on the right."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(folder, padding_side="right", truncation_side="right")


def model_inputs(model, batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` less what ``model.forward`` does not name (ModernBERT's takes no
    ``token_type_ids``), the rule transformers' ``Trainer`` applies to the batches it feeds."""
    names = inspect.signature(model.forward).parameters
    return {k: v for k, v in batch.items() if k in names}


def training_arguments(recipe: Recipe, seed: int, device: torch.device, progress: bool, scratch: str):
    """The recipe as the Trainer's settings."""
    import transformers

    return transformers.TrainingArguments(
        output_dir=scratch, per_device_train_batch_size=recipe.batch_size,
        per_device_eval_batch_size=2 * recipe.batch_size, learning_rate=recipe.learning_rate,
        num_train_epochs=recipe.epochs, warmup_steps=recipe.warmup_ratio, lr_scheduler_type="linear",
        weight_decay=recipe.weight_decay, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
        train_sampling_strategy="group_by_length", seed=seed, data_seed=seed,
        bf16=device.type == "cuda" and torch.cuda.is_bf16_supported(), use_cpu=device.type == "cpu",
        report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
        disable_tqdm=not progress)


def quiet_trainer(model, args, train_dataset, data_collator=None):
    """transformers' ``Trainer`` on these settings, made quiet (:func:`quieten`)."""
    import transformers

    return quieten(transformers.Trainer(model=model, args=args, train_dataset=train_dataset,
                                        data_collator=data_collator))


def quieten(trainer):
    """``trainer`` (transformers' ``Trainer`` or a subclass) without the dict of run statistics
    (``{'train_runtime': ...}``) it prints at the end of every run, between the command's own
    lines; the progress bar stays when its arguments ask for it."""
    import transformers

    class ProgressBar(transformers.ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            pass

    trainer.remove_callback(transformers.PrinterCallback)  # the logs' printer when the bar is off
    if trainer.pop_callback(transformers.ProgressCallback) is not None:
        trainer.add_callback(ProgressBar)
    return trainer


def finetune(model_dir: Path, task: Task, train: Examples, evals: dict[str, Examples], recipe: Recipe, seed: int,
             device: torch.device, progress: bool = True) -> dict[str, Any]:
    """One fine-tuning run: its dev scores per eval set, and what it did."""
    import transformers

    start = time.perf_counter()
    regression = task.labels is None
    transformers.set_seed(seed)  # the new classifier layer's initialisation
    tokenizer = load_tokenizer(model_dir)
    model = load_quietly(transformers.AutoModelForSequenceClassification, model_dir, num_labels=task.num_labels,
                         problem_type="regression" if regression else "single_label_classification")
    train_set = encode(tokenizer, train, recipe.max_seq_length)
    with tempfile.TemporaryDirectory(prefix="bert_ds-glue-") as scratch:
        args = training_arguments(recipe, seed, device, progress, scratch)
        tuner = quiet_trainer(model, args, train_set, transformers.DataCollatorWithPadding(tokenizer))
        outcome = tuner.train()
        scores = {}
        for name, examples in evals.items():
            # group_by_length orders the dev set too: each prediction is scored against the label
            # the Trainer returns beside it, never against the file's order
            output = tuner.predict(encode(tokenizer, examples, recipe.max_seq_length))
            logits = torch.as_tensor(output.predictions)
            predictions = logits[:, 0] if regression else logits.argmax(dim=-1)
            labels = torch.as_tensor(output.label_ids).tolist()
            returned, given = torch.tensor(sorted(labels)), torch.tensor(sorted(examples.labels))
            if returned.shape != given.shape or not torch.allclose(returned.double(), given.double(), atol=1e-5):
                raise RuntimeError(f"{task.name} {name}: the Trainer returned other labels than the dev set's")
            scores[name] = metrics.scores(task.metric, predictions.tolist(), labels)
    lengths = [len(x["input_ids"]) for x in train_set]
    return {"task": task.name, "seed": seed, "scores": scores, "train_examples": len(train),
            "steps": outcome.global_step, "train_tokens_per_epoch": sum(lengths),
            "mean_train_loss": outcome.training_loss if math.isfinite(outcome.training_loss) else None,
            "eval_examples": {name: len(ex) for name, ex in evals.items()},
            "seconds": time.perf_counter() - start, "device": str(device), "bf16": args.bf16}
