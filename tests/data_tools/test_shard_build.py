"""End to end: sample corpus -> shards; round trip against the tokenizer; determinism
across --workers and processes; R5 (vocabulary mismatch), R6 (dirty input, huge line)
and R9 (write failure, then resume) through the real build."""

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import bert_ds.data_tools.build as build_module
from bert_ds.data_tools.__main__ import main
from bert_ds.data_tools.build import JOURNAL_NAME, BuildOptions, build
from bert_ds.base.errors import ShardError
from bert_ds.data_tools.manifest import MANIFEST_NAME, Manifest, open_dataset
from bert_ds.data_tools.shard_format import ShardReader, ShardWriter
from bert_ds.data_tools.text import split_sentences

SAMPLE = Path(__file__).resolve().parents[2] / "data_tools" / "sample" / "valid.txt"
OPTS = dict(train_vocab=4096, split_sentences=True, shard_tokens=100_000, progress=False)


def files(directory):
    """{name: bytes} of a dataset folder."""
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir())}


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample")
    result = build(BuildOptions(inputs=[str(SAMPLE)], output=str(out), workers=1, **OPTS))
    return out, result


def wikitext_docs(text):
    """Sentences per article, parsed here without the reader: titles '= X =' start an
    article, '= = X = =' sections are dropped, blank lines mean nothing."""
    docs = []
    for line in text.split("\n"):
        s = line.strip()
        if not s:
            continue
        if s.startswith("= =") and s.endswith("= ="):
            continue
        if s.startswith("= ") and s.endswith(" ="):
            docs.append([])
            continue
        docs[-1].extend(split_sentences(s))
    return docs


def test_sample_build(sample):
    out, result = sample
    m = result.manifest
    assert m.totals["docs"] == 60  # WikiText-2 valid has 60 articles
    assert m.stats["documents_in"] == m.stats["documents_written"] + sum(m.stats["documents_skipped"].values())
    assert len(m.shards) == 3 and m.vocab_size == 4096 and m.token_dtype == "uint16"
    assert m.special_tokens == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    _, readers = open_dataset(out, verify=True)
    for r in readers:
        assert (np.diff(r.doc_bounds) >= 1).all()  # every document has a sentence
        assert (r.sentence_lengths >= 1).all()
    summary = result.summary()
    bytes_per_token = result.bytes_on_disk / m.totals["tokens"]
    print(f"\n{summary}")
    assert f"({bytes_per_token:.3f} bytes/token)" in summary
    assert bytes_per_token <= 2.2
    assert sorted(os.listdir(out)) == [
        MANIFEST_NAME, "shard_00000.bin", "shard_00000.idx", "shard_00001.bin", "shard_00001.idx",
        "shard_00002.bin", "shard_00002.idx", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json", "vocab.txt",
    ]


def test_round_trip_reproduces_the_tokenizer(sample):
    out, _ = sample
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    expected = []
    for sentences in wikitext_docs(SAMPLE.read_text(encoding="utf-8")):
        ids = [e.ids for e in tok.encode_batch(sentences, add_special_tokens=False)]
        ids = [i for i in ids if i]
        if ids:
            expected.append(ids)
    _, readers = open_dataset(out)
    got = [[s.tolist() for s in r.document(d)] for r in readers for d in range(r.num_docs)]
    assert len(got) == len(expected) == 60
    for d, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a == b, f"document {d} differs"


def test_hugging_face_loads_the_folder_and_agrees(sample):
    from transformers import BertTokenizerFast

    out, result = sample
    hf = BertTokenizerFast.from_pretrained(str(out))
    assert hf.vocab_size == result.manifest.vocab_size
    assert (hf.cls_token_id, hf.sep_token_id, hf.mask_token_id, hf.pad_token_id) == (2, 3, 4, 0)
    _, readers = open_dataset(out)
    first = readers[0].document(0)[0].tolist()
    text = SAMPLE.read_text(encoding="utf-8").split("\n")[3]  # first paragraph of article 1
    assert hf(split_sentences(text)[0], add_special_tokens=False)["input_ids"] == first


def test_workers_change_no_byte(sample, tmp_path):
    out, _ = sample
    build(BuildOptions(inputs=[str(SAMPLE)], output=str(tmp_path), workers=2, **OPTS))
    assert files(tmp_path) == files(out)


def test_cli_build_in_another_process_is_identical(sample, tmp_path):
    """Also shows vocabulary training is deterministic across processes."""
    import subprocess
    import sys

    out, _ = sample
    proc = subprocess.run(
        [sys.executable, "-m", "bert_ds.data_tools", "build", "--input", str(SAMPLE), "--output", str(tmp_path),
         "--train-vocab", "4096", "--split-sentences", "--shard-tokens", "100000", "--workers", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bytes/token" in proc.stdout and "tokens/s" in proc.stdout
    assert "tokenize" in proc.stderr  # the progress bar
    assert files(tmp_path) == files(out)


# -- R5 ------------------------------------------------------------------------------------

def test_r5_tokens_beyond_the_manifest_vocab_are_rejected(sample, tmp_path):
    out, _ = sample
    bad = tmp_path / "d"
    shutil.copytree(out, bad)
    m = json.loads((bad / MANIFEST_NAME).read_text())
    m["vocab_size"] = 1000
    (bad / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(ShardError) as e:
        open_dataset(bad)
    assert f"{bad / 'shard_00000.idx'}: max token id" in str(e.value)
    assert ">= vocab size 1000" in str(e.value)


def test_r5_another_tokenizer_is_rejected(sample, tmp_path):
    out, _ = sample
    bad = tmp_path / "d"
    shutil.copytree(out, bad)
    lines = (bad / "vocab.txt").read_text().split("\n")
    lines[100], lines[101] = lines[101], lines[100]  # same size, other ids
    (bad / "vocab.txt").write_text("\n".join(lines))
    with pytest.raises(ShardError, match=r"vocab\.txt: tokenizer fingerprint .* does not match"):
        open_dataset(bad)


def test_r5_writer_refuses_ids_beyond_vocab(tmp_path):
    with pytest.raises(ShardError, match="outside the vocabulary"):
        with ShardWriter(tmp_path / "s", 4096) as w:
            w.add_document([np.array([4096])])


# -- R6 ------------------------------------------------------------------------------------

def test_r6_dirty_input_counts_balance(sample, tmp_path):
    out, _ = sample
    src = tmp_path / "dirty.txt"
    src.write_bytes(
        b"The lobster is blue.\r\nIt turns red\x00 when cooked.\r\n\r\n"  # doc 1: CRLF, NUL
        b"caf\xe9 and \xff\xfe tea.\n\n"  # doc 2: 3 invalid bytes
        b"\x01\x02\x03\n\n"  # doc 3: control characters only -> empty
        b" = = Section only = = \n\n"  # doc 4: a heading and nothing else -> empty
        b"\n\n\n"
        b"Last one.\n"  # doc 5
    )
    result = build(BuildOptions(inputs=[str(src)], output=str(tmp_path / "o"), vocab=str(out / "vocab.txt"),
                                workers=1, progress=False))
    st = result.manifest.stats
    assert st["documents_in"] == 5
    assert st["documents_written"] == 3
    assert st["documents_skipped"] == {"empty": 2}
    assert st["invalid_utf8_replaced"] == 3
    assert st["nul_bytes_removed"] == 1
    assert st["crlf_lines"] == 3
    assert st["empty_sentences_dropped"] == 1
    assert st["headings_dropped"] == 1
    assert st["input_bytes"] == src.stat().st_size
    assert result.manifest.totals["docs"] == 3
    _, readers = open_dataset(tmp_path / "o", verify=True)
    assert [len(readers[0].document(d)) for d in range(3)] == [2, 1, 1]


def test_r6_huge_line_gives_the_tokens_of_the_whole_line(sample, tmp_path):
    out, _ = sample
    line = "the lobster sat on the big blue rock and " * 50_000  # ~2 MB, one line: two pieces
    src = tmp_path / "huge.txt"
    src.write_text("Small first document.\n\n" + line + "\n")
    result = build(BuildOptions(inputs=[str(src)], output=str(tmp_path / "o"), vocab=str(out / "vocab.txt"),
                                workers=2, progress=False))
    st = result.manifest.stats
    assert st["long_lines_cut"] == 1 and st["documents_written"] == 2
    assert st["long_sentences_split"] >= 1  # a 1 MiB piece holds more than 65535 tokens
    tok = Tokenizer.from_file(str(tmp_path / "o" / "tokenizer.json"))
    want = np.array(tok.encode(line, add_special_tokens=False).ids)
    _, readers = open_dataset(tmp_path / "o")
    got = np.concatenate(readers[0].document(1))
    np.testing.assert_array_equal(got, want)
    assert (readers[0].sentence_lengths <= 65535).all()


def test_r6_empty_corpus_is_a_one_line_error(sample, tmp_path, capsys):
    out, _ = sample
    src = tmp_path / "empty.txt"
    src.write_bytes(b"\n\n = = Heading = = \n\n\x00\x00\n\n\x07\n")
    rc = main(["build", "--input", str(src), "--output", str(tmp_path / "o"), "--vocab", str(out / "vocab.txt"),
               "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err.strip().split("\n")
    assert rc == 2
    assert err == [f"error: empty corpus: no document written from {src} (2 documents in, 2 empty)"]
    assert not (tmp_path / "o").exists()  # R18: the folder exactly as before (here: none)
    # an empty folder stays empty, and a later build of other inputs into either starts afresh
    (tmp_path / "e").mkdir()
    assert main(["build", "--input", str(src), "--output", str(tmp_path / "e"), "--vocab", str(out / "vocab.txt"),
                 "--workers", "1", "--no-progress"]) == 2
    assert list((tmp_path / "e").iterdir()) == []
    capsys.readouterr()
    good = tmp_path / "good.txt"
    good.write_text("A sentence of text. Another one here.\n\nA second document.\n")
    assert main(["build", "--input", str(good), "--output", str(tmp_path / "e"), "--vocab", str(out / "vocab.txt"),
                 "--workers", "1", "--no-progress"]) == 0
    assert (tmp_path / "e" / MANIFEST_NAME).is_file()


def test_an_empty_corpus_leaves_a_dataset_already_there_untouched(sample, tmp_path, capsys):
    out, _ = sample
    src = tmp_path / "empty.txt"
    src.write_text("\n\n")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert main(["build", "--input", str(src), "--output", str(out), "--vocab", str(out / "vocab.txt"),
                 "--workers", "1", "--no-progress"]) == 2
    assert "already holds a finished dataset" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


# -- R9 ------------------------------------------------------------------------------------

def _fail_writes(monkeypatch, when):
    """Make ShardWriter._write raise ENOSPC for files matching when(name)."""
    real = ShardWriter._write

    def write(self, f, data):
        if when(str(f.name)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f.name))
        real(self, f, data)

    monkeypatch.setattr(ShardWriter, "_write", write)


def _assert_nothing_partial(directory, n_complete):
    names = sorted(os.listdir(directory))
    assert MANIFEST_NAME not in names
    assert not [n for n in names if n.endswith(".tmp")]
    shards = sorted(n for n in names if n.startswith("shard_"))
    assert shards == [f"shard_{i:05d}.{ext}" for i in range(n_complete) for ext in ("bin", "idx")]
    for i in range(n_complete):
        with ShardReader(Path(directory) / f"shard_{i:05d}") as r:
            r.verify()


def test_r9_disk_full_mid_build_then_rerun_resumes(sample, tmp_path, monkeypatch, capsys):
    out, _ = sample
    dst = tmp_path / "o"
    _fail_writes(monkeypatch, lambda name: "shard_00002.bin" in name)
    rc = main(["build", "--input", str(SAMPLE), "--output", str(dst), "--train-vocab", "4096",
               "--split-sentences", "--shard-tokens", "100000", "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err.strip().split("\n")
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: ") and "No space left on device" in err[0]
    _assert_nothing_partial(dst, 2)
    assert len(json.loads((dst / JOURNAL_NAME).read_text())["shards"]) == 2
    monkeypatch.undo()

    def no_training(*args, **kwargs):
        raise AssertionError("the vocabulary in the folder was trained again")

    # the rerun resumes with the vocabulary the folder holds, which its journal's key vouches for
    monkeypatch.setattr(build_module, "train_vocab", no_training)
    result = build(BuildOptions(inputs=[str(SAMPLE)], output=str(dst), workers=2, **OPTS))
    assert result.shards_reused == 2
    assert files(dst) == files(out)


def test_an_interrupted_build_whose_folder_holds_another_vocabulary_trains_its_own(sample, tmp_path, monkeypatch,
                                                                                  capsys):
    """Killed after its journal but before its tokenizer replaced an older one: the folder's
    vocabulary does not make the journal's key, so the rerun trains, and resumes."""
    out, _ = sample
    dst = tmp_path / "o"
    _fail_writes(monkeypatch, lambda name: "shard_00002.bin" in name)
    assert main(["build", "--input", str(SAMPLE), "--output", str(dst), "--train-vocab", "4096", "--split-sentences",
                 "--shard-tokens", "100000", "--workers", "1", "--no-progress"]) == 2
    monkeypatch.undo()
    tokenizer = json.loads((dst / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    word = next(w for w in vocab if w.isalpha())
    vocab["zzz" + word] = vocab.pop(word)
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = build(BuildOptions(inputs=[str(SAMPLE)], output=str(dst), workers=1, **OPTS))
    assert result.shards_reused == 2
    assert files(dst) == files(out)


def test_r9_failure_in_the_index_write_and_a_damaged_shard(sample, tmp_path, monkeypatch):
    out, _ = sample
    dst = tmp_path / "o"
    _fail_writes(monkeypatch, lambda name: "shard_00001.idx" in name)
    with pytest.raises(Exception) as e:
        build(BuildOptions(inputs=[str(SAMPLE)], output=str(dst), workers=1, **OPTS))
    assert "No space left on device" in str(e.value)
    _assert_nothing_partial(dst, 1)
    monkeypatch.undo()

    with open(dst / "shard_00000.bin", "rb+") as f:  # the finished shard rots on disk
        f.seek(100)
        f.write(b"\x00\x00")
    result = build(BuildOptions(inputs=[str(SAMPLE)], output=str(dst), workers=1, **OPTS))
    assert result.shards_reused == 0  # it no longer verifies, so it is rebuilt
    assert files(dst) == files(out)


def test_manifest_round_trips(sample):
    out, result = sample
    loaded = Manifest.load(out)
    assert loaded == result.manifest
    assert list(json.loads((out / MANIFEST_NAME).read_text())) == [
        "format_version", "created_by", "vocab_size", "token_dtype", "lowercase", "special_tokens",
        "tokenizer_fingerprint", "shards", "totals", "sources", "build", "stats",
    ]
    assert loaded.sources[0]["path"] == str(SAMPLE) and len(loaded.sources[0]["sha256"]) == 64


@pytest.mark.parametrize("corrupt, message", [
    (lambda text: text[: len(text) // 2], "unreadable"),
    (lambda text: text.replace('"format_version": 1', '"format_version": 2'), "unsupported format_version 2"),
    (lambda text: text.replace('"token_dtype"', '"dtype"'), "missing key 'token_dtype'"),
    (lambda text: text.replace('"name": "shard_00001"', '"name": "../shard_00001"'), "invalid name"),
    (lambda text: text.replace('"docs": 60', '"docs": 61'), "totals.docs = 61, but the shards add up to 60"),
])
def test_damaged_manifest_is_one_shard_error_naming_it(sample, tmp_path, corrupt, message):
    out, _ = sample
    (tmp_path / MANIFEST_NAME).write_text(corrupt((out / MANIFEST_NAME).read_text()))
    with pytest.raises(ShardError) as e:
        Manifest.load(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / MANIFEST_NAME}: ")
    assert message in str(e.value)


# -- sentences joined into few tokenizer inputs ----------------------------------------------

# Lines as the reader yields them (stripped, non-empty), with what could break joining
# sentences by a special token: control characters only (a sentence with no token),
# accents and combining marks, final sigma, CJK, words over 100 characters, other
# special tokens, and splits before quotes, digits and accented capitals.
TRICKY_LINES = [
    "Plain one. Two sentences here!", "\x01\x02", "\u0301", "e\u0301te\u0301. E\u0301te\u0301 ended.",
    "ΟΔΟΣ. ΑΣ? Σ ends here", "中文字。 Next one. 中", "x" * 130 + ". Y" + "y" * 120,
    "Mr. Smith met Dr. Who? \"Yes.\" 'No.' “Maybe.” 3 times. Élan. Øre.", "[MASK] and [CLS] stay. [UNK]",
    "Ends with a stop. \x1c\x1f", "tab\tseparated.\tNext\u00a0one.\u3000Third", "?!.",
]


def _tokenize_both_ways(directory, parts, split):
    from bert_ds.data_tools.build import _Tokenize

    tok = _Tokenize((Path(directory) / "tokenizer.json").read_text(encoding="utf-8"))
    assert tok.can_join
    return tok, tok._joined(parts, split), tok._one_by_one(parts, split)


def test_sentences_joined_by_a_special_token_encode_as_one_by_one(sample):
    out, _ = sample
    lines = TRICKY_LINES * 3 + SAMPLE.read_text(encoding="utf-8").split("\n")[:300]
    lines = [s for s in (line.strip() for line in lines) if s]
    parts = [lines[:7], [], lines[7:40], lines[40:41], lines[41:]]
    for split in ([True] * 5, [False] * 5, [True, False, True, False, True]):
        _, joined, one_by_one = _tokenize_both_ways(out, parts, split)
        assert joined is not None
        for a, b in zip(joined, one_by_one, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        assert joined[3].sum() > 0  # the control-character lines gave empty sentences


def test_text_holding_the_marker_is_encoded_one_by_one(sample):
    out, _ = sample
    parts = [["A sentence. Then [SEP] in the text. End."], ["Another document."]]
    tok, joined, one_by_one = _tokenize_both_ways(out, parts, [True, True])
    assert joined is None  # the marker count gives it away
    for a, b in zip(tok(parts, [True, True]), one_by_one, strict=True):
        assert np.array_equal(a, b)
    assert list(one_by_one[2]) == [3, 1]


def test_sentences_cut_at_mark_ids_encode_as_one_by_one(sample):
    out, _ = sample
    lines = TRICKY_LINES * 3 + SAMPLE.read_text(encoding="utf-8").split("\n")[:300]
    lines = [s for s in (line.strip() for line in lines) if s]
    parts = [lines[:7], [], lines[7:40], lines[40:41], lines[41:]]
    tok, _, _ = _tokenize_both_ways(out, [[]], [True])
    assert tok.can_mark
    for split in ([True] * 5, [False] * 5, [True, False, True, False, True]):
        by_marks, one_by_one = tok._by_marks(parts, split), tok._one_by_one(parts, split)
        assert by_marks is not None
        for a, b in zip(by_marks, one_by_one, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    assert all(np.array_equal(a, b) for a, b in zip(tok._by_marks([[], []], [True, False]),
                                                      tok._one_by_one([[], []], [True, False]), strict=True))


def test_mark_ids_that_do_not_pair_with_mark_characters_fall_back(sample):
    out, _ = sample
    tok, _, one_by_one = _tokenize_both_ways(out, [["One. Two, three. Four"], ["Five!"]], [True, True])
    tok.mark_ids = np.array([tok.mark_ids[0], tok.encode([","], add_special_tokens=False)[0].ids[0]], dtype=np.uint32)
    assert tok._by_marks([["One. Two, three. Four"], ["Five!"]], [True, True]) is None  # "," counted, "!" not
    for a, b in zip(tok([["One. Two, three. Four"], ["Five!"]], [True, True]), one_by_one, strict=True):
        assert np.array_equal(a, b)
