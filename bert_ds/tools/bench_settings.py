"""What one run of ``python -m bert_ds.tools.bench`` times: its variants and its settings.

A module of its own, light (no torch): the command (:mod:`.bench`) parses into
:class:`BenchSettings`, and the timed loops (:mod:`.bench_variants`) take them.

Each model family has its own variants, keyed by letter, in its record
(:attr:`bert_ds.model.family.Family.bench`): BERT's (a)-(d) against transformers'
``BertForPreTraining``, ModernBERT's (a), (b), (d) against transformers' ``ModernBertForMaskedLM``
with SDPA (c) and with FlashAttention-2 (f). A run benches the presets of one family, so that
its variants, defaults and goals are one set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bert_ds.base.errors import ConfigError
from bert_ds.model.family import Family
from bert_ds.model.families import PRESETS, family_of_preset, model_preset

BASELINE = "c"  # transformers with SDPA: every family's "vs (c)"
FLASH_BASELINE = "f"  # transformers with FlashAttention-2, where the family has it


@dataclass
class BenchSettings:
    device: str  # "cpu" or "cuda"
    precision: str  # "fp32", or "bf16" (autocast)
    presets: list[str]  # of one model family
    seq_lens: list[int]
    batch_size: int | None  # None: tokens_per_step // seq_len
    tokens_per_step: int
    steps: int  # timed steps per variant
    warmup: int  # untimed steps per variant before them
    variants: list[str]
    lr: float
    vocab_size: int  # synthetic batches only; real data brings its own
    data: str | None
    workers: int
    seed: int
    probes: bool

    def __post_init__(self) -> None:
        for name in ("steps", "tokens_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.warmup < 0 or self.workers < 0:
            raise ConfigError(f"--warmup and --workers must be >= 0, got {self.warmup} and {self.workers}")
        self._check_presets()
        longest = min(model_preset(p, self.vocab_size).max_position_embeddings for p in self.presets)
        for seq_len in self.seq_lens:
            if not 8 <= seq_len <= longest:
                raise ConfigError(f"--seq-len must be in [8, {longest}] (the presets' positions), got {seq_len}")
        known = self.family.bench.variants
        unknown = [v for v in self.variants if v not in known]
        if unknown or not self.variants:
            raise ConfigError(f"--variants takes a comma-separated subset of {','.join(known)} for a "
                              f"{self.family.arch} preset, got {','.join(self.variants)!r}")
        if self.data is not None and not Path(self.data).is_dir():
            raise ConfigError(f"--data {self.data}: no such dataset folder")

    def _check_presets(self) -> None:
        for preset in self.presets:
            if preset not in PRESETS:
                raise ConfigError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        families = {family_of_preset(p).arch for p in self.presets}
        if len(families) != 1:
            raise ConfigError(f"--preset {','.join(self.presets)}: one model family per run (their variants and "
                              f"sequence lengths differ); got {' and '.join(sorted(families))}")

    @property
    def family(self) -> Family:
        """The presets' model family."""
        return family_of_preset(self.presets[0])

    def batch_for(self, seq_len: int) -> int:
        return self.batch_size or max(1, self.tokens_per_step // seq_len)
