"""How each model family meets Hugging Face transformers: its config, its class and its names.

The export (:mod:`.export`) and ``--init-from`` (:mod:`.hf_import`) are written once for every
family; what differs between BERT and a ModernBERT-class encoder is here, one
:class:`HfFamily` each:

- the transformers class an export is (and loads back as), its ``model_type``;
- the config both ways: :attr:`HfFamily.hf_config` writes transformers' from ours,
  :attr:`HfFamily.from_hf` reads ours from a ``config.json`` (refusing, in one line naming it,
  an option this family's model does not compute the same way);
- the names: the encoder's prefix (a base model saves without it), the tied aliases, the heads a
  source may lack, the buffers older transformers saved and the legacy names it renames;
- a probe: the largest logit difference between our model and transformers' on a fixed batch,
  relative to the logits' scale.

torch and transformers are imported inside the functions: :mod:`.export` answers ``--help``
without them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_ds.base.errors import ConfigError
from bert_ds.model.config import AnyModelConfig, ModelConfig, ModernBertConfig

_HF_HIDDEN_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
# HF's older name of the same tanh approximation, read but never written.
_HF_HIDDEN_ACT_READ = {**{hf: ours for ours, hf in _HF_HIDDEN_ACT.items()}, "gelu_new": "gelu_tanh"}


@dataclass(frozen=True)
class HfFamily:
    """One model family's side of transformers (module docstring)."""

    arch: str
    model_type: str  # transformers' model_type in config.json
    transformers_class: str  # the export's class: transformers.<this>.from_pretrained loads it
    base_prefix: str  # the encoder's module name: a base model (BertModel, ModernBertModel) saves without it
    top_prefixes: tuple[str, ...]  # every parameter name begins with one of these (a base model's with none)
    tied_aliases: Mapping[str, str]  # alias in a state dict -> the parameter it is tied to
    fresh_prefixes: tuple[str, ...]  # heads a source may lack: they start fresh
    buffers: frozenset[str]  # tensors some transformers versions saved that carry no weights
    legacy_suffixes: Mapping[str, str]  # old parameter names transformers still renames on load
    config_names: Mapping[str, str]  # our field -> transformers' attribute, where they map one to one
    hf_config: Callable[[Any], Any]  # our config -> transformers' PretrainedConfig
    from_hf: Callable[[Mapping[str, Any], Path], dict[str, Any]]  # config.json -> our fields it states
    probe: Callable[[Any, Any, Any], float]  # (ours, theirs, our config) -> the logits' relative_gap
    token_ids: Mapping[str, str] = dataclasses.field(default_factory=dict)  # a config attribute -> the tokenizer's attribute whose id it takes


# --------------------------------------------------------------------------- BERT

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
    values["hidden_act"] = _HF_HIDDEN_ACT[config.hidden_act]
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
        fields["hidden_act"] = _hidden_activation(fields["hidden_act"], "hidden_act", where)
    return {"arch": "bert", **fields}


def relative_gap(ours, theirs) -> float:
    """The largest difference of two logit tensors, over their scale (the largest magnitude of
    ``theirs``, at least 1): fp32's rounding grows with the values, and a trained model's logits are
    larger than a fresh one's. NaN where either holds one."""
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1.0)).item()


def _bert_probe(ours, theirs, config: ModelConfig) -> float:
    """Both models on a fixed (2, S) batch (one full row, one padded, both segments): the largest
    MLM or NSP logit difference (:func:`relative_gap`)."""
    import torch

    from bert_ds.model.padding import gather_tokens, unpad

    input_ids, attention_mask = _probe_ids(config)
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


BERT = HfFamily(
    arch="bert", model_type="bert", transformers_class="BertForPreTraining", base_prefix="bert.",
    top_prefixes=("bert.", "cls."),
    tied_aliases={"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                  "cls.predictions.decoder.bias": "cls.predictions.bias"},
    fresh_prefixes=("cls.", "bert.pooler."),
    buffers=frozenset({"bert.embeddings.position_ids", "bert.embeddings.token_type_ids"}),
    legacy_suffixes={"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"},
    config_names=BERT_CONFIG_NAMES, hf_config=_bert_hf_config, from_hf=_bert_from_hf, probe=_bert_probe,
    token_ids={"pad_token_id": "pad_token_id"})


# --------------------------------------------------------------------------- ModernBERT

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
# transformers' options this model computes only at these values: a config.json with another is refused
_MODERNBERT_FIXED = {"attention_bias": False, "mlp_bias": False, "norm_bias": False, "decoder_bias": True,
                     "classifier_activation": "gelu", "tie_word_embeddings": True}


def _modernbert_hf_config(config: ModernBertConfig):
    """The ``transformers.ModernBertConfig``: the layer pattern as ``layer_types`` and the two
    rotary bases as ``rope_parameters`` (transformers 5's form), the head's activation ours."""
    from transformers import ModernBertConfig as HFConfig

    values = {hf: getattr(config, ours) for ours, hf in MODERNBERT_CONFIG_NAMES.items()}
    values["hidden_activation"] = values["classifier_activation"] = _HF_HIDDEN_ACT[config.hidden_activation]
    layer_types = ["full_attention" if config.is_global(i) else "sliding_attention" for i in range(config.num_layers)]
    rope = {"full_attention": {"rope_type": "default", "rope_theta": config.global_rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": config.local_rope_theta}}
    # The special tokens' ids are the tokenizer's (the export sets them from it); transformers'
    # defaults are ModernBERT's own vocabulary's, past a smaller model's embedding rows.
    no_ids = dict.fromkeys(("cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id"))
    return HFConfig(architectures=["ModernBertForMaskedLM"], tie_word_embeddings=True, layer_types=layer_types,
                    rope_parameters=rope, **no_ids, **values)


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
        fields["hidden_activation"] = _hidden_activation(fields["hidden_activation"], "hidden_activation", where)
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

    input_ids, attention_mask = _probe_ids(config, length=min(config.local_attention + 16,
                                                              config.max_position_embeddings))
    unpadded = unpad(attention_mask)
    with torch.no_grad():
        our_out = ours(input_ids, unpadded=unpadded)
        their_out = theirs(input_ids=input_ids, attention_mask=attention_mask)
    their_mlm = gather_tokens(their_out.logits, unpadded.token_indices)  # (T, V), packed like ours
    return relative_gap(our_out.mlm_logits, their_mlm)


MODERNBERT = HfFamily(
    arch="modernbert", model_type="modernbert", transformers_class="ModernBertForMaskedLM", base_prefix="model.",
    top_prefixes=("model.", "head.", "decoder."),
    tied_aliases={"decoder.weight": "model.embeddings.tok_embeddings.weight"},
    fresh_prefixes=("head.", "decoder."), buffers=frozenset(), legacy_suffixes={},
    config_names=MODERNBERT_CONFIG_NAMES, hf_config=_modernbert_hf_config, from_hf=_modernbert_from_hf,
    probe=_modernbert_probe, token_ids={"pad_token_id": "pad_token_id", "cls_token_id": "cls_token_id",
                                        "bos_token_id": "cls_token_id", "sep_token_id": "sep_token_id",
                                        "eos_token_id": "sep_token_id"})


# --------------------------------------------------------------------------- lookup

FAMILIES = {family.arch: family for family in (BERT, MODERNBERT)}
_BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES.values()}


def family_of(config: AnyModelConfig) -> HfFamily:
    """The family of one of our model configs."""
    return FAMILIES[config.arch]


def family_of_hf(values: Mapping[str, Any], where: Path) -> HfFamily:
    """The family of a Hugging Face ``config.json`` (its ``model_type``; BERT where it names none),
    or a :class:`ConfigError` naming what it is."""
    model_type = values.get("model_type", "bert")
    if model_type not in _BY_MODEL_TYPE:
        raise ConfigError(f"{where}: model_type {model_type!r}; --init-from takes a "
                          f"{' or '.join(sorted(_BY_MODEL_TYPE))} model")
    return _BY_MODEL_TYPE[model_type]


def _hidden_activation(value: Any, name: str, where: Path) -> str:
    if value not in _HF_HIDDEN_ACT_READ:
        raise ConfigError(f"{where}: {name} {value!r}; supported: {', '.join(_HF_HIDDEN_ACT_READ)}")
    return _HF_HIDDEN_ACT_READ[value]


def _probe_ids(config: AnyModelConfig, length: int = 16):
    """A fixed (2, S) batch of token ids and its attention mask: one full row, one padded after
    half its length plus one."""
    import torch

    seq_len = min(length, config.max_position_embeddings)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=generator)
    attention_mask = torch.ones(2, seq_len, dtype=torch.long)
    attention_mask[1, seq_len // 2 + 1:] = 0
    return input_ids, attention_mask
