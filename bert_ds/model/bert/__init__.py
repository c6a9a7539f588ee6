"""BERT: post-LN (or pre-LN) layers of learned positions and segments, pretrained with MLM and
next-sentence prediction (:mod:`.model`); its config and presets (:mod:`.config`); its side of
transformers, ``BertForPreTraining`` (:mod:`.hf`). :data:`FAMILY` is all that code outside this
folder sees of it."""

from bert_ds.model.bert import config, hf
from bert_ds.model.family import BenchDefaults, BenchVariant, Family, SpeedupGoal, no_data_check, no_local_layers


def _model_class() -> type:
    from bert_ds.model.bert.model import BertForPreTraining

    return BertForPreTraining


_VARIANTS = (
    BenchVariant("a", "bert_ds", "fused", "lamb", "bert_ds: fused kernels, unpadded, sparse MLM decoder, LAMB"),
    BenchVariant("b", "bert_ds", "torch", "lamb", "bert_ds: PyTorch-native ops, unpadded, sparse MLM decoder, LAMB"),
    BenchVariant("c", "transformers", "", "adamw", "transformers BertForPreTraining: SDPA, padded, fused AdamW"),
    BenchVariant("d", "bert_ds", "auto", "lamb", "bert_ds: layers under torch.compile (Inductor's fusion), attention "
                 "as kernels=auto picks, LAMB", compile_layers=True),
)

FAMILY = Family(
    arch="bert", name="BERT", config_class=config.ModelConfig, presets=config.PRESETS,
    # sentence pairs with NSP, 15% masking: BERT's recipe
    data_defaults=dict(pair_task="nsp", layout="sentences", token_budget=False, mask_rate=0.15),
    dropout_fields=("hidden_dropout",),  # on the residual stream (0.1 by default)
    phase_fields=(),
    resume_refused=("type_vocab_size", "hidden_act", "layer_norm_eps", "pre_layernorm"),
    model_class=_model_class, hf=hf.HF, ffn_flops=config.ffn_flops, global_layers=config.global_layers,
    local_window=no_local_layers, check_data=no_data_check,
    published_vocab_size=30522,  # bert-base-uncased's
    vocab_flag="--vocab",
    # (d) compiles the model first: by name only
    bench=BenchDefaults(seq_lens={"cuda": "128,512", "cpu": "128"}, tokens_per_step={"cuda": 16384, "cpu": 4096},
                        variants={v.key: v for v in _VARIANTS}, default_variants="a,b,c",
                        # BERT-Base against transformers with SDPA, at phase 1's and phase 2's lengths
                        goals=(SpeedupGoal("base", 128, "c", 2.5), SpeedupGoal("base", 512, "c", 3.0))),
)
