"""ModernBERT's side of Hugging Face transformers (:class:`~bert_ds.model.hf.HfFamily`):
``ModernBertForMaskedLM``, its config in transformers 4's and 5's forms, and its names."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bert_ds.base.errors import ConfigError
from bert_ds.model.hf import HF_HIDDEN_ACT, HfFamily, hidden_activation, probe_ids, relative_gap
from bert_ds.model.modernbert.config import ModernBertConfig

MODERNBERT_CONFIG_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "local_attention": "local_attention",
    "hidden_activation": "hidden_activation",
    "embedding_dropout": "embedding_dropout",
    "attention_dropout": "attention_dropout",
    "mlp_dropout": "mlp_dropout",
    "norm_eps": "norm_eps",
    "initializer_range": "initializer_range",
    "initializer_cutoff_factor": "initializer_cutoff_factor",
    "pad_token_id": "pad_token_id",
}
# What transformers 4 reads where 5 reads layer_types and rope_parameters (our fields of the same names).
TRANSFORMERS4_KEYS = ("global_attn_every_n_layers", "global_rope_theta", "local_rope_theta")
# transformers' options this model computes only at these values: a config.json with another is refused
_MODERNBERT_FIXED = {"attention_bias": False, "mlp_bias": False, "norm_bias": False, "decoder_bias": True,
                     "classifier_activation": "gelu", "tie_word_embeddings": True}


def _modernbert_hf_config(config: ModernBertConfig):
    """The ``transformers.ModernBertConfig``: the layer pattern as ``layer_types`` and the two
    rotary bases as ``rope_parameters`` (transformers 5's form) and as transformers 4's keys
    (:data:`TRANSFORMERS4_KEYS`), the head's activation ours."""
    from transformers import ModernBertConfig as HFConfig

    values = {hf: getattr(config, ours) for ours, hf in MODERNBERT_CONFIG_NAMES.items()}
    values["hidden_activation"] = values["classifier_activation"] = HF_HIDDEN_ACT[config.hidden_activation]
    layer_types = ["full_attention" if config.is_global(i) else "sliding_attention" for i in range(config.num_layers)]
    rope = {"full_attention": {"rope_type": "default", "rope_theta": config.global_rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": config.local_rope_theta}}
    # The special tokens' ids are the tokenizer's (the export sets them from it); transformers'
    # defaults are ModernBERT's own vocabulary's, past a smaller model's embedding rows.
    no_ids = dict.fromkeys(("cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id"))
    hf_config = HFConfig(architectures=["ModernBertForMaskedLM"], tie_word_embeddings=True, layer_types=layer_types,
                         rope_parameters=rope, **no_ids, **values)
    # The same in transformers 4's form, written beside 5's: 4.x reads neither layer_types nor
    # rope_parameters, and would take its own defaults (a global base of 160,000) silently.
    for name in TRANSFORMERS4_KEYS:
        setattr(hf_config, name, getattr(config, name))
    return hf_config


def _modernbert_from_hf(values: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """The :class:`ModernBertConfig` fields a ModernBERT ``config.json`` states, in transformers
    4's form (``global_attn_every_n_layers``, ``global_rope_theta``, ``local_rope_theta``) or 5's
    (``layer_types``, ``rope_parameters``), refusing biases, a rotary scaling or a layer pattern
    this model does not compute."""
    for name, value in _MODERNBERT_FIXED.items():
        if name in values and values[name] != value:
            raise ConfigError(f"{where}: {name} {values[name]!r}; this ModernBERT needs {value!r}")
    fields = {ours: values[hf] for ours, hf in MODERNBERT_CONFIG_NAMES.items() if values.get(hf) is not None}
    if "hidden_activation" in fields:
        fields["hidden_activation"] = hidden_activation(fields["hidden_activation"], "hidden_activation", where)
    every = _global_every(values, where)
    if every is not None:
        fields["global_attn_every_n_layers"] = every
    rope = values.get("rope_parameters") or {}
    for ours, layer_type, legacy in (("global_rope_theta", "full_attention", "global_rope_theta"),
                                     ("local_rope_theta", "sliding_attention", "local_rope_theta")):
        params = rope.get(layer_type) or {}
        if params.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope_parameters.{layer_type}.rope_type {params['rope_type']!r}; "
                              "only the default rotary embedding is supported")
        theta = params.get("rope_theta", values.get(legacy))
        if theta is not None:
            fields[ours] = float(theta)
    return {"arch": "modernbert", **fields}


def _global_every(values: Mapping[str, Any], where: Path) -> int | None:
    """``global_attn_every_n_layers`` as stated, or read off ``layer_types`` (which must then follow
    "global where i % n == 0")."""
    layer_types = values.get("layer_types")
    if not layer_types:
        return values.get("global_attn_every_n_layers")
    global_at = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    every = global_at[1] if len(global_at) > 1 else len(layer_types)
    expected = ["full_attention" if i % every == 0 else "sliding_attention" for i in range(len(layer_types))]
    if not global_at or global_at[0] != 0 or list(layer_types) != expected:
        raise ConfigError(f"{where}: layer_types {list(layer_types)} is not a global layer every n layers "
                          "from layer 0 (global_attn_every_n_layers), the pattern this ModernBERT runs")
    return every


def _modernbert_probe(ours, theirs, config: ModernBertConfig) -> float:
    """Both models on a fixed (2, S) batch, one row padded, longer than the local window where the
    model's length allows: the largest MLM logit difference (:func:`relative_gap`)."""
    import torch

    from bert_ds.model.padding import gather_tokens, unpad

    input_ids, attention_mask = probe_ids(config, length=min(config.local_attention + 16,
                                                              config.max_position_embeddings))
    unpadded = unpad(attention_mask)
    with torch.no_grad():
        our_out = ours(input_ids, unpadded=unpadded)
        their_out = theirs(input_ids=input_ids, attention_mask=attention_mask)
    their_mlm = gather_tokens(their_out.logits, unpadded.token_indices)  # (T, V), packed like ours
    return relative_gap(our_out.mlm_logits, their_mlm)


HF = HfFamily(
    model_type="modernbert", transformers_class="ModernBertForMaskedLM", base_prefix="model.",
    top_prefixes=("model.", "head.", "decoder."),
    tied_aliases={"decoder.weight": "model.embeddings.tok_embeddings.weight"},
    fresh_prefixes=("head.", "decoder."), buffers=frozenset(), legacy_suffixes={},
    config_names=MODERNBERT_CONFIG_NAMES, hf_config=_modernbert_hf_config, from_hf=_modernbert_from_hf,
    probe=_modernbert_probe, token_ids={"pad_token_id": "pad_token_id", "cls_token_id": "cls_token_id",
                                        "bos_token_id": "cls_token_id", "sep_token_id": "sep_token_id",
                                        "eos_token_id": "sep_token_id"})
