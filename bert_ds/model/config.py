"""The models' configurations: :class:`ModelConfig` (BERT) and :class:`ModernBertConfig`
(ModernBERT-class encoders), each validated once; the named presets of both; and
:func:`model_config_from_dict`, which reads either by its ``arch``.

Kept apart from the model (:mod:`bert_ds.model.bert`) because it needs no torch: the command
lines take their flags' defaults from it, and ``python -m bert_ds.train --help`` answers
without importing torch. :mod:`bert_ds.model.bert` imports it, so ``from bert_ds.model.bert
import ModelConfig`` names the same class.
"""

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from bert_ds.base.errors import ConfigError, require
from bert_ds.kernels.dispatch import KernelSetting

HiddenAct = Literal["gelu", "gelu_tanh"]
_HIDDEN_ACTS = get_args(HiddenAct)
_KERNEL_SETTINGS = get_args(KernelSetting)
_PREFIX = "model config: "  # the start of every message of ModelConfig's checks


@dataclass
class ModelConfig:
    """BERT (:mod:`bert_ds.model.bert`)."""

    vocab_size: int  # rows of the word embedding and of the tied MLM decoder
    hidden_size: int  # width of the residual stream
    num_layers: int  # transformer blocks
    num_heads: int  # attention heads; hidden_size / num_heads is the head dim
    intermediate_size: int  # FFN width, 4x hidden_size in the published sizes
    max_position_embeddings: int = 512  # rows of the learned position table = longest sequence
    type_vocab_size: int = 2  # segment ids: sentence A / sentence B for NSP
    hidden_act: HiddenAct = "gelu"  # "gelu": erf form (original BERT); "gelu_tanh": tanh form, HF "gelu_pytorch_tanh"
    hidden_dropout: float = 0.1  # after the embeddings and on each sublayer's output, as in BERT
    attention_dropout: float = 0.0  # modern recipe; dropout on attention probabilities slows fused attention
    layer_norm_eps: float = 1e-12  # BERT's value, kept so that exported models behave the same in HF
    initializer_range: float = 0.02  # std of the normal init of weights and embeddings (HF init)
    pre_layernorm: bool = False  # False: post-LN, the original BERT; True: pre-LN (stabler, not HF-exportable)
    kernels: KernelSetting = "auto"  # "cuda": fused kernels or an error; "auto": per op the fastest correct (logged)
    activation_checkpointing: bool = False  # recompute layers in backward: less activation memory, ~1/3 more compute
    compile_layers: bool = False  # torch.compile each encoder layer: Inductor fuses its elementwise ops (bert.py)
    pad_token_id: int = 0  # the tokenizer's [PAD] (a new run takes the data's); its row starts at zero (HF padding_idx)
    arch: Literal["bert"] = "bert"  # the model family (model_config_from_dict reads it)

    def __post_init__(self) -> None:
        require(self.arch == "bert", f"{_PREFIX}arch", f"must be 'bert' for ModelConfig, got {self.arch!r}")
        _check_fields(self, counts=("type_vocab_size",), positive=("layer_norm_eps", "initializer_range"),
                      rates=("hidden_dropout", "attention_dropout"), flags=("pre_layernorm",),
                      activation="hidden_act")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        return _from_dict(cls, values)


@dataclass
class ModernBertConfig:
    """A ModernBERT-class encoder (:mod:`bert_ds.model.modernbert`), as transformers'
    ``ModernBertConfig`` defines it: pre-LN layers without biases, rotary positions, every
    ``global_attn_every_n_layers``-th layer global and the others local (a sliding window of
    ``local_attention`` tokens, +-half of it), a GeGLU MLP, LayerNorms without bias."""

    vocab_size: int  # rows of the token embedding and of the tied MLM decoder
    hidden_size: int  # width of the residual stream
    num_layers: int  # transformer blocks
    num_heads: int  # attention heads; hidden_size / num_heads is the head dim
    intermediate_size: int  # GeGLU width: Wi makes 2x this (input and gate), Wo reads this
    max_position_embeddings: int = 8192  # longest sequence (rotary positions: no table)
    global_attn_every_n_layers: int = 3  # layer i attends globally where i % this == 0
    local_attention: int = 128  # the local layers' window in tokens: each sees +-local_attention/2
    global_rope_theta: float = 160000.0  # rotary base of the global layers
    local_rope_theta: float = 10000.0  # and of the local ones
    hidden_activation: HiddenAct = "gelu"  # of the GeGLU and the MLM head: erf GELU, as ModernBERT's
    embedding_dropout: float = 0.0  # after the embeddings' LayerNorm
    attention_dropout: float = 0.0  # on the attention output (after Wo); none inside the attention
    mlp_dropout: float = 0.0  # on the GeGLU's product, before Wo
    norm_eps: float = 1e-5  # every LayerNorm's
    initializer_range: float = 0.02  # std of the truncated-normal init of the input projections and embeddings
    initializer_cutoff_factor: float = 2.0  # the init's normals are cut at this many std
    kernels: KernelSetting = "auto"  # "cuda": fused kernels or an error; "auto": per op the fastest correct (logged)
    activation_checkpointing: bool = False  # recompute layers in backward: less activation memory, ~1/3 more compute
    compile_layers: bool = False  # torch.compile each encoder layer
    pad_token_id: int = 0  # the tokenizer's padding token (a new run takes the data's); its row starts at zero
    arch: Literal["modernbert"] = "modernbert"  # the model family (model_config_from_dict reads it)

    def __post_init__(self) -> None:
        require(self.arch == "modernbert", f"{_PREFIX}arch", f"must be 'modernbert' for ModernBertConfig, got {self.arch!r}")
        _check_fields(self, counts=("global_attn_every_n_layers", "local_attention"),
                      positive=("global_rope_theta", "local_rope_theta", "norm_eps", "initializer_range",
                                "initializer_cutoff_factor"),
                      rates=("embedding_dropout", "attention_dropout", "mlp_dropout"), activation="hidden_activation")
        require(self.head_dim % 2 == 0, f"{_PREFIX}num_heads",
                f"must leave an even head dimension for the rotary pairs, got {self.head_dim}")
        require(self.local_attention % 2 == 0, f"{_PREFIX}local_attention",
                f"must be even (the window is +-local_attention/2 tokens), got {self.local_attention}")
        require(self.local_attention <= self.max_position_embeddings, f"{_PREFIX}local_attention",
                f"must be at most max_position_embeddings ({self.max_position_embeddings}), got {self.local_attention}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def local_window(self) -> int:
        """The tokens on each side a local layer attends to: half of ``local_attention``."""
        return self.local_attention // 2

    def is_global(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) attends globally; the others attend locally."""
        return layer % self.global_attn_every_n_layers == 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModernBertConfig":
        return _from_dict(cls, values)


AnyModelConfig = ModelConfig | ModernBertConfig
ARCHES: dict[str, type] = {"bert": ModelConfig, "modernbert": ModernBertConfig}


def model_config_from_dict(values: Mapping[str, Any]) -> AnyModelConfig:
    """The config of the family ``values["arch"]`` names (``bert`` where it names none, as
    every config before ModernBERT was written)."""
    arch = values.get("arch", "bert")
    if arch not in ARCHES:
        raise ConfigError(f"model config: unknown arch {arch!r} (known: {', '.join(ARCHES)})")
    return ARCHES[arch].from_dict(values)


def _from_dict(cls: type, values: Mapping[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"model config ({values.get('arch', 'bert')}): unknown keys {', '.join(unknown)}")
    missing = sorted(name for name, f in fields.items()
                     if f.default is dataclasses.MISSING and name not in values)
    if missing:
        raise ConfigError(f"model config: missing keys {', '.join(missing)}")
    return cls(**values)


def _check_fields(config: Any, *, counts: tuple[str, ...], positive: tuple[str, ...], rates: tuple[str, ...],
                  activation: str, flags: tuple[str, ...] = ()) -> None:
    """The checks either family's config makes of its fields: the sizes and ``counts`` positive
    integers, ``positive`` positive finite numbers, ``rates`` in [0, 1), the switches and ``flags``
    booleans, the ``activation`` field, kernels and pad id among their choices; and the heads
    divide the hidden size."""
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                 "max_position_embeddings", *counts):
        value = getattr(config, name)
        require(_is_int(value) and value > 0, f"{_PREFIX}{name}", f"must be a positive integer, got {value!r}")
    require(config.hidden_size % config.num_heads == 0, f"{_PREFIX}num_heads",
            f"must divide hidden_size ({config.hidden_size}), got {config.num_heads}")
    for name in positive:
        value = getattr(config, name)
        require(_is_number(value) and 0.0 < value < math.inf, f"{_PREFIX}{name}",
                f"must be a positive finite number, got {value!r}")
    for name in rates:
        value = getattr(config, name)
        require(_is_number(value) and 0.0 <= value < 1.0, f"{_PREFIX}{name}", f"must be in [0, 1), got {value!r}")
    for name in ("activation_checkpointing", "compile_layers", *flags):
        value = getattr(config, name)
        require(isinstance(value, bool), f"{_PREFIX}{name}", f"must be true or false, got {value!r}")
    value = getattr(config, activation)
    require(value in _HIDDEN_ACTS, f"{_PREFIX}{activation}", f"must be one of {', '.join(_HIDDEN_ACTS)}, got {value!r}")
    require(config.kernels in _KERNEL_SETTINGS, f"{_PREFIX}kernels",
            f"must be one of {', '.join(_KERNEL_SETTINGS)}, got {config.kernels!r}")
    require(_is_int(config.pad_token_id) and 0 <= config.pad_token_id < config.vocab_size, f"{_PREFIX}pad_token_id",
            f"must be a token id in [0, vocab_size={config.vocab_size}), got {config.pad_token_id!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=256),  # tests, smoke runs
    # The main job: the shape of Google's BERT-Tiny (Turc et al. 2019), whose "mini" is the one below.
    "tiny-h128": dict(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512),
    "mini": dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024),  # quick experiments
    "base": dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072),  # BERT-Base
    "large": dict(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096),  # BERT-Large
    # ModernBERT-class: tests and CPU runs (layers 0 and 3 global, 1 and 2 local), then the published sizes
    "modernbert-tiny": dict(arch="modernbert", num_layers=4, hidden_size=64, num_heads=2, intermediate_size=96,
                            local_attention=32, max_position_embeddings=1024),
    "modernbert-base": dict(arch="modernbert", num_layers=22, hidden_size=768, num_heads=12, intermediate_size=1152),
    "modernbert-large": dict(arch="modernbert", num_layers=28, hidden_size=1024, num_heads=16, intermediate_size=2624),
}


# The data settings each family trains with unless a flag or a plan says otherwise (DataConfig fields):
# BERT's sentence pairs with NSP and 15% masking; ModernBERT's whole documents packed to a token
# budget, no pair task, 30% masking (its recipe).
DATA_DEFAULTS: dict[str, dict[str, Any]] = {
    "bert": dict(pair_task="nsp", layout="sentences", token_budget=False, mask_rate=0.15),
    "modernbert": dict(pair_task="none", layout="documents", token_budget=True, mask_rate=0.30),
}


# The fields --dropout sets, per family: the dropout on the residual stream (BERT's 0.1 by default;
# ModernBERT's recipe trains without, its embedding and MLP dropouts 0).
DROPOUT_FIELDS: dict[str, tuple[str, ...]] = {"bert": ("hidden_dropout",),
                                              "modernbert": ("embedding_dropout", "mlp_dropout")}


def check_preset(name: str) -> None:
    """A ConfigError unless ``name`` is one of :data:`PRESETS`."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")


def preset_arch(name: str) -> str:
    """The model family of preset ``name``."""
    check_preset(name)
    return PRESETS[name].get("arch", "bert")


def model_preset(name: str, vocab_size: int, **overrides: Any) -> AnyModelConfig:
    """The named preset's sizes with ``vocab_size`` and any other field overridden."""
    check_preset(name)
    return model_config_from_dict({**PRESETS[name], "vocab_size": vocab_size, **overrides})
