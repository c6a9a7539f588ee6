"""Continuing a run from its folder: which recipe changes a resume takes, and what a rerun finds.

Design choices:
- One table, :data:`FIELDS`, puts every :class:`~bert_ds.config.TrainConfig` field (model,
  data and optimizer fields by dotted name) in one of three classes. ``REFUSED``: the saved
  state would be wrong for the new value (the weights' shapes, the optimizer's state, the
  data cursor's sample stream, the meaning of a step); a resume with such a change stops
  with one line naming every difference. ``RECORDED``: safe to change between invocations;
  each change is logged and appended to ``OUTPUT/resume_log.jsonl``. ``IGNORED``: not part
  of the recipe (where the run lives; weights a fresh run would start from). A test holds
  the table to the dataclasses, so a new field cannot go unclassified.
- The checkpoint's own ``train_config.json`` is the saved recipe; the world size, which
  is not a config field, comes from its ``train_state.json`` and is always ``RECORDED``.
- Without ``--preset`` a resume takes the model from the checkpoint (``run.sh`` and
  ``bert_ds.train`` default to different presets, so a rerun with the other command must
  not switch sizes); an explicit different preset is refused like any shape change.
- A run whose newest checkpoint is at ``--steps`` and that wrote its summary is finished:
  rerunning it says so and leaves every file as it was.
- The sequence length is refused here because one run folder holds one phase; the
  phase runner (``bert_ds.train.phases``) gives each phase its own folder and starts a new
  sequence length there from the previous phase's weights, not by resuming.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Literal

from bert_ds.checkpoint import store as checkpoint
from bert_ds.config import TrainConfig
from bert_ds.base.errors import ConfigError
from bert_ds.model.families import FAMILIES

LOG_NAME = "resume_log.jsonl"
FieldClass = Literal["refused", "recorded", "ignored"]
REFUSED: FieldClass = "refused"
RECORDED: FieldClass = "recorded"
IGNORED: FieldClass = "ignored"

# Every TrainConfig field and why it is in its class.
FIELDS: dict[str, FieldClass] = {
    # The weights' shapes and the function they compute, as every family's config names them; each
    # family's own fields are added below from its record (resume_refused; the rest are recorded).
    "model.arch": REFUSED,  # a checkpoint of one family never resumes as the other
    "model.vocab_size": REFUSED,
    "model.hidden_size": REFUSED,
    "model.num_layers": REFUSED,
    "model.num_heads": REFUSED,
    "model.intermediate_size": REFUSED,
    "model.max_position_embeddings": REFUSED,
    "model.pad_token_id": REFUSED,
    "model.cls_token_id": REFUSED,  # the tokenizer's ids: another tokenizer is another model
    "model.sep_token_id": REFUSED,
    "model.mask_token_id": REFUSED,
    # Initialisation and how the same function is computed: safe.
    "model.initializer_range": RECORDED,  # used only by a fresh start
    "model.kernels": RECORDED,
    "model.activation_checkpointing": RECORDED,
    "model.compile_layers": RECORDED,
    # The sample stream the data cursor points into, and the training objective.
    "data.train": RECORDED,  # a dataset may move; its vocabulary is checked through model.vocab_size
    "data.weights": REFUSED,
    "data.val": RECORDED,
    "data.held_out": REFUSED,  # decides which documents are training documents
    "data.max_seq_length": REFUSED,
    "data.short_seq_prob": REFUSED,
    "data.mask_rate": REFUSED,
    "data.whole_word_mask": REFUSED,
    "data.pair_task": REFUSED,
    "data.layout": REFUSED,  # another sample map: the cursor would point into other samples
    "data.token_budget": REFUSED,  # steps of another size in tokens (the cursor itself stays valid)
    "data.num_workers": RECORDED,  # samples do not depend on it
    "data.val_samples": RECORDED,
    # The optimizer's state belongs to one algorithm (moments of LAMB, StableAdamW and AdamW mean
    # different steps); its hyperparameters may be retuned. The schedule is a pure function of the
    # step and these fields (bert_ds.optim.schedule): the checkpoint holds only the step count, so
    # a changed shape applies from the next step, which is how a warmup-stable-decay run is
    # extended, or its decay branched off a stable checkpoint. A resume takes the requested values
    # (bert_ds.optim.schedule.keep_recipe_on_load), not the saved ones.
    "optim.name": REFUSED,
    "optim.lamb_variant": REFUSED,
    "optim.lr": RECORDED,
    "optim.betas": RECORDED,
    "optim.eps": RECORDED,
    "optim.weight_decay": RECORDED,
    "optim.decouple_lr": RECORDED,
    "optim.schedule": RECORDED,
    "optim.warmup_steps": RECORDED,
    "optim.decay": RECORDED,
    "optim.decay_share": RECORDED,
    "optim.final_lr_fraction": RECORDED,
    "optim.poly_power": RECORDED,
    "optim.grad_clip": RECORDED,
    # The run.
    "output": IGNORED,  # the folder being resumed, however it is spelled
    "steps": RECORDED,  # extends (or ends earlier) the run and its LR schedule
    "global_batch_size": REFUSED,  # the data cursor counts samples in steps of it
    "micro_batch_size": RECORDED,  # the same global batch, split differently
    "batch_warmup_steps": REFUSED,  # the steps' batches the cursor continues
    "batch_warmup_start": REFUSED,
    "ds_config": REFUSED,  # DeepSpeed's own files are laid out for its ZeRO stage and precision
    "seed": REFUSED,  # the sample order and masks the cursor continues
    "log_every": RECORDED,
    "val_every": RECORDED,
    "save_every": RECORDED,
    "keep_last": RECORDED,
    "exit_after": RECORDED,
    "init_from": IGNORED,  # only a fresh run reads it
    "max_bad_steps": RECORDED,
    "collective_timeout": RECORDED,
    "tensorboard": RECORDED,
    "progress": RECORDED,
    "world_size": RECORDED,  # not a config field (train_state.json has it); see R8 for what a change costs
}
# Each family's own model fields: refused where its record says a resume may not change them
# (shapes, the function computed), else recorded (its dropouts, its initialisation's details).
for _family in FAMILIES.values():
    for _name in (f.name for f in dataclasses.fields(_family.config_class)):
        FIELDS.setdefault(f"model.{_name}", REFUSED if _name in _family.resume_refused else RECORDED)
WORLD_SIZE = "world_size"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"hidden_size": 64}}`` -> ``{"model.hidden_size": 64}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _read_json(ckpt: Path, name: str) -> dict[str, Any]:
    try:
        return json.loads((ckpt / name).read_text())
    except (OSError, ValueError) as e:
        raise _damaged(ckpt, f"{ckpt / name}: unreadable ({e})") from None


def _damaged(ckpt: Path, problem: str) -> checkpoint.CheckpointError:
    """The error for a damaged newest checkpoint, with what the user can do instead."""
    previous = checkpoint.previous_complete(ckpt)
    if previous is None:
        return checkpoint.CheckpointError(f"{problem}; there is no earlier complete checkpoint: start afresh in "
                                          "another --output")
    aside = ckpt.parent.parent / f"{ckpt.name}.damaged"
    return checkpoint.CheckpointError(f"{problem}; the previous complete checkpoint is {previous}: move the damaged "
                                      f"folder out of {ckpt.parent} (e.g. mv {ckpt} {aside}) and rerun to resume from it")


def saved_model(ckpt: Path) -> dict[str, Any]:
    """The model configuration a checkpoint was trained with."""
    return _read_json(ckpt, "model_config.json")


def saved_ds_config(ckpt: Path) -> str | None:
    """The engine JSON a checkpoint was trained with (None where its recipe does not say)."""
    return _read_json(ckpt, "train_config.json").get("ds_config")


def changes(ckpt: Path, cfg: TrainConfig, world_size: int) -> list[dict[str, Any]]:
    """The differences between ``ckpt``'s recipe and ``cfg``: raises a ConfigError naming every
    refused one, returns the recorded ones as ``{"field", "saved", "requested"}``."""
    saved = flatten(_read_json(ckpt, "train_config.json"))
    saved[WORLD_SIZE] = _read_json(ckpt, "train_state.json").get(WORLD_SIZE)
    requested = flatten(json.loads(json.dumps(cfg.to_dict())))  # tuples as JSON has them: lists
    requested[WORLD_SIZE] = world_size
    differ = [(name, saved[name], requested[name]) for name in requested
              if name in saved and saved[name] != requested[name] and FIELDS[name] != IGNORED]
    refused = [d for d in differ if FIELDS[d[0]] == REFUSED]
    if refused:
        listed = "; ".join(f"{name}: saved {_show(a)}, requested {_show(b)}" for name, a, b in refused)
        raise ConfigError(f"cannot resume {ckpt} with a changed recipe: {listed} (rerun with the saved values, "
                          "or train the new recipe in another --output)")
    return [{"field": name, "saved": a, "requested": b} for name, a, b in differ]


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) or value is None else str(value)


def describe(recorded: list[dict[str, Any]]) -> str:
    return "; ".join(f"{c['field']}: saved {_show(c['saved'])}, requested {_show(c['requested'])}" for c in recorded)


def record(output: Path, ckpt: Path, step: int, recorded: list[dict[str, Any]]) -> None:
    """Append this resume and its changes to OUTPUT/resume_log.jsonl (rank 0 only)."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "checkpoint": ckpt.name, "step": step,
             "changes": recorded}
    with open(output / LOG_NAME, "a") as f:
        f.write(json.dumps(entry) + "\n")


def finished(ckpt: Path, cfg: TrainConfig) -> int | None:
    """The step of a finished run (newest checkpoint at or past ``--steps``), or None when
    there is training left to do. A run killed between its last checkpoint and its summary
    is finished too: rerunning it would write a summary of no steps (NaN losses)."""
    step = _read_json(ckpt, "train_state.json").get("step", 0)
    return step if step >= cfg.steps else None


def report_incomplete(root: Path) -> None:
    """One line per checkpoint folder that is skipped for want of its COMPLETE marker."""
    for folder in checkpoint.incomplete_steps(root):
        print(f"note: {folder} skipped: no {checkpoint.MARKER} marker (a save that never finished, or a damaged "
              "copy); it is never loaded", file=sys.stderr, flush=True)


def verify_newest(ckpt: Path) -> None:
    """checkpoint.verify, with a hint at the previous complete checkpoint when ``ckpt`` is damaged."""
    try:
        checkpoint.verify(ckpt)
    except checkpoint.CheckpointError as e:
        raise _damaged(ckpt, str(e)) from None
