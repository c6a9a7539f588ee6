"""BERT's config (torch-free): :class:`ModelConfig`, its presets, and what its FLOPs are made of."""

from dataclasses import dataclass
from typing import Any, Literal

from bert_ds.base.errors import require
from bert_ds.kernels.dispatch import KernelSetting
from bert_ds.model.config import PREFIX, FamilyConfig, HiddenAct, check_fields


@dataclass
class ModelConfig(FamilyConfig):
    """BERT (:mod:`bert_ds.model.bert.model`): post-LN (or pre-LN) layers of learned positions and segments."""

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
    cls_token_id: int | None = None  # the tokenizer's [CLS] (a new run takes the data's; None: saved before it was kept)
    sep_token_id: int | None = None  # the tokenizer's [SEP], as cls; the export checks its tokenizer files against them
    mask_token_id: int | None = None  # the tokenizer's [MASK], as cls
    arch: Literal["bert"] = "bert"  # the model family (model_config_from_dict reads it)

    def __post_init__(self) -> None:
        require(self.arch == "bert", f"{PREFIX}arch", f"must be 'bert' for ModelConfig, got {self.arch!r}")
        check_fields(self, counts=("type_vocab_size",), positive=("layer_norm_eps", "initializer_range"),
                      rates=("hidden_dropout", "attention_dropout"), flags=("pre_layernorm",),
                      activation="hidden_act")


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=256),  # tests, smoke runs
    # The main job: the shape of Google's BERT-Tiny (Turc et al. 2019), whose "mini" is the one below.
    "tiny-h128": dict(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512),
    "mini": dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024),  # quick experiments
    "base": dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072),  # BERT-Base
    "large": dict(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096),  # BERT-Large
}


def ffn_flops(config: ModelConfig) -> int:
    """Forward FLOPs per token of one layer's FFN: two GEMMs through the intermediate width."""
    return 4 * config.hidden_size * config.intermediate_size


def global_layers(config: ModelConfig) -> int:
    """Every BERT layer attends to the whole sequence."""
    return config.num_layers
