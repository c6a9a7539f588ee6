"""``--init-from``: start a fresh run from the weights users have.

A source is one of:

- a Hugging Face folder of either model family: ``config.json`` and ``model.safetensors`` or
  ``pytorch_model.bin``, or either sharded as ``save_pretrained`` shards a large model
  (``model.safetensors.index.json``, ``pytorch_model.bin.index.json`` and the shards they
  name), of ``BertForPreTraining``, ``BertForMaskedLM`` or ``BertModel``, or of
  ``ModernBertForMaskedLM`` or ``ModernBertModel`` (ModernBERT, mmBERT, Ettin; a
  ``bert_ds.checkpoint.export`` is one); a weights file of such a folder given directly (a
  ``.safetensors`` or an index) takes its ``config.json``;
- a bert_ds checkpoint folder, its ``latest`` link, a ``checkpoints/`` folder or a run folder
  (the newest complete checkpoint, checked against its marker's CRCs);
- a bare ``.safetensors`` file with our parameter names (its architecture: ``--preset``).

Design choices, and why:

- **The architecture comes from the source.** The fields that decide the weights' shapes
  and the function they compute are the ones a resume refuses to change
  (:data:`bert_ds.checkpoint.resume.FIELDS`), so that table defines them here too; the source's
  ``initializer_range`` comes along for the heads that start fresh. Dropout is
  regularisation, not architecture: bert_ds's defaults (or ``--dropout``) apply. A
  ``--preset`` that disagrees with the source is an error naming every differing size,
  never a silent pick of one of the two.
- **The family comes from the source too** (``model_type``, or a checkpoint's ``arch``): a
  BERT folder never starts a ModernBERT run or the reverse, and a ``--preset`` of the other
  family is refused. What differs between the families (names, tied aliases, heads) is in
  each family's record (:mod:`bert_ds.model.families`).
- **Names as transformers accepts them.** Our parameter names are Hugging Face's, so a
  ``BertForPreTraining`` or ``ModernBertForMaskedLM`` state dict loads as it is. A base model
  (``BertModel``, ``ModernBertModel``) saves without its ``bert.``/``model.`` prefix; old BERT
  checkpoints name LayerNorm parameters ``gamma``/``beta`` (transformers renames
  ``LayerNorm.gamma``/``LayerNorm.beta``, and so do we); older transformers saved the
  ``position_ids``/``token_type_ids`` buffers, which carry no weights. The tied decoder
  aliases must equal what they alias. Heads the source lacks (the pooler and NSP head of a
  ``BertForMaskedLM``, every head of a base model) keep their fresh initialisation and
  are listed; a missing encoder weight, or a source tensor left unmatched, is an error
  naming it: loading half a model silently is worse than not starting.
- **``pytorch_model.bin`` is read with ``torch.load(weights_only=True)``**: a pickle from
  the internet must not run code.
- **The shards must speak the model's vocabulary**: the size always (else the embedding
  rows mean other tokens), and the tokens and normalizer themselves where the source has
  a tokenizer, compared with the dataset's; the first difference is named.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bert_ds.checkpoint import store as checkpoint
from bert_ds.checkpoint.export import from_hf_config
from bert_ds.model.config import SPECIAL_TOKEN_IDS
from bert_ds.model.families import (DEFAULT_ARCH, PRESETS, AnyModelConfig, family, family_of, family_of_preset,
                                    model_config_from_dict)
from bert_ds.model.hf import HfFamily
from bert_ds.checkpoint.resume import FIELDS, REFUSED
from bert_ds.base.errors import UserError, describe
from bert_ds.data_tools.fast_tokenizer import load_fast_tokenizer
from bert_ds.data_tools.manifest import MANIFEST_NAME, Manifest, given_tokenizer
from bert_ds.data_tools.tokenizer import load_vocabulary, vocab_entries

# What a source decides about the model: the fields a resume may not change, and the init of fresh heads;
# not the special tokens' ids, which are the data's (its tokenizer's, held to the source's by check_vocabulary).
ARCHITECTURE = tuple(name.removeprefix("model.") for name, kind in FIELDS.items()
                     if name.startswith("model.") and kind == REFUSED
                     and name.removeprefix("model.") not in SPECIAL_TOKEN_IDS) + ("initializer_range",)
# In transformers' order of preference: one file, else an index of shards.
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
INDEX_SUFFIX = ".index.json"
HF_CONFIG = "config.json"


class InitFromError(UserError):
    """An --init-from source that cannot start this run."""


@dataclass(frozen=True)
class InitSource:
    """Where an --init-from source keeps what a run needs of it."""

    path: Path  # as given
    weights: Path  # the weights file
    model: dict[str, Any] | None  # the ARCHITECTURE fields it states; None for a bare weights file
    described_by: Path | None  # the config.json or model_config.json that stated them
    tokenizer: Path | None  # a folder with its tokenizer files, if it has one

    @property
    def origin(self) -> str:
        return f"--init-from {self.path}"


def open_source(path: Path) -> InitSource:
    """The source at ``path``, checked without loading its tensors (a checkpoint against its marker)."""
    path = Path(path)
    if not path.exists():
        raise InitFromError(f"--init-from {path}: no such file or folder")
    if path.is_file():
        weights_like = path.suffix == ".safetensors" or path.name.endswith(INDEX_SUFFIX)
        if weights_like and (path.parent / HF_CONFIG).is_file():  # a file of a Hugging Face folder: its config
            return dataclasses.replace(_hf_folder(path.parent, weights=path), path=path)
        if path.suffix != ".safetensors":
            raise InitFromError(f"--init-from {path}: give the folder that holds it and its {HF_CONFIG}, "
                                "or a .safetensors file")
        return InitSource(path, checkpoint.weights_file(path), None, None, None)
    if (path / HF_CONFIG).is_file():
        return _hf_folder(path)
    if not _is_checkpoint(path):
        raise InitFromError(f"--init-from {path}: neither a Hugging Face model folder (no {HF_CONFIG}) nor a "
                            "bert_ds checkpoint or run folder")
    weights = checkpoint.weights_file(path)
    saved, tokenizer = weights.parent / "model_config.json", weights.parent / "tokenizer"
    try:
        model = json.loads(saved.read_text())
    except (OSError, ValueError) as e:
        raise InitFromError(f"{saved}: unreadable ({e})") from None
    return InitSource(path, weights, _architecture({"arch": DEFAULT_ARCH, **model}), saved,
                      tokenizer if tokenizer.is_dir() else None)


def _is_checkpoint(path: Path) -> bool:
    """A checkpoint folder, its ``latest`` link, a folder of them or a run folder (complete or not:
    ``store.resolve`` finds the newest, or names a partial one)."""
    return (checkpoint.run_checkpoints(path).is_dir() or (path / checkpoint.MARKER).is_file() or path.name == checkpoint.LATEST or path.name.startswith("step_")
            or any(path.glob("step_*")))


def _hf_folder(folder: Path, weights: Path | None = None) -> InitSource:
    """``folder``'s config and weights (``weights``: the file the user named, else transformers' pick)."""
    config = folder / HF_CONFIG
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InitFromError(f"{config}: unreadable ({describe(e) if isinstance(e, OSError) else e})") from None
    if not isinstance(values, dict):
        raise InitFromError(f"{config}: not a JSON object")
    model = _architecture(from_hf_config(values, config))
    weights = weights or next((folder / name for name in HF_WEIGHTS if (folder / name).is_file()), None)
    if weights is None:
        raise InitFromError(f"{folder}: holds {HF_CONFIG} but none of {', '.join(HF_WEIGHTS)}")
    files = list(shards(weights)) if weights.name.endswith(INDEX_SUFFIX) else [weights]
    for file in files:
        if file.suffix == ".safetensors":
            checkpoint.weights_file(file)  # a damaged file fails here, before any rank starts
    has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "vocab.txt").is_file()
    return InitSource(folder, weights, model, config, folder if has_tokenizer else None)


def _architecture(model: dict[str, Any]) -> dict[str, Any]:
    return {name: model[name] for name in ARCHITECTURE if name in model}


def model_config(source: InitSource, preset: str | None, given: dict[str, Any]) -> AnyModelConfig:
    """The model of a run started from ``source`` (which states its architecture and family).
    ``given``: the fields the command line sets, ``vocab_size`` (the shards') among them. The
    model keeps its own embedding rows: as many as the shards' tokenizer has ids, or more (a
    ModernBERT pads its 50,283 ids to 50,368 rows, which no id reaches)."""
    arch = source.model
    if arch.get("vocab_size", 0) < given["vocab_size"]:
        flag = family(arch["arch"]).vocab_flag
        raise InitFromError(f"{source.origin}: the model has {arch.get('vocab_size')} token embeddings but the "
                            f"shards' tokenizer {given['vocab_size']} tokens; build the shards with the model's "
                            f"tokenizer (python -m bert_ds.data_tools build {flag} "
                            f"{source.tokenizer or 'ITS_TOKENIZER'} ...)")
    given = {**given, "vocab_size": arch["vocab_size"]}
    if preset is not None:
        if preset not in PRESETS:
            raise InitFromError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        if family_of_preset(preset).arch != arch["arch"]:
            raise InitFromError(f"--preset {preset} is a {family_of_preset(preset).arch} model, but {source.described_by} "
                                f"holds a {arch['arch']} model; leave --preset out to take the source's")
        differ = [f"{name} {value} vs {arch.get(name)}" for name, value in PRESETS[preset].items()
                  if name != "arch" and arch.get(name) != value]
        if differ:
            raise InitFromError(f"--preset {preset} disagrees with {source.described_by}: {', '.join(differ)} "
                                "(preset vs source); leave --preset out to take the source's")
    return model_config_from_dict({**arch, **given})


def check_vocabulary(source: InitSource, dataset: Path) -> None:
    """The dataset's tokenizer must be the source's, token for token and in its normalizer (where
    the source has a tokenizer; its size is checked by :func:`model_config`). A dataset built with
    ``--tokenizer`` is held to the source's tokenizer by its vocabulary's fingerprint (every id's
    token and the special ids, :func:`bert_ds.data_tools.fast_tokenizer.vocabulary_fingerprint`)."""
    if source.tokenizer is None:
        return
    if (dataset / MANIFEST_NAME).is_file():
        manifest = Manifest.load(dataset)
        if given_tokenizer(manifest):
            _check_fast_tokenizer(source, dataset, manifest)
            return
    theirs, their_norm = load_vocabulary(str(source.tokenizer))
    ours, our_norm = load_vocabulary(str(dataset))
    model_tokens, data_tokens = vocab_entries(theirs), vocab_entries(ours)
    for i, (a, b) in enumerate(zip(model_tokens, data_tokens)):
        if a != b:
            raise InitFromError(f"{source.origin}: token {i} is {a!r} in the model's tokenizer ({source.tokenizer}) "
                                f"but {b!r} in the shards' ({dataset}); build the shards with "
                                f"--vocab {source.tokenizer}")
    if len(model_tokens) != len(data_tokens):
        raise InitFromError(f"{source.origin}: the model's tokenizer has {len(model_tokens)} tokens, the shards' "
                            f"({dataset}) {len(data_tokens)}; build the shards with --vocab {source.tokenizer}")
    if their_norm is not None and our_norm is not None and their_norm != our_norm:
        raise InitFromError(f"{source.origin}: the model's tokenizer normalizes text as {their_norm}, the shards' "
                            f"({dataset}) as {our_norm}; build the shards with --vocab {source.tokenizer}")


def _check_fast_tokenizer(source: InitSource, dataset: Path, manifest: Manifest) -> None:
    try:
        theirs = load_fast_tokenizer(str(source.tokenizer))
    except UserError as e:
        raise InitFromError(f"{source.origin}: its tokenizer cannot be compared with the shards' ({e})") from None
    if theirs.fingerprint != manifest.tokenizer_fingerprint:
        raise InitFromError(f"{source.origin}: the model's tokenizer ({source.tokenizer}) is not the one the shards "
                            f"were built with ({dataset}: another vocabulary or other special ids); build the shards "
                            f"with --tokenizer {source.tokenizer}")


def shards(index: Path) -> dict[Path, list[str]]:
    """The shard files a transformers index (``*.index.json``: ``{"weight_map": {tensor: shard}}``)
    names, beside it, and the tensors each holds; one line naming the index or the missing shard."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise InitFromError(f"{index}: not a readable index of shards ({describe(e) if isinstance(e, OSError) else e})"
                            ) from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(name, str) and isinstance(shard, str) for name, shard in weight_map.items()):
        raise InitFromError(f"{index}: its weight_map must map tensor names to shard files")
    files: dict[Path, list[str]] = {}
    for name, shard in weight_map.items():
        file = index.parent / shard
        if Path(shard).name != shard or not file.is_file():
            raise InitFromError(f"{index}: names shard {shard!r} (for {name}), which is not a file beside it")
        files.setdefault(file, []).append(name)
    return files


def read_state(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors or pytorch_model.bin file (the latter without running its pickle),
    or of the shards an index names (only the tensors it maps, each from its shard)."""
    if file.name.endswith(INDEX_SUFFIX):
        state: dict[str, torch.Tensor] = {}
        for shard, names in shards(file).items():
            part = read_state(shard)
            absent = [name for name in names if name not in part]
            if absent:
                raise InitFromError(f"{file}: maps {absent[0]} to {shard.name}, which does not hold it"
                                    + (f" (nor {len(absent) - 1} more)" if len(absent) > 1 else ""))
            state.update((name, part[name]) for name in names)
        return state
    if file.suffix == ".safetensors":
        return checkpoint.read_weights(file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError or OSError for unreadable files
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise InitFromError(f"{file}: not loadable as plain tensors (torch.load weights_only=True: {first})") from None
    if not isinstance(state, dict) or not all(torch.is_tensor(t) for t in state.values()):
        raise InitFromError(f"{file}: not a state dict (a mapping of names to tensors)")
    return state


def our_name(name: str, hf: HfFamily) -> str:
    """A source parameter name as our model of the family whose side of transformers ``hf`` is names it."""
    for legacy, current in hf.legacy_suffixes.items():
        if name.endswith(legacy):
            name = name[: -len(legacy)] + current
    return name if name.startswith(hf.top_prefixes) else f"{hf.base_prefix}{name}"


def match(state: dict[str, torch.Tensor], params: list[str], source: Path,
          hf: HfFamily) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(weights under our names, the parameters the source lacks, which start fresh); raises
    naming a source tensor left unmatched or an encoder weight missing."""
    renamed: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for name, tensor in state.items():
        ours = our_name(name, hf)
        if ours in hf.buffers:
            continue
        if ours in renamed:
            raise InitFromError(f"{source}: {origin[ours]} and {name} are both {ours}")
        renamed[ours], origin[ours] = tensor, name
    for alias, target in hf.tied_aliases.items():
        if alias not in renamed:
            continue
        tied = renamed.pop(alias)
        if target not in renamed:
            renamed[target] = tied
        elif not torch.equal(tied, renamed[target]):
            raise InitFromError(f"{source}: {origin[alias]} differs from {origin[target]}; this model ties them")
    wanted = set(params)
    unmatched = [origin[name] for name in renamed if name not in wanted]
    if unmatched:
        raise InitFromError(f"{source}: {len(unmatched)} tensor(s) match no parameter of {hf.transformers_class}: "
                            f"{', '.join(unmatched[:5])}")
    absent = [name for name in params if name not in renamed]
    missing = [name for name in absent if not name.startswith(hf.fresh_prefixes)]
    if missing:
        raise InitFromError(f"{source}: lacks {len(missing)} encoder weight(s): {', '.join(missing[:5])}")
    return renamed, absent


def fresh_summary(fresh: list[str]) -> str:
    """``a.weight, a.bias, b`` -> ``a, b``: one module name for a weight and bias that both start fresh."""
    names: list[str] = []
    for name in fresh:
        module, _, leaf = name.rpartition(".")
        pair = f"{module}.{'bias' if leaf == 'weight' else 'weight'}"
        shown = module if leaf in ("weight", "bias") and pair in fresh else name
        if shown not in names:
            names.append(shown)
    return ", ".join(names)


def init_weights(engine, path: Path) -> list[str]:
    """Give the engine's model (fp32 master copy included) the source's weights; the optimizer and
    schedule stay fresh. Returns the lines to log."""
    source = open_source(Path(path))
    run_family = family_of(engine.module.config)
    if source.model is not None and source.model["arch"] != run_family.arch:
        raise InitFromError(f"{source.origin}: a {source.model['arch']} model, but this run trains a {run_family.arch} "
                            "model")
    params = [name for name, _ in engine.module.named_parameters()]
    weights, fresh = match(read_state(source.weights), params, source.weights, run_family.hf)
    try:
        checkpoint.install_weights(engine, weights, source=source.weights, fresh=frozenset(fresh))
    except checkpoint.CheckpointError as e:
        if source.model is not None:
            raise
        raise InitFromError(f"{e} (a bare weights file states no architecture: give the --preset it was "
                            "trained with, or its folder with config.json)") from None
    notes = [f"initialized weights from {source.weights} (fresh optimizer and schedule)"]
    if fresh:
        notes.append(f"not in {source.weights}, starting fresh: {fresh_summary(fresh)}")
    return notes
