"""ModernBERT-class encoders (ModernBERT, mmBERT, Ettin): pre-LN layers without biases, rotary
positions, global and sliding-window attention, GeGLU, pretrained with MLM on whole documents
(:mod:`.model`); the config and presets (:mod:`.config`); their side of transformers,
``ModernBertForMaskedLM`` (:mod:`.hf`). :data:`FAMILY` is all that code outside this folder sees
of them."""

from bert_ds.model.family import BenchDefaults, BenchVariant, Family, SpeedupGoal
from bert_ds.model.modernbert import config, hf


def _model_class() -> type:
    from bert_ds.model.modernbert.model import ModernBertForPreTraining

    return ModernBertForPreTraining


def _local_window(c: config.ModernBertConfig) -> int:
    return c.local_window


# bert_ds with the optimizer of its recipe (StableAdamW), transformers with torch's fused AdamW as a
# user would run it; (f) needs the flash-attn package and a CUDA device.
_VARIANTS = (
    BenchVariant("a", "bert_ds", "auto", "stable_adamw", "bert_ds: kernels=auto, unpadded, windows computed alone, "
                 "sparse MLM decoder, StableAdamW"),
    BenchVariant("b", "bert_ds", "torch", "stable_adamw", "bert_ds: PyTorch-native ops, unpadded, sparse MLM "
                 "decoder, StableAdamW"),
    BenchVariant("c", "transformers", "", "adamw", "transformers ModernBertForMaskedLM: SDPA, padded, fused AdamW"),
    BenchVariant("f", "transformers", "", "adamw", "transformers ModernBertForMaskedLM: flash_attention_2, padded, "
                 "fused AdamW", attention="flash_attention_2"),
    BenchVariant("d", "bert_ds", "auto", "stable_adamw", "bert_ds: layers under torch.compile (Inductor's fusion), "
                 "attention as kernels=auto picks, StableAdamW", compile_layers=True),
)

FAMILY = Family(
    arch="modernbert", name="ModernBERT", config_class=config.ModernBertConfig, presets=config.PRESETS,
    # whole documents packed to a token budget, no pair task, 30% masking: its recipe
    data_defaults=dict(pair_task="none", layout="documents", token_budget=True, mask_rate=0.30),
    dropout_fields=("embedding_dropout", "mlp_dropout"),  # its recipe trains without
    # a context extension raises the global layers' rotary base in a new phase (its own folder), not by resuming
    phase_fields=("global_rope_theta", "local_rope_theta"),
    resume_refused=("global_attn_every_n_layers", "local_attention", "global_rope_theta", "local_rope_theta",
                    "hidden_activation", "norm_eps"),
    model_class=_model_class, hf=hf.HF, ffn_flops=config.ffn_flops, global_layers=config.global_layers,
    local_window=_local_window, check_data=config.check_data,
    published_vocab_size=50368,  # ModernBERT's 50,283 ids padded to a multiple of 64
    vocab_flag="--tokenizer",
    # its recipe's two lengths; the race's 32,768 tokens on CUDA
    bench=BenchDefaults(seq_lens={"cuda": "1024,8192", "cpu": "128"}, tokens_per_step={"cuda": 32768, "cpu": 4096},
                        variants={v.key: v for v in _VARIANTS}, default_variants="a,b,c,f",
                        # ModernBERT-base against transformers with FlashAttention-2 at seq 1,024
                        goals=(SpeedupGoal("modernbert-base", 1024, "f", 1.5),)),
)
