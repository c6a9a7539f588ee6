"""Continued pretraining: a Hugging Face BERT folder (made here with transformers: no hub is
reachable) -> shards built with its tokenizer -> ``bert_ds.train --init-from`` -> export ->
``from_pretrained`` and the fill-mask pipeline."""

import dataclasses
import json

import pytest
import torch
import transformers

from bert_ds.checkpoint import hf_import
from bert_ds.model.bert.hf import HF as BERT
from bert_ds.train import cli as train
from bert_ds.config import BatchPlan
from bert_ds.loader.pretraining import PretrainingLoader, open_pretraining_data
from bert_ds.base.errors import ConfigError, UserError
from bert_ds.checkpoint.export import export_checkpoint
from bert_ds.model.bert.model import BertForPreTraining
from bert_ds.model.bert.config import ModelConfig
from bert_ds.data_tools.manifest import Manifest
from bert_ds.data_tools.tokenizer import Normalization, install_tokenizer, train_vocab, vocab_entries
from tests.conftest import SAMPLE, run_cli

# A shape no preset has: the architecture can only come from config.json.
SHAPE = dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=64)
LOSS_TOLERANCE = 1e-5  # fp32 on both sides; only the order of the reductions differs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 3,000 lines of the bundled corpus: enough text for a few steps, quick to build."""
    lines = (SAMPLE / "valid.txt").read_text(encoding="utf-8").splitlines(keepends=True)[:3000]
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def vocab(corpus) -> bytes:
    return train_vocab(lambda: corpus.read_text(encoding="utf-8").splitlines(), 512, lowercase=True)


def _hf_folder(path, vocab: bytes, model_class=transformers.BertForPreTraining, seed: int = 0):
    """A folder as ``save_pretrained`` writes it: config.json, model.safetensors, the tokenizer."""
    path.mkdir(parents=True)
    install_tokenizer(path, vocab, Normalization(lowercase=True))
    torch.manual_seed(seed)
    model = model_class(transformers.BertConfig(vocab_size=len(vocab_entries(vocab)), **SHAPE))
    if isinstance(model, transformers.BertForPreTraining):
        # Token preferences a fresh model lacks: its loss is then far from any fresh model's.
        torch.nn.init.normal_(model.cls.predictions.bias, std=3.0)
    model.save_pretrained(path)
    return model


def _build(corpus, hf, out):
    run_cli("bert_ds.data_tools", "build", "--input", str(corpus), "--output", str(out), "--vocab", str(hf),
            "--split-sentences", "--workers", "1")
    return out


def _train_args(data, hf, out, steps: int) -> list[str]:
    # fp32 (ZeRO-0) so that the first step's loss can be compared with transformers' to 1e-4.
    return ["--data", str(data), "--output", str(out), "--init-from", str(hf), "--steps", str(steps),
            "--seq-len", "64", "--global-batch-size", "8", "--micro-batch-size", "8", "--dropout", "0",
            "--ds-config", "zero0_fp32.json", "--held-out", "0", "--no-progress", "--no-tensorboard",
            "--num-workers", "0"]


def _first_batch(args: list[str]):
    """The first micro-batch of the run, as its loader makes it."""
    parsed = train.parse_args(args)
    vocab_size = Manifest.load(parsed.data[0]).vocab_size
    cfg = train.config_from_args(parsed, {"vocab_size": vocab_size, "pad_token_id": 0}, None, hf_import.open_source(parsed.init_from))
    stream, _ = open_pretraining_data(cfg.data, cfg.seed)
    plan = BatchPlan.resolve(cfg.global_batch_size, cfg.micro_batch_size, 1)
    return PretrainingLoader(stream, plan, rank=0).next_step()[0]


@pytest.mark.lowest
def test_walkthrough_hf_folder_to_fill_mask(corpus, vocab, tmp_path):
    hf = tmp_path / "hf"
    source = _hf_folder(hf, vocab)
    data = _build(corpus, hf, tmp_path / "data")
    args = _train_args(data, hf, tmp_path / "run", steps=3)
    proc = run_cli("bert_ds.train", *args)  # no --preset: the shape comes from config.json

    log = proc.stdout + proc.stderr
    assert f"initialized weights from {hf / 'model.safetensors'}" in log
    assert "starting fresh" not in log  # BertForPreTraining has every head
    saved = json.loads((tmp_path / "run" / "checkpoints" / "latest" / "model_config.json").read_text())
    assert (saved["hidden_size"], saved["num_layers"], saved["num_heads"], saved["intermediate_size"]) == (48, 3, 4, 96)

    # The first step's loss (MLM + NSP, before any update) is the source model's on that batch.
    batch = _first_batch(args)
    inputs = dict(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                  attention_mask=batch["attention_mask"], labels=batch["labels"],
                  next_sentence_label=batch["next_sentence_label"])
    with torch.no_grad():
        theirs = source.eval()(**inputs).loss.item()
        fresh = transformers.BertForPreTraining(source.config).eval()(**inputs).loss.item()
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    print(f"\nfirst loss {first['loss']!r}, transformers' {theirs!r}: {abs(first['loss'] - theirs):.2e} apart")
    assert abs(first["loss"] - theirs) <= LOSS_TOLERANCE, (first["loss"], theirs)
    assert abs(first["loss"] - fresh) > 100 * LOSS_TOLERANCE, (first["loss"], fresh)  # the check can tell

    out = export_checkpoint(tmp_path / "run" / "checkpoints", tmp_path / "export")
    model = transformers.BertForPreTraining.from_pretrained(out)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (48, 3)
    # The run folder and the export start the next run the same way, without --preset.
    for again in (tmp_path / "run", out):
        source_again = hf_import.open_source(again)
        assert ModelConfig.from_dict(source_again.model) == ModelConfig.from_dict(hf_import.open_source(hf).model)
        hf_import.check_vocabulary(source_again, data)
    fill = transformers.pipeline("fill-mask", model=str(out), device="cpu")
    guesses = fill("the [MASK] of the river.")
    assert len(guesses) == 5 and all(g["token_str"] and 0.0 <= g["score"] <= 1.0 for g in guesses)


def test_bert_model_folder_starts_its_heads_fresh_and_lists_them(corpus, vocab, tmp_path):
    hf = tmp_path / "hf"
    _hf_folder(hf, vocab, transformers.BertModel)
    data = _build(corpus, hf, tmp_path / "data")
    proc = run_cli("bert_ds.train", *_train_args(data, hf, tmp_path / "run", steps=1))
    fresh = [line for line in (proc.stdout + proc.stderr).splitlines() if "starting fresh" in line]
    assert len(fresh) == 1
    assert fresh[0].endswith("starting fresh: cls.predictions.bias, cls.predictions.transform.dense, "
                             "cls.predictions.transform.LayerNorm, cls.seq_relationship"), fresh


# --------------------------------------------------------------------------- names and architecture

def _ours(source: hf_import.InitSource) -> BertForPreTraining:
    """Our model with a source's weights (what init_weights installs into the engine)."""
    model = BertForPreTraining(ModelConfig.from_dict({**source.model, "kernels": "torch", "hidden_dropout": 0.0}))
    params = [name for name, _ in model.named_parameters()]
    weights, _ = hf_import.match(hf_import.read_state(source.weights), params, source.weights, BERT)
    model.load_state_dict(weights, strict=False)
    return model.eval()


def _logits(model, hf_model):
    enc = {"input_ids": torch.tensor([[2, 40, 41, 42, 3, 43, 44, 3]]), "token_type_ids": torch.tensor([[0] * 5 + [1] * 3]),
           "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    with torch.no_grad():
        ours = model(**enc)
        theirs = hf_model.eval()(**enc)
    return ours, theirs


@pytest.mark.lowest
def test_legacy_gamma_beta_names_in_a_pytorch_model_bin_load_as_transformers_loads_them(vocab, tmp_path):
    hf = tmp_path / "hf"
    source_model = _hf_folder(hf, vocab)
    state = {name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): t
             for name, t in source_model.state_dict().items()}
    assert sum("gamma" in name for name in state) == 2 * 3 + 2  # embeddings, 2 per layer, MLM transform
    (hf / "model.safetensors").unlink()
    torch.save(state, hf / "pytorch_model.bin")

    source = hf_import.open_source(hf)
    assert source.weights == hf / "pytorch_model.bin"
    ours, theirs = _logits(_ours(source), transformers.BertForPreTraining.from_pretrained(hf))
    torch.testing.assert_close(ours.mlm_logits, theirs.prediction_logits[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.nsp_logits, theirs.seq_relationship_logits, rtol=0, atol=1e-5)


def _same_as_transformers(source: hf_import.InitSource, folder) -> None:
    ours, theirs = _logits(_ours(source), transformers.BertForPreTraining.from_pretrained(folder))
    torch.testing.assert_close(ours.mlm_logits, theirs.prediction_logits[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.nsp_logits, theirs.seq_relationship_logits, rtol=0, atol=1e-5)


@pytest.mark.lowest
def test_sharded_safetensors_load_as_transformers_loads_them(vocab, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    install_tokenizer(hf, vocab, Normalization(lowercase=True))
    torch.manual_seed(0)
    transformers.BertForPreTraining(transformers.BertConfig(vocab_size=len(vocab_entries(vocab)), **SHAPE)
                                    ).save_pretrained(hf, max_shard_size="100KB")
    shard_files = sorted(hf.glob("model-*.safetensors"))
    assert len(shard_files) > 2 and not (hf / "model.safetensors").exists()
    source = hf_import.open_source(hf)
    assert source.weights == hf / "model.safetensors.index.json" and source.model["num_layers"] == 3
    _same_as_transformers(source, hf)
    # the index given directly is the same source; a damaged shard fails at open, naming it
    assert hf_import.open_source(hf / "model.safetensors.index.json") == dataclasses.replace(
        source, path=hf / "model.safetensors.index.json")
    shard_files[1].write_bytes(b"\x00" * 9)
    with pytest.raises(UserError, match=f"{shard_files[1].name}: not a readable safetensors file"):
        hf_import.open_source(hf)


@pytest.mark.lowest
def test_sharded_pytorch_model_bin_loads_and_a_bad_index_is_one_line(vocab, tmp_path):
    hf = tmp_path / "hf"
    state = _hf_folder(hf, vocab).state_dict()
    (hf / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file, part in halves.items():
        torch.save({name: state[name] for name in part}, hf / file)
    index = hf / "pytorch_model.bin.index.json"
    weight_map = {name: file for file, part in halves.items() for name in part}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    source = hf_import.open_source(hf)
    assert source.weights == index
    _same_as_transformers(source, hf)

    moved = dict(weight_map, **{names[0]: "pytorch_model-00002-of-00002.bin"})
    index.write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(hf_import.InitFromError, match=f"maps {names[0]} to pytorch_model-00002-of-00002.bin, "
                                                      "which does not hold it"):
        hf_import.read_state(index)
    index.write_text(json.dumps({"weight_map": dict(weight_map, **{names[0]: "../elsewhere.bin"})}))
    with pytest.raises(hf_import.InitFromError, match="names shard '../elsewhere.bin'"):
        hf_import.open_source(hf)
    for bad in ("[1, 2]", "{}", '{"weight_map": {"a": 3}}', "not json"):
        index.write_text(bad)
        with pytest.raises(hf_import.InitFromError, match="pytorch_model.bin.index.json: "):
            hf_import.open_source(hf)


@pytest.mark.lowest
def test_a_safetensors_file_of_a_hugging_face_folder_takes_its_config(vocab, tmp_path):
    hf = tmp_path / "hf"
    _hf_folder(hf, vocab)
    source = hf_import.open_source(hf / "model.safetensors")
    assert source.model == hf_import.open_source(hf).model and source.described_by == hf / "config.json"
    _same_as_transformers(source, hf)
    bare = tmp_path / "bare.safetensors"
    bare.write_bytes((hf / "model.safetensors").read_bytes())
    assert hf_import.open_source(bare).model is None  # no config.json beside it: the architecture is --preset's


@pytest.mark.lowest
def test_masked_lm_folder_lacks_only_pooler_and_nsp(vocab, tmp_path):
    hf = tmp_path / "hf"
    source_model = _hf_folder(hf, vocab, transformers.BertForMaskedLM)
    source = hf_import.open_source(hf)
    params = [name for name, _ in BertForPreTraining(ModelConfig.from_dict(source.model)).named_parameters()]
    weights, fresh = hf_import.match(hf_import.read_state(source.weights), params, source.weights, BERT)
    assert hf_import.fresh_summary(fresh) == "bert.pooler.dense, cls.seq_relationship"
    theirs = source_model.state_dict()["cls.predictions.transform.dense.weight"]
    assert torch.equal(weights["cls.predictions.transform.dense.weight"], theirs)


@pytest.mark.lowest
def test_unmatched_and_missing_tensors_are_named(vocab, tmp_path):
    hf = tmp_path / "hf"
    _hf_folder(hf, vocab, transformers.BertForSequenceClassification)
    source = hf_import.open_source(hf)
    params = [name for name, _ in BertForPreTraining(ModelConfig.from_dict(source.model)).named_parameters()]
    state = hf_import.read_state(source.weights)
    with pytest.raises(hf_import.InitFromError, match=r"match no parameter of BertForPreTraining: classifier\.(weight|bias)"):
        hf_import.match(state, params, source.weights, BERT)
    del state["classifier.weight"], state["classifier.bias"], state["bert.encoder.layer.1.output.dense.weight"]
    with pytest.raises(hf_import.InitFromError, match=r"lacks 1 encoder weight\(s\): bert\.encoder\.layer\.1\.output\.dense\.weight"):
        hf_import.match(state, params, source.weights, BERT)


def test_a_preset_that_disagrees_names_the_fields(vocab, tmp_path):
    hf = tmp_path / "hf"
    _hf_folder(hf, vocab)
    args = train.parse_args(["--data", "d", "--init-from", str(hf), "--preset", "tiny"])
    with pytest.raises(hf_import.InitFromError) as caught:
        train.config_from_args(args, {"vocab_size": len(vocab_entries(vocab)), "pad_token_id": 0}, None, hf_import.open_source(hf))
    assert str(caught.value) == (f"--preset tiny disagrees with {hf / 'config.json'}: num_layers 2 vs 3, hidden_size 64 "
                                 "vs 48, num_heads 2 vs 4, intermediate_size 256 vs 96 (preset vs source); leave "
                                 "--preset out to take the source's")
    args = train.parse_args(["--data", "d", "--init-from", str(hf)])
    size = len(vocab_entries(vocab))
    with pytest.raises(hf_import.InitFromError, match=f"the model has {size} token embeddings but the shards' tokenizer 600"):
        train.config_from_args(args, {"vocab_size": 600, "pad_token_id": 0}, None, hf_import.open_source(hf))


def test_the_shards_tokenizer_must_be_the_models(vocab, tmp_path):
    hf = tmp_path / "hf"
    _hf_folder(hf, vocab)
    source = hf_import.open_source(hf)
    same = tmp_path / "same"
    same.mkdir()
    install_tokenizer(same, vocab, Normalization(lowercase=True))
    hf_import.check_vocabulary(source, same)

    entries = vocab_entries(vocab)
    swapped = entries[:100] + [entries[101], entries[100]] + entries[102:]
    other = tmp_path / "other"
    other.mkdir()
    install_tokenizer(other, ("\n".join(swapped) + "\n").encode(), Normalization(lowercase=True))
    with pytest.raises(hf_import.InitFromError) as caught:
        hf_import.check_vocabulary(source, other)
    assert f"token 100 is {entries[100]!r} in the model's tokenizer ({hf}) but {entries[101]!r}" in str(caught.value)

    cased = tmp_path / "cased"
    cased.mkdir()
    install_tokenizer(cased, vocab, Normalization(lowercase=False))
    with pytest.raises(hf_import.InitFromError, match="normalizes text as"):
        hf_import.check_vocabulary(source, cased)


def test_sources_that_cannot_start_a_run_are_one_line(vocab, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(hf_import.InitFromError, match="neither a Hugging Face model folder"):
        hf_import.open_source(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    with pytest.raises(ConfigError, match="model_type 'roberta'; --init-from takes a bert or modernbert model"):
        hf_import.open_source(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 48}))
    with pytest.raises(hf_import.InitFromError, match="holds config.json but none of model.safetensors, "
                       "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json"):
        hf_import.open_source(empty)
    (empty / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(UserError, match="model.safetensors: not a readable safetensors file"):
        hf_import.open_source(empty)

    hf = tmp_path / "hf"
    _hf_folder(hf, vocab)
    (hf / "model.safetensors").unlink()
    torch.save({"weights": torch.ones(2), "code": Normalization(lowercase=True)}, hf / "pytorch_model.bin")
    with pytest.raises(hf_import.InitFromError, match=r"not loadable as plain tensors \(torch.load weights_only=True"):
        hf_import.read_state(hf_import.open_source(hf).weights)
