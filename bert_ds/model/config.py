"""What every model family's config shares (torch-free): the activations, the checks of the
common fields, and the reading of a dict. Each family's config class is in its own folder
(:mod:`bert_ds.model.bert.config`, :mod:`bert_ds.model.modernbert.config`); the table of
families, their presets and :func:`~bert_ds.model.families.model_config_from_dict` are in
:mod:`bert_ds.model.families`.

No torch here: the command lines take their flags' defaults from the configs, and ``python -m
bert_ds.train --help`` answers without importing torch.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, get_args

from bert_ds.base.errors import ConfigError, require
from bert_ds.kernels.dispatch import KernelSetting

HiddenAct = Literal["gelu", "gelu_tanh"]
_HIDDEN_ACTS = get_args(HiddenAct)
# How each activation is spelt for F.gelu and the fused kernels' ``approximate``.
GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}
_KERNEL_SETTINGS = get_args(KernelSetting)
PREFIX = "model config: "  # the start of every message of the configs' checks
# The tokenizer's special tokens every family's config records, named as a transformers tokenizer
# names them: a new run takes them from its data's manifest, the export checks its tokenizer
# files against them. Only the pad's row is special to the model (it starts at zero).
SPECIAL_TOKEN_IDS = ("pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id")


class FamilyConfig:
    """What every family's config dataclass shares beside its fields (a base without fields, so the
    dataclasses keep theirs in their own order)."""

    hidden_size: int
    num_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Any:
        return from_dict(cls, values)


def from_dict(cls: type, values: Mapping[str, Any]) -> Any:
    """A family's config from its fields, naming the unknown and the missing ones."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"model config ({values.get('arch', 'bert')}): unknown keys {', '.join(unknown)}")
    missing = sorted(name for name, f in fields.items()
                     if f.default is dataclasses.MISSING and name not in values)
    if missing:
        raise ConfigError(f"model config: missing keys {', '.join(missing)}")
    return cls(**values)


def check_fields(config: Any, *, counts: tuple[str, ...], positive: tuple[str, ...], rates: tuple[str, ...],
                  activation: str, flags: tuple[str, ...] = ()) -> None:
    """The checks every family's config makes of its fields: the sizes and ``counts`` positive
    integers, ``positive`` positive finite numbers, ``rates`` in [0, 1), the switches and ``flags``
    booleans, the ``activation`` field, kernels and pad id among their choices; and the heads
    divide the hidden size."""
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                 "max_position_embeddings", *counts):
        value = getattr(config, name)
        require(is_int(value) and value > 0, f"{PREFIX}{name}", f"must be a positive integer, got {value!r}")
    require(config.hidden_size % config.num_heads == 0, f"{PREFIX}num_heads",
            f"must divide hidden_size ({config.hidden_size}), got {config.num_heads}")
    for name in positive:
        value = getattr(config, name)
        require(is_number(value) and 0.0 < value < math.inf, f"{PREFIX}{name}",
                f"must be a positive finite number, got {value!r}")
    for name in rates:
        value = getattr(config, name)
        require(is_number(value) and 0.0 <= value < 1.0, f"{PREFIX}{name}", f"must be in [0, 1), got {value!r}")
    for name in ("activation_checkpointing", "compile_layers", *flags):
        value = getattr(config, name)
        require(isinstance(value, bool), f"{PREFIX}{name}", f"must be true or false, got {value!r}")
    value = getattr(config, activation)
    require(value in _HIDDEN_ACTS, f"{PREFIX}{activation}", f"must be one of {', '.join(_HIDDEN_ACTS)}, got {value!r}")
    require(config.kernels in _KERNEL_SETTINGS, f"{PREFIX}kernels",
            f"must be one of {', '.join(_KERNEL_SETTINGS)}, got {config.kernels!r}")
    for name in SPECIAL_TOKEN_IDS:  # the pad's is required; the others are None in a run saved before they were kept
        value = getattr(config, name)
        require((value is None and name != "pad_token_id") or (is_int(value) and 0 <= value < config.vocab_size),
                f"{PREFIX}{name}", f"must be a token id in [0, vocab_size={config.vocab_size}), got {value!r}")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
