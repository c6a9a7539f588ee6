"""A ModernBERT-class model and Hugging Face both ways: the export is a folder that
``ModernBertForMaskedLM``, ``AutoModelForMaskedLM`` and the ``fill-mask`` pipeline load with no
missing or unexpected keys (the decoder tied, not stored twice; the layer pattern and both
rotary bases in its config), and a folder transformers made, in its 5.x or 4.x config form,
reads back as our config; what this model does not compute is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bert_ds.base.errors import ConfigError
from bert_ds.checkpoint.export import export_hf, from_hf_config
from bert_ds.checkpoint.hf_import import InitFromError, match, model_config, open_source
from bert_ds.model.modernbert.hf import HF as MODERNBERT
from bert_ds.model.families import model_config_from_dict, model_preset
from bert_ds.model.modernbert.model import ModernBertForPreTraining
from tests.conftest import make_bpe_tokenizer

pytestmark = pytest.mark.lowest  # transformers' ModernBERT, also under the lowest supported transformers

def _tokenizer(folder: Path) -> Path:
    """A tiny byte-level BPE tokenizer with ModernBERT's kind of special tokens, saved as transformers does."""
    text = ["the european lobster is a species of clawed lobster from the eastern atlantic ocean"] * 20
    return make_bpe_tokenizer(folder, text, 300, prefix_space=False)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, ModernBertForPreTraining]:
    root = tmp_path_factory.mktemp("modernbert-export")
    tokenizer = _tokenizer(root / "tokenizer")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    torch.manual_seed(0)
    model = ModernBertForPreTraining(model_preset("modernbert-tiny", vocab, local_attention=8, kernels="torch"))
    return export_hf(model.state_dict(), model.config, tokenizer, root / "hf"), model


def test_the_export_loads_in_transformers_with_no_missing_or_unexpected_keys(exported):
    from transformers import AutoModelForMaskedLM, ModernBertForMaskedLM

    folder, model = exported
    for cls in (ModernBertForMaskedLM, AutoModelForMaskedLM):
        loaded, info = cls.from_pretrained(folder, output_loading_info=True)
        assert type(loaded).__name__ == "ModernBertForMaskedLM"
        assert not any(info.values()), info
    stored = load_file(folder / "model.safetensors")
    assert "decoder.weight" not in stored and "model.embeddings.tok_embeddings.weight" in stored  # tied, once
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "modernbert"
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == model.config.global_rope_theta
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == model.config.local_rope_theta
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = (config["pad_token_id"], config["cls_token_id"], config["sep_token_id"])
    assert ids == (tokenizer.pad_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id) == (3, 1, 2)  # not 50283..


def test_the_export_takes_the_models_special_ids_and_refuses_another_tokenizers(exported, tmp_path):
    """A model records its data's special ids (cls, sep, mask beside the pad); the export's config
    carries them, and a tokenizer folder that disagrees with them is refused in one line."""
    from bert_ds.checkpoint.export import ExportError

    _, model = exported
    tokenizer = _tokenizer(tmp_path / "tokenizer")
    ids = dict(pad_token_id=3, cls_token_id=1, sep_token_id=2, mask_token_id=4)  # the tests' BPE order
    config = model_preset("modernbert-tiny", model.config.vocab_size, local_attention=8, kernels="torch", **ids)
    folder = export_hf(model.state_dict(), config, tokenizer, tmp_path / "hf")
    written = json.loads((folder / "config.json").read_text())
    assert [written[k] for k in ("pad_token_id", "cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id")] == [
        3, 1, 2, 1, 2]
    other = model_preset("modernbert-tiny", model.config.vocab_size, local_attention=8, kernels="torch",
                         **{**ids, "mask_token_id": 7})
    with pytest.raises(ExportError, match=r"trained with mask_token_id 7, but the tokenizer files in .* give 4"):
        export_hf(model.state_dict(), other, tokenizer, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_fill_mask_on_the_export_gives_the_word_the_model_learned(tmp_path):
    """A tiny model taught one word in one context (a few Adam steps on that masked position):
    transformers' fill-mask pipeline on its export answers that word first."""
    from transformers import AutoTokenizer, pipeline

    folder = _tokenizer(tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    context = "the european lobster is a species of clawed"
    ids = tokenizer(context + " lobster", return_tensors="pt")["input_ids"]  # (1, S): [CLS] ... [SEP]
    target = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" lobster"))
    assert len(target) == 1 and ids[0, -2] == target[0], "the word must be one token, the last"
    masked, labels = ids.clone(), torch.full_like(ids, -100)
    masked[0, -2], labels[0, -2] = tokenizer.mask_token_id, target[0]

    torch.manual_seed(0)
    model = ModernBertForPreTraining(model_preset("modernbert-tiny", len(tokenizer), local_attention=8,
                                                  pad_token_id=tokenizer.pad_token_id, kernels="torch"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(20):
        optimizer.zero_grad()
        loss = model(masked, torch.ones_like(masked), labels).mlm_loss
        loss.backward()
        optimizer.step()
    out = export_hf(model.state_dict(), model.config, folder, tmp_path / "hf")

    fill = pipeline("fill-mask", model=str(out), tokenizer=str(out))
    answers = fill(context + tokenizer.mask_token)
    assert answers[0]["token"] == target[0], (answers, loss.item())


def _transformers_folder(folder: Path, vocab: int, legacy: bool = False) -> Path:
    """A ModernBertForMaskedLM at random init saved by transformers (``legacy``: its config rewritten
    in transformers 4's form, as ModernBERT's published config.json is)."""
    from transformers import ModernBertConfig as HFConfig
    from transformers import ModernBertForMaskedLM

    config = HFConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=2, max_position_embeddings=256, local_attention=16, global_rope_theta=80000.0,
                      pad_token_id=3, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    ModernBertForMaskedLM(config).save_pretrained(folder)
    if legacy:
        values = json.loads((folder / "config.json").read_text())
        values.pop("layer_types")
        rope = values.pop("rope_parameters")
        values.update(global_attn_every_n_layers=3, global_rope_theta=rope["full_attention"]["rope_theta"],
                      local_rope_theta=rope["sliding_attention"]["rope_theta"])
        (folder / "config.json").write_text(json.dumps(values))
    return folder


@pytest.mark.parametrize("legacy", [False, True], ids=["transformers-5-config", "transformers-4-config"])
def test_a_transformers_folder_reads_back_as_our_config_and_weights(tmp_path, legacy):
    folder = _transformers_folder(tmp_path / "hf", 300, legacy)
    source = open_source(folder)
    config = model_config(source, None, {"vocab_size": 300, "kernels": "torch"})
    assert (config.arch, config.num_layers, config.hidden_size, config.local_attention) == ("modernbert", 4, 32, 16)
    assert (config.global_rope_theta, config.local_rope_theta, config.global_attn_every_n_layers) == (80000.0, 10000.0, 3)
    ours = ModernBertForPreTraining(config)
    params = [name for name, _ in ours.named_parameters()]
    weights, fresh = match(load_file(folder / "model.safetensors"), params, source.weights, MODERNBERT)
    assert fresh == [] and sorted(weights) == sorted(params)


def test_an_mmbert_sized_vocabulary_reads_back(tmp_path):
    folder = _transformers_folder(tmp_path / "hf", 256_000)
    config = model_config(open_source(folder), None, {"vocab_size": 256_000, "kernels": "torch"})
    assert config.vocab_size == 256_000


def test_the_other_family_is_refused_in_one_line(tmp_path):
    folder = _transformers_folder(tmp_path / "hf", 300)
    with pytest.raises(InitFromError, match=r"--preset tiny is a bert model, but .*config.json holds a modernbert model"):
        model_config(open_source(folder), "tiny", {"vocab_size": 300})


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias True; this ModernBERT needs False"),
    ({"norm_bias": True}, "norm_bias True; this ModernBERT needs False"),
    ({"layer_types": ["full_attention", "full_attention", "sliding_attention", "full_attention"]},
     "is not a global layer every n layers"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}}, "rope_type 'yarn'"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
])
def test_what_this_modernbert_does_not_compute_is_refused(tmp_path, change, message):
    values = {"model_type": "modernbert", "vocab_size": 300, "hidden_size": 32, **change}
    with pytest.raises(ConfigError, match=message):
        from_hf_config(values, tmp_path / "config.json")


def test_our_config_round_trips_through_transformers_config():
    ours = model_preset("modernbert-tiny", 300, local_attention=16, global_rope_theta=123456.0)
    from bert_ds.checkpoint.export import to_hf_config

    values = to_hf_config(ours).to_dict()
    back = model_config_from_dict({**from_hf_config(values, Path("config.json")), "kernels": ours.kernels})
    assert back == ours
