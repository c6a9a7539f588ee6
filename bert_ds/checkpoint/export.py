"""Export a bert-ds checkpoint as a Hugging Face folder: ``BertForPreTraining`` for BERT,
``ModernBertForMaskedLM`` for a ModernBERT-class model.

    python -m bert_ds.checkpoint.export CHECKPOINT_DIR OUT_DIR

The checkpoint folder (written by :mod:`bert_ds.checkpoint.store`) holds
``model.safetensors`` (fp32, our parameter names, the tied decoder weight present
or not), ``model_config.json`` (the model config's ``to_dict``, with its ``arch``) and
``tokenizer/``. The export holds ``config.json``, ``model.safetensors`` and the tokenizer files.

Design choices, and why:

- Our parameter names are Hugging Face's, so the export copies tensors; the only
  difference is that the tied aliases (BERT's ``cls.predictions.decoder.{weight,bias}``,
  ModernBERT's ``decoder.weight``) are left out of the file, as ``save_pretrained`` does,
  and re-tied on load. What differs between the families is in each family's record (its ``hf``).
- Nothing appears at OUT_DIR unless it round-trips: the export is written to
  ``OUT_DIR.tmp-XXXX``, loaded back with transformers' class ``from_pretrained``,
  its logits compared with our model's on a fixed input (max abs diff <= 1e-4,
  fp32), and only then renamed into place. An existing export is replaced only
  after that; a directory that is not an earlier export is never replaced.
- Pre-LN BERT models have no Hugging Face counterpart and are refused.
- torch, safetensors and transformers are imported by the functions that use them, not at the
  top: the command answers ``--help`` without them, and :mod:`.hf_import` reads the config
  mapping from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from bert_ds.base.atomic import as_umask_allows, fsync_path
from bert_ds.base.errors import UserError, describe, guarded
from bert_ds.base.interrupts import deferred_interrupt, import_whole
from bert_ds.checkpoint.hf_load import load_quietly
from bert_ds.model.config import SPECIAL_TOKEN_IDS
from bert_ds.model.families import AnyModelConfig, family_of, family_of_hf, model_config_from_dict
from bert_ds.model.hf import HfFamily

if TYPE_CHECKING:
    import torch

# The largest logit difference, fp32, between our model and the export, over the logits' scale (at least
# 1: bert_ds.model.hf.relative_gap). At random init it measured 2.2e-6 for BERT-Base, 1.1e-6 for
# ModernBERT-base, 2e-7 for the tiny presets (2-core AMD EPYC, 2026-12-06; the same with
# MKL_ENABLE_INSTRUCTIONS=AVX2 and SSE4_2).
ROUND_TRIP_TOLERANCE = 1e-5
_EXPORT_FILES = ("config.json", "model.safetensors")  # what marks a folder as an earlier export
# transformers 5's name of a tokenizer that is its tokenizer.json alone: transformers 4 refuses a folder
# naming it ("does not exist"), while both load that file as PreTrainedTokenizerFast.
_TRANSFORMERS5_TOKENIZER_CLASSES = ("TokenizersBackend",)


class ExportError(UserError):
    """The checkpoint cannot be exported, or its export does not reproduce the model."""


def to_hf_config(config: AnyModelConfig):
    """transformers' config of ``config``'s family (a pre-LN BERT raises :class:`ConfigError`)."""
    return family_of(config).hf.hf_config(config)


def from_hf_config(values: Mapping[str, object], where: Path) -> dict[str, object]:
    """The fields of our model config (its ``arch`` among them) a Hugging Face ``config.json``
    states; a :class:`ConfigError` for another model type, or an option our model of that family
    does not compute the same way."""
    return family_of_hf(values, where).hf.from_hf(values, where)


def export_hf(state_dict: Mapping[str, torch.Tensor], config: AnyModelConfig,
              tokenizer_dir: Path | None, out_dir: Path) -> Path:
    """Writes a Hugging Face folder for ``state_dict`` at ``out_dir`` and returns its path.

    ``state_dict`` uses our (= Hugging Face's) names; the tied aliases may be absent.
    Tensors are written as fp32. Raises :class:`ExportError` if the export does not
    reproduce our model's logits, in which case ``out_dir`` is left untouched.
    """
    import torch
    from safetensors import SafetensorError

    from bert_ds.checkpoint import store as checkpoint

    hf_config = to_hf_config(config)
    family = family_of(config).hf
    out_dir = Path(os.path.abspath(out_dir))
    _check_replaceable(out_dir)
    full_state = _with_tied_aliases(state_dict, family)
    _check_keys(full_state, config)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as err:
        raise ExportError(f"cannot write {out_dir}: {describe(err)}") from None
    try:
        as_umask_allows(tmp)
        _take_token_ids(hf_config, config, family, None if tokenizer_dir is None else Path(tokenizer_dir))
        hf_config.save_pretrained(tmp)
        tensors = {name: tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
                   for name, tensor in full_state.items() if name not in family.tied_aliases}
        checkpoint.save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        if tokenizer_dir is not None:
            _copy_tokenizer(Path(tokenizer_dir), tmp, config.max_position_embeddings)
        _check_round_trip(full_state, config, family, tmp)
        _fsync_folder(tmp)
        _replace_folder(tmp, out_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, (OSError, SafetensorError)):  # disk full, a folder made read-only meanwhile
            raise ExportError(f"export to {out_dir} not written ({describe(err)}); "
                              f"{out_dir} is as it was") from None
        raise
    return out_dir


def export_checkpoint(ckpt_dir: Path, out_dir: Path) -> Path:
    """Exports a checkpoint to ``out_dir``.

    ``ckpt_dir`` is a checkpoint folder, ``checkpoints/latest``, ``checkpoints/`` or the run
    folder that holds it (the newest complete checkpoint); only a
    complete checkpoint whose files match their recorded checksums is exported.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from bert_ds.checkpoint import store as checkpoint

    ckpt = checkpoint.resolve(Path(ckpt_dir))
    checkpoint.verify(ckpt)
    weights, config_file, tokenizer_dir = (ckpt / "model.safetensors", ckpt / "model_config.json",
                                           ckpt / "tokenizer")
    for required in (weights, config_file, tokenizer_dir):
        if not required.exists():
            raise ExportError(f"checkpoint {ckpt} is missing {required.name} ({required})")
    try:
        config_values = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot read {config_file}: {err}") from err
    if not isinstance(config_values, dict):
        raise ExportError(f"{config_file} must hold a JSON object")
    config = model_config_from_dict(config_values)
    try:
        state_dict = load_file(str(weights))
    except (OSError, SafetensorError) as err:
        raise ExportError(f"cannot read {weights}: {err}") from err
    return export_hf(state_dict, config, tokenizer_dir, out_dir)


# --------------------------------------------------------------------------- steps

def _with_tied_aliases(state_dict: Mapping[str, torch.Tensor], family: HfFamily) -> dict[str, torch.Tensor]:
    """The state dict with the tied aliases present, checking that given ones are really tied."""
    import torch

    full = dict(state_dict)
    for alias, target in family.tied_aliases.items():
        if target not in full:
            continue  # reported by _check_keys
        if alias not in full:
            full[alias] = full[target]
        elif not torch.equal(full[alias].float(), full[target].float()):
            raise ExportError(f"{alias} differs from {target}; the export needs them tied")
    return full


def _take_token_ids(hf_config, config: AnyModelConfig, family: HfFamily, tokenizer_dir: Path | None) -> None:
    """The special tokens' ids of the export's config (the pad; ModernBERT's cls, sep, bos, eos): the
    model's, which its run took from its data's manifest, and which must be its tokenizer files'
    (an :class:`ExportError` naming the first that is not). A run saved before they were kept
    (cls, sep, mask None; pad 0 from before the pad was taken) takes the tokenizer's.
    transformers' own defaults would be ModernBERT's vocabulary's ids."""
    tokenizer = None
    if tokenizer_dir is not None and tokenizer_dir.is_dir():
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    theirs = {name: getattr(tokenizer, name, None) for name in SPECIAL_TOKEN_IDS} if tokenizer else {}
    ours = {name: getattr(config, name) for name in SPECIAL_TOKEN_IDS}
    for name in SPECIAL_TOKEN_IDS[1:]:  # the pad is checked where the model was trained with the tokenizer's
        if ours[name] is not None and theirs.get(name) is not None and ours[name] != theirs[name]:
            raise ExportError(f"the model was trained with {name} {ours[name]}, but the tokenizer files in "
                              f"{tokenizer_dir} give {theirs[name]}: they are another tokenizer's")
    for hf_name, name in family.token_ids.items():
        # the pad: the tokenizer's first (a run saved before it was taken holds 0); the others: the model's
        first, second = (theirs, ours) if name == "pad_token_id" else (ours, theirs)
        value = first.get(name) if first.get(name) is not None else second.get(name)
        if value is not None:
            setattr(hf_config, hf_name, value)


def _check_keys(state_dict: Mapping[str, torch.Tensor], config: AnyModelConfig) -> None:
    """The names and shapes must be those of our model for ``config``."""
    from bert_ds.model.build import meta_model

    expected = meta_model(dataclasses.replace(config, kernels="torch")).state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ExportError(f"state dict does not match the model config: missing {missing or 'none'}, "
                          f"unexpected {unexpected or 'none'}")
    for name, tensor in expected.items():
        if tuple(state_dict[name].shape) != tuple(tensor.shape):
            raise ExportError(f"{name} has shape {tuple(state_dict[name].shape)}, "
                              f"the model config needs {tuple(tensor.shape)}")


def _copy_tokenizer(tokenizer_dir: Path, dest: Path, max_length: int) -> None:
    """The tokenizer files, its config saying how long an input the model takes (transformers
    otherwise writes model_max_length 1e30, and ``tok(text, truncation=True)`` would hand
    the model more positions than it has) and naming a class transformers 4 and 5 both load."""
    if not tokenizer_dir.is_dir():
        raise ExportError(f"tokenizer folder {tokenizer_dir} does not exist")
    files = [path for path in sorted(tokenizer_dir.iterdir()) if path.is_file()]
    if not files:
        raise ExportError(f"tokenizer folder {tokenizer_dir} is empty")
    for path in files:
        if path.name in _EXPORT_FILES:
            raise ExportError(f"tokenizer folder {tokenizer_dir} holds {path.name}, which the export writes")
        shutil.copyfile(path, dest / path.name)  # a new file, with the umask's permissions (not the source's)
    config = dest / "tokenizer_config.json"
    try:
        settings = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    except ValueError as err:
        raise ExportError(f"{tokenizer_dir / config.name}: not valid JSON ({err})") from None
    settings["model_max_length"] = max_length
    if settings.get("tokenizer_class") in _TRANSFORMERS5_TOKENIZER_CLASSES and (dest / "tokenizer.json").is_file():
        settings["tokenizer_class"] = "PreTrainedTokenizerFast"  # the same tokenizer.json, a name 4 and 5 both load
    config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_round_trip(state_dict: Mapping[str, torch.Tensor], config: AnyModelConfig, family: HfFamily,
                      export_dir: Path) -> None:
    """Loads the export with transformers and compares its logits with our model's."""
    import transformers

    from bert_ds.model.build import build_model

    ours = build_model(dataclasses.replace(config, kernels="torch", activation_checkpointing=False,
                                           compile_layers=False))
    ours.load_state_dict({name: tensor.float() for name, tensor in state_dict.items()})
    theirs, info = load_quietly(getattr(transformers, family.transformers_class), export_dir,
                                attn_implementation="eager", output_loading_info=True)
    problems = {kind: keys for kind, keys in info.items() if keys}
    if problems:
        raise ExportError(f"transformers loaded the export with problems: {problems}")
    ours.eval()
    theirs.eval()
    diff = family.probe(ours, theirs, config)
    if not diff <= ROUND_TRIP_TOLERANCE:  # written so that NaN fails too
        raise ExportError(f"the export does not reproduce the model: logits {diff:.3g} of their scale apart "
                          f"> {ROUND_TRIP_TOLERANCE} (transformers {transformers.__version__})")

    if any(export_dir.glob("tokenizer*.json")) or (export_dir / "vocab.txt").exists():
        tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
        if len(tokenizer) > config.vocab_size:
            raise ExportError(f"the tokenizer has {len(tokenizer)} tokens but the model only "
                              f"{config.vocab_size} embeddings")


def _check_replaceable(out_dir: Path) -> None:
    """Refuses an OUT_DIR whose replacement would destroy something other than an export."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ExportError(f"output path {out_dir} exists and is not a folder")
    is_export = all((out_dir / name).is_file() for name in _EXPORT_FILES)
    if not is_export and any(out_dir.iterdir()):
        raise ExportError(f"output folder {out_dir} exists and is not an earlier export; "
                          "remove it or choose another path")


def _fsync_folder(folder: Path) -> None:
    """Flushes the export's files and the folder entry, so the rename publishes complete files."""
    for path in folder.iterdir():
        fsync_path(path)
    fsync_path(folder)


def _replace_folder(new: Path, dest: Path) -> None:
    """Moves ``new`` to ``dest``; an existing ``dest`` is set aside first and deleted after."""
    # A non-empty folder cannot be atomically swapped, so the old one moves aside first.
    # A Ctrl-C waits for the end (bert_ds.base.interrupts): the old folder is never left half deleted beside it.
    with deferred_interrupt():
        old = dest.with_name(f"{dest.name}.old-{uuid.uuid4().hex[:8]}") if dest.exists() else None
        if old is not None:
            os.rename(dest, old)
        try:
            os.rename(new, dest)
        except BaseException:
            if old is not None:
                os.rename(old, dest)
            raise
        if old is not None:
            shutil.rmtree(old)


# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bert_ds.checkpoint.export",
        description="Export a bert-ds checkpoint as a Hugging Face folder (BertForPreTraining, or "
                    "ModernBertForMaskedLM for a ModernBERT-class model: config.json, model.safetensors, tokenizer "
                    "files), checked by loading it back.",
    )
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", type=Path,
                        help="checkpoint folder (or its 'latest' link) with model.safetensors, "
                             "model_config.json and tokenizer/; a run folder or its checkpoints/: the newest")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path,
                        help="folder to write; an earlier export there is replaced once the new one is complete")
    args = parser.parse_args(argv)

    def body() -> None:
        from bert_ds.checkpoint import store

        ckpt = store.resolve(args.checkpoint_dir)
        import_whole("torch", "safetensors.torch", "transformers")  # a wrong path is said before them
        named = args.checkpoint_dir if args.checkpoint_dir.resolve() == ckpt else f"{args.checkpoint_dir} ({ckpt.name})"
        export_checkpoint(ckpt, args.out_dir)
        print(f"exported {named} to {args.out_dir}")  # both as the user named them

    return guarded(body, interrupted=f"{args.out_dir} holds no partial export (an earlier one is replaced only "
                                     "by a complete one)")


if __name__ == "__main__":
    sys.exit(main())
