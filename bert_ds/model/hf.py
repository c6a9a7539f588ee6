"""What every model family's side of Hugging Face transformers shares: the record
(:class:`HfFamily`) each family's ``hf.py`` fills in, and the helpers they use.

The export (:mod:`bert_ds.checkpoint.export`) and ``--init-from``
(:mod:`bert_ds.checkpoint.hf_import`) are written once for every family; what differs is a
family's :class:`HfFamily` (:mod:`bert_ds.model.bert.hf`, :mod:`bert_ds.model.modernbert.hf`):

- the transformers class an export is (and loads back as), its ``model_type``;
- the config both ways: :attr:`HfFamily.hf_config` writes transformers' from ours,
  :attr:`HfFamily.from_hf` reads ours from a ``config.json`` (refusing, in one line naming it,
  an option this family's model does not compute the same way);
- the names: the encoder's prefix (a base model saves without it), the tied aliases, the heads a
  source may lack, the buffers older transformers saved and the legacy names it renames;
- a probe: the largest logit difference between our model and transformers' on a fixed batch,
  relative to the logits' scale.

torch and transformers are imported inside the functions: the export answers ``--help``
without them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_ds.base.errors import ConfigError

HF_HIDDEN_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
# HF's older name of the same tanh approximation, read but never written.
_HF_HIDDEN_ACT_READ = {**{hf: ours for ours, hf in HF_HIDDEN_ACT.items()}, "gelu_new": "gelu_tanh"}


@dataclass(frozen=True)
class HfFamily:
    """One model family's side of transformers (module docstring)."""

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
    pair_head: bool = False  # the class has a sentence-pair head (NSP): its loss takes segments and pair labels
    token_ids: Mapping[str, str] = dataclasses.field(default_factory=dict)  # a config attribute -> the tokenizer's attribute whose id it takes


def relative_gap(ours, theirs) -> float:
    """The largest difference of two logit tensors, over their scale (the largest magnitude of
    ``theirs``, at least 1): fp32's rounding grows with the values, and a trained model's logits are
    larger than a fresh one's. NaN where either holds one."""
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1.0)).item()


def hidden_activation(value: Any, name: str, where: Path) -> str:
    """Our name of a transformers activation ``value`` (config key ``name``), or a ConfigError."""
    if value not in _HF_HIDDEN_ACT_READ:
        raise ConfigError(f"{where}: {name} {value!r}; supported: {', '.join(_HF_HIDDEN_ACT_READ)}")
    return _HF_HIDDEN_ACT_READ[value]


def probe_ids(config: Any, length: int = 16):
    """A fixed (2, S) batch of token ids and its attention mask: one full row, one padded after
    half its length plus one."""
    import torch

    seq_len = min(length, config.max_position_embeddings)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=generator)
    attention_mask = torch.ones(2, seq_len, dtype=torch.long)
    attention_mask[1, seq_len // 2 + 1:] = 0
    return input_ids, attention_mask
