"""The model's configuration: :class:`ModelConfig`, validated once, and the named presets.

Kept apart from the model (:mod:`bert_ds.model.bert`) because it needs no torch: the command
lines take their flags' defaults from it, and ``python -m bert_ds.train --help`` answers
without importing torch. :mod:`bert_ds.model.bert` imports it, so ``from bert_ds.model.bert
import ModelConfig`` names the same class.
"""

import dataclasses
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
    pad_token_id: int = 0  # id of [PAD]; its embedding row gets no gradient (HF padding_idx)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            require(_is_int(value) and value > 0, f"{_PREFIX}{name}", f"must be a positive integer, got {value!r}")
        require(self.hidden_size % self.num_heads == 0, f"{_PREFIX}num_heads",
                f"must divide hidden_size ({self.hidden_size}), got {self.num_heads}")
        require(self.hidden_act in _HIDDEN_ACTS, f"{_PREFIX}hidden_act",
                f"must be one of {', '.join(_HIDDEN_ACTS)}, got {self.hidden_act!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            require(_is_number(value) and 0.0 <= value < 1.0, f"{_PREFIX}{name}", f"must be in [0, 1), got {value!r}")
        for name in ("layer_norm_eps", "initializer_range"):
            value = getattr(self, name)
            require(_is_number(value) and value > 0.0, f"{_PREFIX}{name}", f"must be a positive number, got {value!r}")
        for name in ("pre_layernorm", "activation_checkpointing", "compile_layers"):
            value = getattr(self, name)
            require(isinstance(value, bool), f"{_PREFIX}{name}", f"must be true or false, got {value!r}")
        require(self.kernels in _KERNEL_SETTINGS, f"{_PREFIX}kernels",
                f"must be one of {', '.join(_KERNEL_SETTINGS)}, got {self.kernels!r}")
        require(_is_int(self.pad_token_id) and 0 <= self.pad_token_id < self.vocab_size, f"{_PREFIX}pad_token_id",
                f"must be a token id in [0, vocab_size={self.vocab_size}), got {self.pad_token_id!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ConfigError(f"model config: unknown keys {', '.join(unknown)}")
        missing = sorted(name for name, f in fields.items()
                         if f.default is dataclasses.MISSING and name not in values)
        if missing:
            raise ConfigError(f"model config: missing keys {', '.join(missing)}")
        return cls(**values)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=256),  # tests, smoke runs
    # The main job: the shape of Google's BERT-Tiny (Turc et al. 2019), whose "mini" is the one below.
    "tiny-h128": dict(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512),
    "mini": dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024),  # quick experiments
    "base": dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072),  # BERT-Base
    "large": dict(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096),  # BERT-Large
}


def check_preset(name: str) -> None:
    """A ConfigError unless ``name`` is one of :data:`PRESETS`."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")


def model_preset(name: str, vocab_size: int, **overrides: Any) -> ModelConfig:
    """The named preset's sizes with ``vocab_size`` and any other field overridden."""
    check_preset(name)
    return ModelConfig.from_dict({**PRESETS[name], "vocab_size": vocab_size, **overrides})
