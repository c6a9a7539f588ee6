"""A tokenizer given to a build is kept as given: a cased Hugging Face tokenizer builds cased
shards (its normalizer exactly), a flag that would change it is refused, and a bare
vocab.txt is cased exactly when it holds cased tokens."""

import json
import shutil
from pathlib import Path

import pytest
from transformers import BertTokenizerFast

from bert_ds.data_tools.__main__ import main
from bert_ds.data_tools.build import BuildOptions, build
from bert_ds.base.errors import UserError
from bert_ds.data_tools.manifest import Manifest, open_dataset
from bert_ds.data_tools.text import iter_text, split_sentences
from bert_ds.data_tools.tokenizer import HF_FILES, train_vocab, vocab_entries

SAMPLE = Path(__file__).resolve().parents[2] / "data_tools" / "sample" / "valid.txt"


@pytest.fixture(scope="module")
def cased(tmp_path_factory) -> Path:
    """A cased Hugging Face tokenizer folder, as transformers saves one."""
    root = tmp_path_factory.mktemp("cased")
    (root / "vocab.txt").write_bytes(train_vocab(lambda: iter_text([str(SAMPLE)]), 1500, lowercase=False))
    # From a folder holding vocab.txt: transformers 5 ignores a vocab_file= constructor argument.
    tok = BertTokenizerFast.from_pretrained(str(root), do_lower_case=False)
    assert len(tok.get_vocab()) == len(vocab_entries((root / "vocab.txt").read_bytes()))
    tok.save_pretrained(str(root / "hf"))
    return root / "hf"


def _opts(vocab: Path, out: Path, **kw) -> BuildOptions:
    return BuildOptions(inputs=[str(SAMPLE)], output=str(out), vocab=str(vocab), split_sentences=True,
                        progress=False, workers=1, **kw)


@pytest.mark.parametrize("given", ["folder", "tokenizer.json"])
def test_a_cased_tokenizer_builds_cased_shards_with_its_own_normalizer(cased, tmp_path, given):
    source = cased if given == "folder" else cased / "tokenizer.json"
    build(_opts(source, tmp_path / "data"))
    manifest, readers = open_dataset(tmp_path / "data")
    assert manifest.lowercase is False and manifest.build["normalizer"]["lowercase"] is False
    theirs = json.loads((cased / "tokenizer.json").read_text())["normalizer"]
    ours = json.loads((tmp_path / "data" / "tokenizer.json").read_text())["normalizer"]
    assert ours == theirs
    # The shards' ids are what the given tokenizer makes of the text: case survives.
    hf = BertTokenizerFast.from_pretrained(str(cased))
    sentences = readers[0].document(0)
    first = split_sentences(next(iter_text([str(SAMPLE)])))[0]  # the first sentence of the first document
    assert sentences[0].tolist() == hf(first, add_special_tokens=False)["input_ids"]
    assert hf.unk_token_id not in sentences[0].tolist()
    decoded = hf.decode(sentences[0].tolist())
    assert decoded != decoded.lower()
    for reader in readers:
        reader.close()


def test_a_flag_that_would_change_a_given_tokenizer_is_refused(cased, tmp_path, capsys):
    rc = main(["build", "--input", str(SAMPLE), "--output", str(tmp_path / "o"), "--vocab", str(cased),
               "--lowercase", "--no-progress", "--workers", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"error: {cased}: this tokenizer keeps case; --lowercase would change it and the "
                               "model it belongs to: drop --lowercase"]
    assert not (tmp_path / "o").exists()


def test_a_bare_vocab_txt_is_cased_exactly_when_it_holds_cased_tokens(cased, tmp_path):
    bare_cased = tmp_path / "bare-cased"
    bare_cased.mkdir()
    shutil.copy(cased.parent / "vocab.txt", bare_cased / "vocab.txt")
    build(_opts(bare_cased / "vocab.txt", tmp_path / "a"))
    assert Manifest.load(tmp_path / "a").lowercase is False

    bare_uncased = tmp_path / "bare-uncased"
    bare_uncased.mkdir()
    (bare_uncased / "vocab.txt").write_bytes(train_vocab(lambda: iter_text([str(SAMPLE)]), 500, lowercase=True))
    build(_opts(bare_uncased / "vocab.txt", tmp_path / "b"))
    assert Manifest.load(tmp_path / "b").lowercase is True
    build(_opts(bare_uncased / "vocab.txt", tmp_path / "c", lowercase=False))  # said explicitly: kept
    assert Manifest.load(tmp_path / "c").lowercase is False


def test_a_tokenizer_that_is_not_berts_is_refused(cased, tmp_path):
    other = tmp_path / "tokenizer.json"
    data = json.loads((cased / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "NFKC"}
    other.write_text(json.dumps(data))
    with pytest.raises(UserError, match="its normalizer is 'NFKC'; a BERT tokenizer has a BertNormalizer"):
        build(_opts(other, tmp_path / "o"))


def test_a_cased_tokenizer_survives_build_and_export_unchanged(cased, tmp_path):
    """The round trip a continued pretraining makes: a cased HF tokenizer -> shards -> an
    export whose tokenizer encodes text exactly as the source does, case and all."""
    import torch

    from bert_ds.checkpoint.export import export_hf
    from bert_ds.model.bert.model import BertForPreTraining
    from bert_ds.model.bert.config import ModelConfig

    build(_opts(cased, tmp_path / "data"))
    vocab_size = Manifest.load(tmp_path / "data").vocab_size
    config = ModelConfig(vocab_size=vocab_size, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                         max_position_embeddings=64, kernels="torch")
    torch.manual_seed(0)
    tokenizer = tmp_path / "tokenizer"  # what a checkpoint keeps of the dataset: its tokenizer files
    tokenizer.mkdir()
    for name in HF_FILES:
        shutil.copy(tmp_path / "data" / name, tokenizer / name)
    out = export_hf(BertForPreTraining(config).state_dict(), config, tokenizer, tmp_path / "hf")

    source, exported = BertTokenizerFast.from_pretrained(str(cased)), BertTokenizerFast.from_pretrained(str(out))
    text = "The Lobster of Atlantic Ocean was Described in 1758 ."
    assert exported(text)["input_ids"] == source(text)["input_ids"] != source(text.lower())["input_ids"]
    assert json.loads((out / "tokenizer.json").read_text())["normalizer"] == \
        json.loads((cased / "tokenizer.json").read_text())["normalizer"]
    assert exported.model_max_length == 64
