"""ModernBERT's config (torch-free): :class:`ModernBertConfig`, its presets, and what its FLOPs
are made of."""

from dataclasses import dataclass
from typing import Any, Literal

from bert_ds.base.errors import require
from bert_ds.kernels.dispatch import KernelSetting
from bert_ds.model.config import PREFIX, FamilyConfig, HiddenAct, check_fields


@dataclass
class ModernBertConfig(FamilyConfig):
    """A ModernBERT-class encoder (:mod:`bert_ds.model.modernbert.model`), as transformers'
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
    cls_token_id: int | None = None  # the tokenizer's [CLS] (a new run takes the data's; None: saved before it was kept)
    sep_token_id: int | None = None  # the tokenizer's [SEP], as cls; the export checks its tokenizer files against them
    mask_token_id: int | None = None  # the tokenizer's [MASK], as cls
    arch: Literal["modernbert"] = "modernbert"  # the model family (model_config_from_dict reads it)

    def __post_init__(self) -> None:
        require(self.arch == "modernbert", f"{PREFIX}arch", f"must be 'modernbert' for ModernBertConfig, got {self.arch!r}")
        check_fields(self, counts=("global_attn_every_n_layers", "local_attention"),
                      positive=("global_rope_theta", "local_rope_theta", "norm_eps", "initializer_range",
                                "initializer_cutoff_factor"),
                      rates=("embedding_dropout", "attention_dropout", "mlp_dropout"), activation="hidden_activation")
        require(self.head_dim % 2 == 0, f"{PREFIX}num_heads",
                f"must leave an even head dimension for the rotary pairs, got {self.head_dim}")
        require(self.local_attention % 2 == 0, f"{PREFIX}local_attention",
                f"must be even (the window is +-local_attention/2 tokens), got {self.local_attention}")
        require(self.local_attention <= self.max_position_embeddings, f"{PREFIX}local_attention",
                f"must be at most max_position_embeddings ({self.max_position_embeddings}), got {self.local_attention}")

    @property
    def local_window(self) -> int:
        """The tokens on each side a local layer attends to: half of ``local_attention``."""
        return self.local_attention // 2

    def is_global(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) attends globally; the others attend locally."""
        return layer % self.global_attn_every_n_layers == 0


PRESETS: dict[str, dict[str, Any]] = {
    # tests and CPU runs (layers 0 and 3 global, 1 and 2 local), then the published sizes
    "modernbert-tiny": dict(num_layers=4, hidden_size=64, num_heads=2, intermediate_size=96, local_attention=32,
                            max_position_embeddings=1024),
    "modernbert-base": dict(num_layers=22, hidden_size=768, num_heads=12, intermediate_size=1152),
    "modernbert-large": dict(num_layers=28, hidden_size=1024, num_heads=16, intermediate_size=2624),
}


def ffn_flops(config: ModernBertConfig) -> int:
    """Forward FLOPs per token of one layer's GeGLU: ``Wi`` makes 2x the intermediate width (input
    and gate), ``Wo`` reads it back."""
    return 6 * config.hidden_size * config.intermediate_size


def global_layers(config: ModernBertConfig) -> int:
    """The layers that attend to the whole sequence; the others attend within their window."""
    return sum(config.is_global(i) for i in range(config.num_layers))


def check_data(config: ModernBertConfig, data: Any) -> None:
    """The data settings this family cannot train on (``data``: a :class:`bert_ds.config.DataConfig`)."""
    require(data.pair_task == "none", "pair_task",
            f"a ModernBERT-class model has no sentence-pair head; --pair-task must be none, got {data.pair_task!r}")
    require(config.local_attention <= data.max_seq_length, "model.local_attention",
            f"the local window ({config.local_attention} tokens) is longer than the sequences "
            f"({data.max_seq_length}): every layer would attend globally")
