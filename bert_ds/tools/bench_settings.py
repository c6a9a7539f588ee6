"""What one run of ``python -m bert_ds.tools.bench`` times: its variants and its settings.

A module of its own, light (no torch): the command (:mod:`.bench`) parses into
:class:`BenchSettings`, and the timed loops (:mod:`.bench_variants`) take them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bert_ds.base.errors import ConfigError
from bert_ds.model.config import PRESETS


@dataclass(frozen=True)
class Variant:
    key: str
    family: Literal["bert_ds", "transformers"]
    kernels: str  # bert_ds's kernels setting; "fused": every op fused on CUDA (see build_variant)
    optimizer: Literal["lamb", "adamw"]
    description: str
    compile_layers: bool = False  # bert_ds's encoder layers under torch.compile (ModelConfig.compile_layers)


VARIANTS = {v.key: v for v in (
    Variant("a", "bert_ds", "fused", "lamb", "bert_ds: fused kernels, unpadded, sparse MLM decoder, LAMB"),
    Variant("b", "bert_ds", "torch", "lamb", "bert_ds: PyTorch-native ops, unpadded, sparse MLM decoder, LAMB"),
    Variant("c", "transformers", "", "adamw", "transformers BertForPreTraining: SDPA, padded, fused AdamW"),
    Variant("d", "bert_ds", "auto", "lamb", "bert_ds: layers under torch.compile (Inductor's fusion), attention "
            "as kernels=auto picks, LAMB", compile_layers=True),
)}
BASELINE = "c"
DEFAULT_VARIANTS = "a,b,c"  # (d) compiles the model first: asked for by name


@dataclass
class BenchSettings:
    device: str  # "cpu" or "cuda"
    precision: str  # "fp32", or "bf16" (autocast)
    presets: list[str]
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
        for seq_len in self.seq_lens:
            if not 8 <= seq_len <= 512:
                raise ConfigError(f"--seq-len must be in [8, 512], got {seq_len}")
        for preset in self.presets:
            if preset not in PRESETS:
                raise ConfigError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ConfigError(f"--variants takes a comma-separated subset of {','.join(VARIANTS)}, got "
                              f"{','.join(self.variants)!r}")
        if self.data is not None and not Path(self.data).is_dir():
            raise ConfigError(f"--data {self.data}: no such dataset folder")

    def batch_for(self, seq_len: int) -> int:
        return self.batch_size or max(1, self.tokens_per_step // seq_len)
