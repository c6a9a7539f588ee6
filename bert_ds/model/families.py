"""The one table of model families, and the lookups every other module asks it through.

A family is a folder under :mod:`bert_ds.model` exporting one :class:`~bert_ds.model.family.Family`
record (its config, presets, data defaults, Hugging Face names, FLOPs, refusals, bench variants);
this table lists them. The data, the engine, the loss, the kernels' dispatch, the checkpoints and
the evaluation know nothing of which family runs. torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bert_ds.base.errors import ConfigError
from bert_ds.model import bert, modernbert
from bert_ds.model.bert.config import ModelConfig
from bert_ds.model.family import Family
from bert_ds.model.modernbert.config import ModernBertConfig

FAMILIES: dict[str, Family] = {family.arch: family for family in (bert.FAMILY, modernbert.FAMILY)}
AnyModelConfig = ModelConfig | ModernBertConfig  # for type hints: a config of any family
DEFAULT_ARCH = bert.FAMILY.arch  # what a config written before there were families is

# Every preset of every family, by name, with its family's arch among its fields.
PRESETS: dict[str, dict[str, Any]] = {name: {"arch": family.arch, **fields}
                                      for family in FAMILIES.values() for name, fields in family.presets.items()}
_BY_MODEL_TYPE = {family.hf.model_type: family for family in FAMILIES.values()}


def family(arch: str) -> Family:
    """The family of ``arch``, or a ConfigError naming the known ones."""
    if arch not in FAMILIES:
        raise ConfigError(f"model config: unknown arch {arch!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[arch]


def family_of(config: Any) -> Family:
    """The family of one of our model configs."""
    return FAMILIES[config.arch]


def check_preset(name: str) -> None:
    """A ConfigError unless ``name`` is one of :data:`PRESETS`."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")


def family_of_preset(name: str) -> Family:
    """The family of preset ``name``."""
    check_preset(name)
    return FAMILIES[PRESETS[name]["arch"]]


def model_config_from_dict(values: Mapping[str, Any]) -> AnyModelConfig:
    """The config of the family ``values["arch"]`` names (:data:`DEFAULT_ARCH` where it names none,
    as every config before ModernBERT was written)."""
    return family(values.get("arch", DEFAULT_ARCH)).config_class.from_dict(values)


def model_preset(name: str, vocab_size: int, **overrides: Any) -> AnyModelConfig:
    """The named preset's sizes with ``vocab_size`` and any other field overridden."""
    check_preset(name)
    return model_config_from_dict({**PRESETS[name], "vocab_size": vocab_size, **overrides})


def family_of_hf(values: Mapping[str, Any], where: Path) -> Family:
    """The family of a Hugging Face ``config.json`` (its ``model_type``; BERT where it names none),
    or a :class:`ConfigError` naming what it is."""
    model_type = values.get("model_type", FAMILIES[DEFAULT_ARCH].hf.model_type)
    if model_type not in _BY_MODEL_TYPE:
        raise ConfigError(f"{where}: model_type {model_type!r}; --init-from takes a "
                          f"{' or '.join(sorted(_BY_MODEL_TYPE))} model")
    return _BY_MODEL_TYPE[model_type]
