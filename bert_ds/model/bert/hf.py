"""BERT's side of Hugging Face transformers (:class:`~bert_ds.model.hf.HfFamily`):
``BertForPreTraining``, its config and its names."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bert_ds.base.errors import ConfigError
from bert_ds.model.bert.config import ModelConfig
from bert_ds.model.hf import HF_HIDDEN_ACT, HfFamily, hidden_activation, probe_ids, relative_gap

BERT_CONFIG_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "hidden_act": "hidden_act",
    "hidden_dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "max_position_embeddings": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "initializer_range": "initializer_range",
    "layer_norm_eps": "layer_norm_eps",
    "pad_token_id": "pad_token_id",
}


def _bert_hf_config(config: ModelConfig):
    """The ``transformers.BertConfig`` of a post-LN model (pre-LN raises :class:`ConfigError`)."""
    from transformers import BertConfig

    if config.pre_layernorm:
        raise ConfigError("a pre-LN model (pre_layernorm=true) has no Hugging Face BertForPreTraining "
                          "equivalent and cannot be exported")
    values = {hf: getattr(config, ours) for ours, hf in BERT_CONFIG_NAMES.items()}
    values["hidden_act"] = HF_HIDDEN_ACT[config.hidden_act]
    return BertConfig(architectures=["BertForPreTraining"], tie_word_embeddings=True, **values)


def _bert_from_hf(values: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """The :class:`ModelConfig` fields a BERT ``config.json`` states (absent ones are left out:
    BertConfig's defaults equal ModelConfig's), refusing what this BERT cannot compute the
    same way (relative positions, a decoder)."""
    if values.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"{where}: position_embedding_type {values['position_embedding_type']!r}; "
                          "only absolute position embeddings are supported")
    if values.get("is_decoder") or values.get("add_cross_attention"):
        raise ConfigError(f"{where}: a BERT decoder (is_decoder / add_cross_attention); only the encoder is supported")
    fields = {ours: values[hf] for ours, hf in BERT_CONFIG_NAMES.items() if values.get(hf) is not None}
    if "hidden_act" in fields:
        fields["hidden_act"] = hidden_activation(fields["hidden_act"], "hidden_act", where)
    return {"arch": "bert", **fields}


def _bert_probe(ours, theirs, config: ModelConfig) -> float:
    """Both models on a fixed (2, S) batch (one full row, one padded, both segments): the largest
    MLM or NSP logit difference (:func:`relative_gap`)."""
    import torch

    from bert_ds.model.padding import gather_tokens, unpad

    input_ids, attention_mask = probe_ids(config)
    seq_len = input_ids.shape[1]
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, seq_len // 2:] = config.type_vocab_size - 1
    unpadded = unpad(attention_mask)
    with torch.no_grad():
        our_out = ours(input_ids, token_type_ids, unpadded=unpadded)
        their_out = theirs(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
    their_mlm = gather_tokens(their_out.prediction_logits, unpadded.token_indices)  # (T, V), packed like ours
    return max(relative_gap(our_out.mlm_logits, their_mlm),
               relative_gap(our_out.nsp_logits, their_out.seq_relationship_logits))


HF = HfFamily(
    model_type="bert", transformers_class="BertForPreTraining", base_prefix="bert.",
    top_prefixes=("bert.", "cls."),
    tied_aliases={"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                  "cls.predictions.decoder.bias": "cls.predictions.bias"},
    fresh_prefixes=("cls.", "bert.pooler."),
    buffers=frozenset({"bert.embeddings.position_ids", "bert.embeddings.token_type_ids"}),
    legacy_suffixes={"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"},
    config_names=BERT_CONFIG_NAMES, hf_config=_bert_hf_config, from_hf=_bert_from_hf, probe=_bert_probe,
    pair_head=True, token_ids={"pad_token_id": "pad_token_id"})
