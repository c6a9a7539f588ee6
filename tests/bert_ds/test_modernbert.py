"""The ModernBERT-class model against transformers' ``ModernBertForMaskedLM`` (fp32, CPU): the
same parameter names and shapes, and with the same weights the same logits, loss and gradients,
on a ragged batch whose sequences are longer than the local window (so the local layers see
less than the global ones) and padded in transformers' batch; and its config's checks."""

from __future__ import annotations

import pytest
import torch

from bert_ds.base.errors import ConfigError
from bert_ds.model.modernbert.config import ModernBertConfig
from bert_ds.model.families import model_config_from_dict, model_preset
from bert_ds.model.modernbert.model import ModernBertForPreTraining

pytestmark = pytest.mark.lowest  # transformers' ModernBERT, also under the lowest supported transformers

VOCAB = 300
LENGTHS = (30, 17, 25, 5)  # ragged; three longer than the window's 2 x 4 + 1 tokens
WINDOW = 8  # local_attention: +-4 tokens


def _configs(attn_implementation: str):
    from transformers import ModernBertConfig as HFConfig

    ours = model_preset("modernbert-tiny", VOCAB, local_attention=WINDOW)
    theirs = HFConfig(vocab_size=VOCAB, hidden_size=ours.hidden_size, intermediate_size=ours.intermediate_size,
                      num_hidden_layers=ours.num_layers, num_attention_heads=ours.num_heads,
                      max_position_embeddings=ours.max_position_embeddings, local_attention=ours.local_attention,
                      global_rope_theta=ours.global_rope_theta, local_rope_theta=ours.local_rope_theta,
                      norm_eps=ours.norm_eps, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                      sep_token_id=2, attn_implementation=attn_implementation)
    return ours, theirs


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    ids = torch.randint(3, VOCAB, mask.shape, generator=g) * mask  # padding id 0
    labels = torch.full_like(ids, -100)
    chosen = (torch.rand(ids.shape, generator=g) < 0.3) & mask.bool()
    labels[chosen] = ids[chosen]
    return ids, mask, labels


def _pair(attn_implementation: str):
    from transformers import ModernBertForMaskedLM

    ours_cfg, theirs_cfg = _configs(attn_implementation)
    torch.manual_seed(0)
    theirs = ModernBertForMaskedLM(theirs_cfg).eval()
    ours = ModernBertForPreTraining(ours_cfg).eval()
    ours.load_state_dict({name: t for name, t in theirs.state_dict().items() if name in ours.state_dict()})
    return ours, theirs


def test_the_parameters_are_transformers_names_and_shapes():
    from transformers import ModernBertForMaskedLM

    ours_cfg, theirs_cfg = _configs("eager")
    ours, theirs = ModernBertForPreTraining(ours_cfg), ModernBertForMaskedLM(theirs_cfg)
    assert {n: t.shape for n, t in ours.state_dict().items()} == {n: t.shape for n, t in theirs.state_dict().items()}
    # the decoder is tied to the token embeddings, as theirs is
    assert ours.decoder.weight is ours.model.embeddings.tok_embeddings.weight


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_logits_loss_and_gradients_equal_transformers(attn_implementation):
    ours, theirs = _pair(attn_implementation)
    ids, mask, labels = _batch()
    mine = ours(ids, attention_mask=mask, masked_lm_labels=labels)
    ref = theirs(input_ids=ids, attention_mask=mask, labels=labels)
    expected = ref.logits[labels != -100]  # the masked rows, in row-major order
    torch.testing.assert_close(mine.mlm_logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert int(mine.mlm_count) == int((labels != -100).sum())
    assert int(mine.mlm_correct) == int((expected.argmax(-1) == labels[labels != -100]).sum())
    mine.loss.backward()
    ref.loss.backward()
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_local_layers_see_less_than_the_global_ones():
    """With every layer global the logits move: the batch's windows are real, and they are
    transformers' (the parity test above holds them to it)."""
    ours, _ = _pair("eager")
    ids, mask, labels = _batch()
    windowed = ours(ids, attention_mask=mask, masked_lm_labels=labels).mlm_logits
    for layer in ours.model.layers:
        layer.attn.window = None
    global_ = ours(ids, attention_mask=mask, masked_lm_labels=labels).mlm_logits
    assert (windowed - global_).abs().max() > 1e-3


def test_each_sequence_is_attended_alone_whatever_its_neighbours():
    """A sequence's logits do not change when the other sequences of its batch do: positions
    restart, and no attention (global or local) reaches across."""
    ours, _ = _pair("eager")
    ids, mask, labels = _batch()
    labels[1:] = -100  # predict the first sequence only
    alone = ours(ids[:1], attention_mask=mask[:1], masked_lm_labels=labels[:1]).mlm_logits
    other_ids, _, _ = _batch(seed=1)
    mixed = torch.cat([ids[:1], other_ids[1:] * mask[1:]])
    beside = ours(mixed, attention_mask=mask, masked_lm_labels=labels).mlm_logits
    torch.testing.assert_close(alone, beside, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(local_attention=7), "local_attention: must be even"),
    (dict(local_attention=2048), "local_attention: must be at most max_position_embeddings"),
    (dict(global_rope_theta=0.0), "global_rope_theta: must be a positive finite number"),
    (dict(local_rope_theta=-1.0), "local_rope_theta: must be a positive finite number"),
    (dict(num_heads=3), "num_heads: must divide hidden_size"),
    (dict(hidden_size=60, num_heads=4), "num_heads: must leave an even head dimension"),
])
def test_a_bad_modernbert_config_is_one_line_naming_the_setting(change, message):
    with pytest.raises(ConfigError, match=message):
        model_preset("modernbert-tiny", VOCAB, **change)


def test_configs_are_read_back_by_their_arch():
    ours = model_preset("modernbert-tiny", VOCAB)
    assert isinstance(model_config_from_dict(ours.to_dict()), ModernBertConfig)
    assert model_config_from_dict({k: v for k, v in model_preset("tiny", VOCAB).to_dict().items()
                                   if k != "arch"}).arch == "bert"  # a config written before arch existed
    with pytest.raises(ConfigError, match="unknown arch 'gpt'"):
        model_config_from_dict({**ours.to_dict(), "arch": "gpt"})


@pytest.mark.parametrize("name", ["modernbert-tiny", "modernbert-base", "modernbert-large"])
def test_presets_build_with_transformers_parameter_count(name):
    from transformers import ModernBertConfig as HFConfig
    from transformers import ModernBertForMaskedLM

    from bert_ds.model.build import meta_model

    ours = meta_model(model_preset(name, 50368, kernels="torch"))
    with torch.device("meta"):  # base and large without allocating their weights
        theirs = ModernBertForMaskedLM(HFConfig(
            vocab_size=50368, hidden_size=ours.config.hidden_size, intermediate_size=ours.config.intermediate_size,
            num_hidden_layers=ours.config.num_layers, num_attention_heads=ours.config.num_heads,
            pad_token_id=50283, bos_token_id=50281, eos_token_id=50282, cls_token_id=50281, sep_token_id=50282))
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
