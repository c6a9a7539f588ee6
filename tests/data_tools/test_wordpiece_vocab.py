"""The dataset tokenizer: deterministic WordPiece training, loading a vocab.txt or a
tokenizer.json, and the checks on a given vocabulary."""

import hashlib
import re
from pathlib import Path

import pytest

from bert_ds.data_tools.__main__ import main
from bert_ds.base.errors import UserError
from bert_ds.data_tools.manifest import MANIFEST_NAME, Manifest
from bert_ds.data_tools.text import iter_text
from bert_ds.data_tools.tokenizer import read_vocab, train_vocab, vocab_entries

SAMPLE = Path(__file__).resolve().parents[2] / "data_tools" / "sample" / "valid.txt"


@pytest.fixture(scope="module")
def trained():
    return train_vocab(lambda: iter_text([str(SAMPLE)]), 2000, lowercase=True)


def test_training_is_deterministic(trained):
    # The plain tokenizers trainer gives a different vocabulary on most runs (hash-map
    # order decides ties); repeated runs of ours must agree byte for byte.
    digests = {hashlib.sha256(train_vocab(lambda: iter_text([str(SAMPLE)]), 2000, True)).hexdigest() for _ in range(3)}
    assert digests == {hashlib.sha256(trained).hexdigest()}


def test_trained_vocabulary_layout(trained):
    entries = vocab_entries(trained)
    assert len(entries) == 2000 and len(set(entries)) == 2000
    assert entries[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert "the" in entries and "##s" in entries
    assert all(e == e.lower() for e in entries[5:])


def test_cased_training_keeps_case():
    entries = vocab_entries(train_vocab(lambda: iter_text([str(SAMPLE)]), 1000, lowercase=False))
    assert "The" in entries or "T" in entries


def test_tokenizer_json_gives_the_same_vocabulary(trained, tmp_path):
    (tmp_path / "vocab.txt").write_bytes(trained)
    (tmp_path / "in.txt").write_text("The lobster is blue.\n")
    assert main(["build", "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "a"),
                 "--vocab", str(tmp_path / "vocab.txt"), "--workers", "1", "--no-progress"]) == 0
    assert read_vocab(str(tmp_path / "a" / "tokenizer.json")) == trained
    assert main(["build", "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "b"),
                 "--vocab", str(tmp_path / "a" / "tokenizer.json"), "--workers", "1", "--no-progress"]) == 0
    a, b = Manifest.load(tmp_path / "a"), Manifest.load(tmp_path / "b")
    assert a.tokenizer_fingerprint == b.tokenizer_fingerprint == hashlib.sha256(trained).hexdigest()
    assert (tmp_path / "a" / "shard_00000.bin").read_bytes() == (tmp_path / "b" / "shard_00000.bin").read_bytes()


@pytest.mark.parametrize("content, message", [
    ("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\nthe\n", "'the' appears twice (lines 6 and 7)"),
    ("[PAD]\n[UNK]\n\n[CLS]\n[SEP]\n[MASK]\n", "entry 2 (line 3) is empty"),
    ("[PAD]\n[UNK]\nthe\n", "lacks the special token(s) [CLS], [SEP], [MASK]"),
])
def test_bad_vocabulary(tmp_path, content, message):
    (tmp_path / "v.txt").write_text(content)
    with pytest.raises(UserError, match=re.escape(message)):
        read_vocab(str(tmp_path / "v.txt"))


def test_failed_build_leaves_an_existing_dataset_alone(trained, tmp_path, capsys):
    (tmp_path / "vocab.txt").write_bytes(trained)
    (tmp_path / "bad.txt").write_text("[PAD]\nthe\n")
    (tmp_path / "in.txt").write_text("The lobster is blue.\n")
    out = tmp_path / "d"
    assert main(["build", "--input", str(tmp_path / "in.txt"), "--output", str(out),
                 "--vocab", str(tmp_path / "vocab.txt"), "--workers", "1", "--no-progress"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["build", "--input", str(tmp_path / "in.txt"), "--output", str(out),
                 "--vocab", str(tmp_path / "bad.txt"), "--workers", "1", "--no-progress"]) == 2
    assert "lacks the special token(s)" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert (out / MANIFEST_NAME).exists()


def test_crlf_vocabulary_is_normalized(trained, tmp_path):
    (tmp_path / "v.txt").write_bytes(trained.replace(b"\n", b"\r\n"))
    assert read_vocab(str(tmp_path / "v.txt")) == trained
