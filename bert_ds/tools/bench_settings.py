"""What one run of ``python -m bert_ds.tools.bench`` times: its variants and its settings.

A module of its own, light (no torch): the command (:mod:`.bench`) parses into
:class:`BenchSettings`, and the timed loops (:mod:`.bench_variants`) take them.

Each model family has its own variants, keyed by letter: BERT's (a)-(d) against transformers'
``BertForPreTraining``, ModernBERT's (a), (b) against transformers' ``ModernBertForMaskedLM``
with SDPA (c) and with FlashAttention-2 (f). A run benches the presets of one family, so that
its variants, defaults and goals are one set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bert_ds.base.errors import ConfigError
from bert_ds.model.config import PRESETS, model_preset, preset_arch


@dataclass(frozen=True)
class Variant:
    key: str
    family: Literal["bert_ds", "transformers"]
    kernels: str  # bert_ds's kernels setting; "fused": every op fused on CUDA (see build_variant)
    optimizer: Literal["lamb", "stable_adamw", "adamw"]
    description: str
    compile_layers: bool = False  # bert_ds's encoder layers under torch.compile (ModelConfig.compile_layers)
    attention: str = "sdpa"  # transformers' attn_implementation (the transformers variants only)


VARIANTS = {v.key: v for v in (
    Variant("a", "bert_ds", "fused", "lamb", "bert_ds: fused kernels, unpadded, sparse MLM decoder, LAMB"),
    Variant("b", "bert_ds", "torch", "lamb", "bert_ds: PyTorch-native ops, unpadded, sparse MLM decoder, LAMB"),
    Variant("c", "transformers", "", "adamw", "transformers BertForPreTraining: SDPA, padded, fused AdamW"),
    Variant("d", "bert_ds", "auto", "lamb", "bert_ds: layers under torch.compile (Inductor's fusion), attention "
            "as kernels=auto picks, LAMB", compile_layers=True),
)}
# ModernBERT's: bert_ds with the optimizer of its recipe (StableAdamW), transformers with torch's
# fused AdamW as a user would run it; (f) needs the flash-attn package and a CUDA device.
MODERNBERT_VARIANTS = {v.key: v for v in (
    Variant("a", "bert_ds", "auto", "stable_adamw", "bert_ds: kernels=auto, unpadded, windows computed alone, "
            "sparse MLM decoder, StableAdamW"),
    Variant("b", "bert_ds", "torch", "stable_adamw", "bert_ds: PyTorch-native ops, unpadded, sparse MLM decoder, "
            "StableAdamW"),
    Variant("c", "transformers", "", "adamw", "transformers ModernBertForMaskedLM: SDPA, padded, fused AdamW"),
    Variant("f", "transformers", "", "adamw", "transformers ModernBertForMaskedLM: flash_attention_2, padded, "
            "fused AdamW", attention="flash_attention_2"),
    Variant("d", "bert_ds", "auto", "stable_adamw", "bert_ds: layers under torch.compile (Inductor's fusion), "
            "attention as kernels=auto picks, StableAdamW", compile_layers=True),
)}
VARIANTS_OF = {"bert": VARIANTS, "modernbert": MODERNBERT_VARIANTS}  # by the presets' model family
DEFAULT_VARIANTS = {"bert": "a,b,c", "modernbert": "a,b,c,f"}  # BERT's (d) compiles the model first: by name
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
        known = VARIANTS_OF[self.arch]
        unknown = [v for v in self.variants if v not in known]
        if unknown or not self.variants:
            raise ConfigError(f"--variants takes a comma-separated subset of {','.join(known)} for a {self.arch} "
                              f"preset, got {','.join(self.variants)!r}")
        if self.data is not None and not Path(self.data).is_dir():
            raise ConfigError(f"--data {self.data}: no such dataset folder")

    def _check_presets(self) -> None:
        for preset in self.presets:
            if preset not in PRESETS:
                raise ConfigError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        families = {preset_arch(p) for p in self.presets}
        if len(families) != 1:
            raise ConfigError(f"--preset {','.join(self.presets)}: one model family per run (their variants and "
                              f"sequence lengths differ); got {' and '.join(sorted(families))}")

    @property
    def arch(self) -> str:
        """The presets' model family ("bert" or "modernbert")."""
        return preset_arch(self.presets[0])

    def batch_for(self, seq_len: int) -> int:
        return self.batch_size or max(1, self.tokens_per_step // seq_len)
