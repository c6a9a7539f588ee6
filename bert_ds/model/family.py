"""What a model family is: one :class:`Family` record, which its folder exports
(:mod:`bert_ds.model.bert`, :mod:`bert_ds.model.modernbert`) and :mod:`bert_ds.model.families`
lists.

Everything outside a family's folder that must know something of a family asks its record:
the configuration (:mod:`bert_ds.config`), the command lines, the phase plans, the resume's
rules, the FLOPs accounting, the export and ``--init-from``, the benches. None of them names a
family or one of its fields; adding a family is a folder and a line in the table.

torch-free: the record's model class is reached through :attr:`Family.model_class`, which
imports the module when called, so that ``--help`` and the configs answer without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from bert_ds.model.hf import HfFamily


@dataclass(frozen=True)
class BenchVariant:
    """One configuration of ``python -m bert_ds.tools.bench`` (:mod:`bert_ds.tools.bench_settings`)."""

    key: str
    runner: Literal["bert_ds", "transformers"]  # whose model runs
    kernels: str  # bert_ds's kernels setting; "fused": every op fused on CUDA (tools.bench_variants.build_variant)
    optimizer: Literal["lamb", "stable_adamw", "adamw"]
    description: str
    compile_layers: bool = False  # bert_ds's encoder layers under torch.compile (the config's compile_layers)
    attention: str = "sdpa"  # transformers' attn_implementation (the transformers variants only)


@dataclass(frozen=True)
class SpeedupGoal:
    """A GPU goal of the training bench: variant (a)'s real tokens/s at least ``speedup`` times the
    ``baseline`` variant's, for ``preset`` at sequence length ``seq_len``."""

    preset: str
    seq_len: int
    baseline: str  # a variant key of the family's (a transformers one)
    speedup: float


@dataclass(frozen=True)
class BenchDefaults:
    """What a bench of this family's presets takes where its flags are not given."""

    seq_lens: Mapping[str, str]  # by device ("cuda", "cpu")
    tokens_per_step: Mapping[str, int]  # by device
    variants: Mapping[str, BenchVariant]  # by key: what --variants offers
    default_variants: str  # what runs without --variants
    goals: tuple[SpeedupGoal, ...] = ()  # its GPU goals (bert_ds.tools.bench.goals)


@dataclass(frozen=True)
class Family:
    """One model family: every fact about it that code outside its folder needs."""

    arch: str  # the configs' ``arch`` field, the key of the table
    name: str  # in messages and reports
    config_class: type  # the validated, torch-free dataclass (from_dict, to_dict)
    presets: Mapping[str, Mapping[str, Any]]  # preset name -> the config's fields (without arch)
    data_defaults: Mapping[str, Any]  # the DataConfig fields it trains with unless a flag or a plan says otherwise
    dropout_fields: tuple[str, ...]  # the config fields --dropout sets
    phase_fields: tuple[str, ...]  # its fields a later phase of a plan may change (besides the shared ones)
    resume_refused: tuple[str, ...]  # its fields a resume may not change; its other fields are recorded
    model_class: Callable[[], type]  # the pretraining module (importing it imports torch)
    hf: HfFamily  # its side of Hugging Face transformers: export, --init-from
    ffn_flops: Callable[[Any], int]  # forward FLOPs per token of one layer's feed-forward block
    global_layers: Callable[[Any], int]  # layers that attend to the whole sequence
    local_window: Callable[[Any], int]  # tokens each side a local layer attends to (0: no local layers)
    check_data: Callable[[Any, Any], None]  # (config, DataConfig): a ConfigError for data it cannot train on
    published_vocab_size: int  # the published models' vocabulary: the benches' and parameter counts' default
    vocab_flag: str  # the data_tools build flag that gives shards a model's vocabulary
    bench: BenchDefaults

    def preset(self, name: str, **fields: Any) -> Any:
        """The config of this family's preset ``name`` with ``fields`` (``vocab_size`` at least) set."""
        return self.config_class.from_dict({**self.presets[name], **fields})

    def build(self, config: Any, train_seq_len: int | None = None) -> Any:
        """The pretraining module of ``config`` (this family's), initialised."""
        return self.model_class()(config, train_seq_len=train_seq_len)


def no_data_check(config: Any, data: Any) -> None:
    """For a family that trains on every data setting the data config accepts."""


def no_local_layers(config: Any) -> int:
    """For a family whose every layer attends globally."""
    return 0
