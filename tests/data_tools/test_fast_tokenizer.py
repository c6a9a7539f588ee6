"""``build --tokenizer``: any Hugging Face fast tokenizer, kept as it is. A byte-level BPE shaped
like ModernBERT's (special tokens at the end of the vocabulary), a >65,535-entry WordLevel
tokenizer (uint32 shards), the fingerprint a held-out set is matched by, and the refusals."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from bert_ds.base.errors import ShardError
from bert_ds.config import DataConfig
from bert_ds.data_tools.__main__ import main
from bert_ds.data_tools.manifest import Manifest, open_dataset
from bert_ds.data_tools.shard_format import ShardReader
from bert_ds.loader.pretraining import PretrainingDataset, check_tokenizers, open_pretraining_data

SPECIALS = {"unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]"}
DOCUMENTS = [
    ["The lobster is blue in life. It turns red only when cooked.", "Mating occurs in the summer."],
    ["Homarus gammarus lives in the eastern Atlantic Ocean, from Norway to Morocco.",
     "Its claws differ: the larger one crushes, the other cuts. Spines are white or red."],
    ["A short one."],
    ["Numbers like 3.14 and 2026, quotes \"like these\", and accents: café, Äpfel, straße."],
]


def _write_text(path: Path, documents: list[list[str]]) -> Path:
    path.write_text("\n\n".join("\n".join(lines) for lines in documents) + "\n", encoding="utf-8")
    return path


def _bpe(folder: Path, config: dict | None = None, vocab_size: int = 400) -> Path:
    """A byte-level BPE (GPT-2's pre-tokenizer, as ModernBERT's), its five special tokens added
    after the merges, as ModernBERT's are; ``config``: its tokenizer_config.json (None: none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([line for doc in DOCUMENTS for line in doc] * 20, trainer)
    tok.add_special_tokens(list(SPECIALS.values()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _named() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", **{f"{k}_token": v for k, v in SPECIALS.items()}}


def _build(*args: str) -> int:
    return main(["build", *args, "--workers", "1", "--no-progress"])


def _documents(folder: Path) -> list[np.ndarray]:
    _, readers = open_dataset(folder)
    return [np.concatenate(r.document(d)) for r in readers for d in range(r.num_docs)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return _bpe(tmp_path_factory.mktemp("bpe") / "tok", _named())


@pytest.fixture(scope="module")
def built(tmp_path_factory, bpe) -> Path:
    root = tmp_path_factory.mktemp("built")
    text = _write_text(root / "in.txt", DOCUMENTS)
    assert _build("--input", str(text), "--output", str(root / "ds"), "--tokenizer", str(bpe)) == 0
    return root / "ds"


def test_bpe_shards_decode_to_the_text_and_equal_the_whole_documents_encoding(built, bpe):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    docs = _documents(built)
    assert len(docs) == len(DOCUMENTS)
    for ids, lines in zip(docs, DOCUMENTS, strict=True):
        text = "\n".join(lines) + "\n"
        assert tok.decode(ids.tolist()) == text
        # line by line, each ending in its newline, is how the document's text encodes whole
        assert ids.tolist() == tok.encode(text, add_special_tokens=False).ids
    m = Manifest.load(built)
    assert m.special_tokens == {k: tok.token_to_id(v) for k, v in SPECIALS.items()}
    assert m.build["vocab"] == {"tokenizer": str(bpe)} and m.token_dtype == "uint16"
    assert not (built / "vocab.txt").exists()
    assert (built / "tokenizer.json").read_bytes() == (bpe / "tokenizer.json").read_bytes()  # kept as it is


def test_worker_processes_write_the_same_bytes(tmp_path, built, bpe):
    text = _write_text(tmp_path / "in.txt", DOCUMENTS)
    assert main(["build", "--input", str(text), "--output", str(tmp_path / "ds"), "--tokenizer", str(bpe),
                 "--workers", "2", "--no-progress", "--shard-tokens", "40"]) == 0  # a shard a document or two
    assert np.concatenate(_documents(tmp_path / "ds")).tolist() == np.concatenate(_documents(built)).tolist()
    assert main(["build", "--input", str(text), "--output", str(tmp_path / "ds2"), "--tokenizer", str(bpe),
                 "--workers", "1", "--no-progress", "--shard-tokens", "40"]) == 0
    for f in sorted((tmp_path / "ds").iterdir()):
        assert f.read_bytes() == (tmp_path / "ds2" / f.name).read_bytes(), f.name


def test_split_sentences_keep_the_space_between_them(tmp_path, bpe):
    from tokenizers import Tokenizer

    text = _write_text(tmp_path / "in.txt", DOCUMENTS[:2])
    assert _build("--input", str(text), "--output", str(tmp_path / "ds"), "--tokenizer", str(bpe),
                  "--split-sentences") == 0
    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    _, readers = open_dataset(tmp_path / "ds")
    assert readers[0].num_sentences > sum(len(d) for d in DOCUMENTS[:2])  # lines were cut into sentences
    for ids, lines in zip(_documents(tmp_path / "ds"), DOCUMENTS[:2], strict=True):
        assert tok.decode(ids.tolist()) == "\n".join(lines) + "\n"


def test_autotokenizer_of_the_dataset_folder_reproduces_the_ids(built):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(built))
    m = Manifest.load(built)
    assert {k: getattr(hf, f"{k}_token_id") for k in SPECIALS} == m.special_tokens
    for ids, lines in zip(_documents(built), DOCUMENTS, strict=True):
        assert hf("\n".join(lines) + "\n", add_special_tokens=False)["input_ids"] == ids.tolist()


def test_verify_and_inspect_a_bpe_dataset(built, capsys):
    assert main(["verify", str(built)]) == 0
    assert main(["inspect", str(built), "--decode", "1"]) == 0
    out = capsys.readouterr().out
    assert "\n".join(DOCUMENTS[0]) in out


def test_special_tokens_from_flags_are_written_for_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    bare = _bpe(tmp_path / "bare")  # a tokenizer.json alone: nothing names its special tokens
    text = _write_text(tmp_path / "in.txt", DOCUMENTS)
    flags = [a for k, v in SPECIALS.items() for a in ("--special-token", f"{k}={v}")]
    assert _build("--input", str(text), "--output", str(tmp_path / "ds"), "--tokenizer",
                  str(bare / "tokenizer.json"), *flags) == 0
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "ds"))
    assert hf.mask_token == "[MASK]" and hf.mask_token_id == Manifest.load(tmp_path / "ds").special_tokens["mask"]


def _words(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


def test_a_vocabulary_past_65535_is_stored_as_uint32_and_read_back(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = _words(70_000)
    vocab = {w: i for i, w in enumerate(words)} | {v: 70_000 + i for i, v in enumerate(SPECIALS.values())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(_named()))
    docs = [["w69999 w3 w65536 w70000"], ["w12 w65535 w1", "w66000"]]  # w70000 is unknown
    text = _write_text(tmp_path / "in.txt", docs)
    assert _build("--input", str(text), "--output", str(tmp_path / "ds"), "--tokenizer", str(tmp_path / "tok")) == 0
    m = Manifest.load(tmp_path / "ds")
    assert m.vocab_size == 70_005 and m.token_dtype == "uint32"
    with ShardReader(tmp_path / "ds" / "shard_00000") as r:
        assert r.dtype.itemsize == 4
    want = [[69999, 3, 65536, 70_000], [12, 65535, 1, 66000]]  # [UNK] is 70,000
    assert [d.tolist() for d in _documents(tmp_path / "ds")] == want
    assert main(["verify", str(tmp_path / "ds")]) == 0
    cfg = DataConfig(train=str(tmp_path / "ds"), layout="documents", pair_task="none", max_seq_length=8,
                     mask_rate=0.01)
    ds = PretrainingDataset(cfg.train, cfg, seed=1)
    samples = [ds.sample(0, i) for i in range(len(ds))]
    # the tokens as read (a masked one is its label): ids past 65,535 come back from the shards whole
    tokens = sorted(np.where(s["labels"] >= 0, s["labels"], s["input_ids"])[1:-1].tolist() for s in samples)
    assert tokens == sorted(want)


def test_held_out_set_of_the_same_tokenizer_matches_and_another_is_refused(tmp_path, built, bpe):
    text = _write_text(tmp_path / "held.txt", DOCUMENTS[1:3])
    # from the training set's folder, and from a copy of the tokenizer saved in another layout
    assert _build("--input", str(text), "--output", str(tmp_path / "same"), "--tokenizer", str(built)) == 0
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "tokenizer.json").write_text(json.dumps(json.loads((bpe / "tokenizer.json").read_text()), indent=4))
    shutil.copy(bpe / "tokenizer_config.json", copy)
    assert _build("--input", str(text), "--output", str(tmp_path / "resaved"), "--tokenizer", str(copy)) == 0
    other = _bpe(tmp_path / "other", _named(), vocab_size=380)  # another vocabulary
    assert _build("--input", str(text), "--output", str(tmp_path / "other_ds"), "--tokenizer", str(other)) == 0
    fingerprint = Manifest.load(built).tokenizer_fingerprint
    assert Manifest.load(tmp_path / "same").tokenizer_fingerprint == fingerprint
    assert Manifest.load(tmp_path / "resaved").tokenizer_fingerprint == fingerprint
    assert Manifest.load(tmp_path / "other_ds").tokenizer_fingerprint != fingerprint
    cfg = dict(train=str(built), layout="documents", pair_task="none", max_seq_length=16)
    check_tokenizers(DataConfig(val=str(tmp_path / "resaved"), **cfg))
    _, val = open_pretraining_data(DataConfig(val=str(tmp_path / "same"), **cfg), seed=1)
    assert val is not None
    with pytest.raises(ShardError, match="built with another tokenizer"):
        check_tokenizers(DataConfig(val=str(tmp_path / "other_ds"), **cfg))
    with pytest.raises(ShardError, match="built with another tokenizer"):
        open_pretraining_data(DataConfig(val=str(tmp_path / "other_ds"), **cfg), seed=1)


def test_a_changed_tokenizer_json_in_the_dataset_is_caught(tmp_path, built):
    copy = tmp_path / "ds"
    shutil.copytree(built, copy)
    data = json.loads((copy / "tokenizer.json").read_text())
    data["added_tokens"][-1]["content"] = "[MASK2]"
    (copy / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ShardError, match="tokenizer_sha256"):
        open_dataset(copy)
    assert main(["verify", str(copy)]) == 1


def _refused(capsys, *args: str) -> str:
    assert _build(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_refusals_are_one_line(tmp_path, bpe, capsys):
    text = _write_text(tmp_path / "in.txt", DOCUMENTS)
    out = tmp_path / "o"
    common = ["--input", str(text), "--output", str(out)]
    no_mask = _bpe(tmp_path / "nomask", {k: v for k, v in _named().items() if k != "mask_token"})
    msg = _refused(capsys, *common, "--tokenizer", str(no_mask))
    assert "no mask token" in msg and "--special-token mask=TOKEN" in msg
    msg = _refused(capsys, *common, "--tokenizer", str(bpe), "--special-token", "mask=[PAD]")
    assert "names mask_token '[MASK]'" in msg
    msg = _refused(capsys, *common, "--tokenizer", str(no_mask), "--special-token", "mask=<mask>")
    assert "'<mask>' is not in the tokenizer's vocabulary" in msg
    msg = _refused(capsys, *common, "--tokenizer", str(no_mask), "--special-token", "mask=[PAD]")
    assert "share an id" in msg
    msg = _refused(capsys, *common, "--tokenizer", str(bpe), "--special-token", "bos=[CLS]")
    assert "the kinds are pad, unk, cls, sep, mask" in msg
    assert "a --tokenizer is kept as it is" in _refused(capsys, *common, "--tokenizer", str(bpe), "--lowercase")
    assert "--special-token names" in _refused(capsys, *common, "--train-vocab", "100", "--special-token", "mask=x")
    wordpiece = tmp_path / "wp"
    wordpiece.mkdir()
    (wordpiece / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n")
    assert "is given with --vocab" in _refused(capsys, *common, "--tokenizer", str(wordpiece))
    assert not out.exists()  # nothing made by a refused build
