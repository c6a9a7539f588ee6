"""Record inputs (JSONL, Parquet, datasets folders, hf: names): each builds the same
shards as the same documents written as plain text in BERT's convention; skipped
records are counted; the reader resumes at any record; bad inputs are one-line errors."""

import errno
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bert_ds.data_tools.__main__ import main
from bert_ds.data_tools.build import BuildOptions, build
from bert_ds.base.errors import UserError
from bert_ds.data_tools.shard_format import ShardWriter
from bert_ds.data_tools.text import CorpusReader, DocEnd, split_sentences

# Records hold paragraphs: several sentences to a line, blank lines between paragraphs.
DOCS = [
    "The lobster is blue. It lives in the sea.\n\nA second paragraph! Is it here? Yes, it is.",
    "One document of one sentence",
    "Café au lait. Über alles. \r\n  \nThe last line of the third document.\n",
    "\n\nLeading blank lines. Then 1990 came.\n\n\n\"Quoted\" text ends it.",
]
SHARD_TOKENS = 12  # several shards from a few documents: every shard boundary is a resume point
BUILD = dict(workers=1, progress=False, shard_tokens=SHARD_TOKENS)


def bert_text(docs):
    """The documents in BERT's text convention: one sentence per line, a blank line between."""
    return "\n\n".join("\n".join(s for line in d.split("\n") for s in split_sentences(line)) for d in docs) + "\n"


def shard_files(directory):
    """{name: bytes} of the shards and tokenizer files (the manifest names its sources)."""
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.name != "manifest.json"}


def write_jsonl(path, records):
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    if str(path).endswith(".gz"):
        lines = gzip.compress(lines)
    Path(path).write_bytes(lines)
    return str(path)


def write_parquet(path, columns, row_group_size=2):
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return str(path)


def write_hf(path, columns):
    from datasets import Dataset

    Dataset.from_dict(columns).save_to_disk(str(path))
    return str(path)


MAKERS = {
    "jsonl": lambda d, docs: write_jsonl(d / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(docs)]),
    "jsonl.gz": lambda d, docs: write_jsonl(d / "in.jsonl.gz", [{"text": t} for t in docs]),
    "parquet": lambda d, docs: write_parquet(d / "in.parquet", {"id": list(range(len(docs))), "text": docs}),
    "hf_disk": lambda d, docs: write_hf(d / "hf", {"text": docs}),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The documents as plain text, built with a vocabulary trained on them."""
    root = tmp_path_factory.mktemp("ref")
    (root / "docs.txt").write_text(bert_text(DOCS), encoding="utf-8")
    result = build(BuildOptions(inputs=[str(root / "docs.txt")], output=str(root / "out"), train_vocab=200, **BUILD))
    return root, result


@pytest.mark.parametrize("kind", MAKERS)
def test_record_input_builds_the_same_shards_as_plain_text(reference, tmp_path, kind):
    root, ref = reference
    src = MAKERS[kind](tmp_path, DOCS)
    result = build(BuildOptions(inputs=[src], output=str(tmp_path / "out"), vocab=str(root / "out" / "vocab.txt"),
                                **BUILD))
    assert len(ref.manifest.shards) >= 3
    assert shard_files(tmp_path / "out") == shard_files(root / "out")
    st = result.manifest.stats
    assert st["documents_in"] == st["documents_written"] == len(DOCS)
    assert st["documents_skipped"] == {"empty": 0, "missing_field": 0, "not_string": 0}
    assert st["crlf_lines"] == 1
    assert result.manifest.build["text_field"] == "text"
    assert result.manifest.build["sentence_split_re"] is not None  # records are always split
    assert result.manifest.sources[0]["path"] == src and len(result.manifest.sources[0]["sha256"]) == 64


def test_vocabulary_trained_on_records_equals_the_plain_text_one(reference, tmp_path):
    root, _ = reference
    src = MAKERS["parquet"](tmp_path, DOCS)
    build(BuildOptions(inputs=[src], output=str(tmp_path / "out"), train_vocab=200, **BUILD))
    assert shard_files(tmp_path / "out") == shard_files(root / "out")


def test_mixed_inputs_are_the_same_for_any_worker_count(reference, tmp_path):
    root, _ = reference
    inputs = [str(root / "docs.txt"), MAKERS["jsonl"](tmp_path, DOCS), MAKERS["parquet"](tmp_path, DOCS[::-1])]
    vocab = str(root / "out" / "vocab.txt")
    one = build(BuildOptions(inputs=inputs, output=str(tmp_path / "w1"), vocab=vocab, **BUILD))
    two = build(BuildOptions(inputs=inputs, output=str(tmp_path / "w2"), vocab=vocab, **{**BUILD, "workers": 2}))
    assert one.manifest.totals["docs"] == 3 * len(DOCS)
    assert (tmp_path / "w1" / "manifest.json").read_bytes() == (tmp_path / "w2" / "manifest.json").read_bytes()
    assert shard_files(tmp_path / "w1") == shard_files(tmp_path / "w2")
    assert one.manifest == two.manifest


def test_skipped_records_are_counted_and_balance(reference, tmp_path):
    root, _ = reference
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(
        b'{"text": "Kept one. Two sentences."}\n'
        b'{"body": "no text field"}\n'
        b"\n"  # a blank line is not a record
        b'{"text": null}\n'
        b'{"text": 5}\n'
        b"[1, 2]\n"  # not an object: no field
        b'{"text": ""}\n'  # an empty document
        b'{"text": "caf\xe9 \\u0000ok."}\r\n'  # invalid UTF-8, an escaped NUL, CRLF after the record
    )
    result = build(BuildOptions(inputs=[str(src)], output=str(tmp_path / "o"), vocab=str(root / "out" / "vocab.txt"),
                                **BUILD))
    st = result.manifest.stats
    assert st["documents_in"] == 7
    assert st["documents_written"] == 2
    assert st["documents_skipped"] == {"empty": 1, "missing_field": 2, "not_string": 2}
    assert st["documents_in"] == st["documents_written"] + sum(st["documents_skipped"].values())
    assert st["input_bytes"] == src.stat().st_size
    assert (st["invalid_utf8_replaced"], st["nul_bytes_removed"]) == (1, 1)
    assert result.manifest.totals["sentences"] == 3


def test_parquet_and_datasets_nulls_and_other_types(tmp_path):
    pq_path = write_parquet(tmp_path / "n.parquet", {"text": ["One. Two.", None, "", "Three."]})
    hf_path = write_hf(tmp_path / "hf", {"text": [None, "Four."]})
    num_path = write_parquet(tmp_path / "num.parquet", {"text": [1, 2]})
    reader = CorpusReader([pq_path, hf_path, num_path])
    items = list(reader)
    assert [x for x in items if isinstance(x, str)] == ["One. Two.", "Three.", "Four."]
    assert sum(isinstance(x, DocEnd) for x in items) == 4  # two written, "" empty, "Four."
    st = reader.stats
    assert (st.documents, st.not_string, st.missing_field, st.files) == (8, 4, 0, 3)


def test_empty_corpus_of_records_names_the_reasons(reference, tmp_path, capsys):
    root, _ = reference
    src = write_jsonl(tmp_path / "none.jsonl", [{"body": "x"}, {"text": None}, {"text": "  "}])
    rc = main(["build", "--input", src, "--output", str(tmp_path / "o"), "--vocab", str(root / "out" / "vocab.txt"),
               "--no-progress"])
    assert rc == 2
    assert capsys.readouterr().err.strip().split("\n") == [
        f"error: empty corpus: no document written from {src} (3 documents in, 1 empty, 1 missing field, 1 not string)"
    ]


def test_text_field_option(reference, tmp_path, capsys):
    root, _ = reference
    src = write_jsonl(tmp_path / "b.jsonl", [{"text": "ignored", "body": d} for d in DOCS])
    rc = main(["build", "--input", src, "--output", str(tmp_path / "o"), "--vocab", str(root / "out" / "vocab.txt"),
               "--text-field", "body", "--shard-tokens", str(SHARD_TOKENS), "--workers", "1", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert shard_files(tmp_path / "o") == shard_files(root / "out")


def test_build_help_states_the_record_convention(capsys):
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for phrase in ("--text-field", ".jsonl", ".parquet", "save_to_disk", "hf:NAME[:CONFIG][@SPLIT]",
                   "one document per record", "always split into sentences", "blank lines in it separate paragraphs"):
        assert phrase in help_text


def test_long_line_in_a_record_is_cut_into_pieces(tmp_path):
    line = "word " * 100
    src = write_jsonl(tmp_path / "long.jsonl", [{"text": "Short. " + line}])
    reader = CorpusReader([src], piece_bytes=128)
    pieces = [x for x in reader if isinstance(x, str)]
    assert all(len(p.encode()) <= 128 for p in pieces) and len(pieces) >= 4
    assert " ".join(pieces).split() == ("Short. " + line).split()
    assert reader.stats.long_lines_cut == 1


def test_resuming_from_any_record_gives_the_same_rest(tmp_path):
    docs = DOCS + ["", "Final words. Really final."]
    paths = [
        write_jsonl(tmp_path / "a.jsonl.gz", [{"text": t} for t in docs] + [{"no": 1}]),
        write_parquet(tmp_path / "b.parquet", {"text": docs[::-1]}, row_group_size=3),
        write_hf(tmp_path / "c", {"text": docs}),
    ]
    (tmp_path / "d.txt").write_text(bert_text(docs[:2]))
    paths.append(str(tmp_path / "d.txt"))
    full = list(CorpusReader(paths))
    final = CorpusReader(paths)
    list(final)
    ends = [i for i, item in enumerate(full) if isinstance(item, DocEnd)]
    assert len(ends) == 3 * len(docs) + 2
    for i in ends:
        end = full[i]
        rest = CorpusReader(paths, start=end.cursor, stats=end.stats)
        got = list(rest)
        assert [x if isinstance(x, str) else x.cursor for x in got] == \
               [x if isinstance(x, str) else x.cursor for x in full[i + 1 :]]
        assert rest.stats == final.stats


def test_interrupted_build_of_records_resumes(reference, tmp_path, monkeypatch):
    root, _ = reference
    src = MAKERS["parquet"](tmp_path, DOCS)
    vocab = str(root / "out" / "vocab.txt")
    real = ShardWriter._write

    def write(self, f, data):
        if "shard_00002.bin" in str(f.name):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f.name))
        real(self, f, data)

    monkeypatch.setattr(ShardWriter, "_write", write)
    with pytest.raises(UserError, match="No space left on device"):
        build(BuildOptions(inputs=[src], output=str(tmp_path / "o"), vocab=vocab, **BUILD))
    monkeypatch.undo()
    result = build(BuildOptions(inputs=[src], output=str(tmp_path / "o"), vocab=vocab, **BUILD))
    assert result.shards_reused == 2
    assert shard_files(tmp_path / "o") == shard_files(root / "out")


# -- bad inputs: one line naming the input --------------------------------------------------------

def _one_line_error(capsys, src, tmp_path, *extra, train_vocab=True):
    capsys.readouterr()  # the fixture's own output (datasets' progress bars)
    rc = main(["build", "--input", src, "--output", str(tmp_path / "o"), *(["--train-vocab", "100"] * train_vocab),
               "--no-progress", "--workers", "1", *extra])
    err = capsys.readouterr().err.strip().split("\n")
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: ")
    return err[0]


def test_invalid_json_line_is_named(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine."}\n\n{"text": "cut off\n{"text": "never read."}\n')
    msg = _one_line_error(capsys, str(src), tmp_path)  # found by the vocabulary's pass, before any write
    assert msg.startswith(f"error: {src}: line 3: not valid JSON (")
    assert not (tmp_path / "o").exists()


def _vocab(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz.!?"]) + "\n")
    return str(path)


@pytest.mark.parametrize("finished_shards", [False, True])
def test_bad_input_found_while_writing_leaves_a_new_folder_as_it_was_unless_shards_finished(
        tmp_path, capsys, monkeypatch, finished_shards):
    """Found by the shard pass (a given vocabulary): with no shard finished the new folder is
    removed, so the mended file's rerun needs no --overwrite; finished shards stay journaled
    (a read error may pass, and the rerun resumes from them)."""
    import bert_ds.data_tools.build as build_module

    if finished_shards:
        monkeypatch.setattr(build_module, "CHUNK_CHARS", 64)  # the bad line read long after the first shards
    src = tmp_path / "bad.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 8) + "{not json\n")
    msg = _one_line_error(capsys, str(src), tmp_path, "--vocab", _vocab(tmp_path), "--shard-tokens",
                          str(SHARD_TOKENS), train_vocab=False)
    assert msg.startswith(f"error: {src}: line 33: not valid JSON (")
    out = tmp_path / "o"
    if finished_shards:
        assert (out / "build.journal.json").is_file() and list(out.glob("shard_*.bin"))
        return
    assert not out.exists()
    src.write_text(src.read_text().replace("{not json", '{"text": "mended."}'))
    assert main(["build", "--input", str(src), "--output", str(out), "--vocab", _vocab(tmp_path), "--no-progress",
                 "--workers", "1"]) == 0


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "x.parquet").write_bytes(b"not parquet at all" * 10) and str(d / "x.parquet"),
     "x.parquet: not a readable Parquet file"),
    (lambda d: write_parquet(d / "y.parquet", {"body": ["a"], "id": [1]}),
     "y.parquet: no column 'text' (columns: body, id); choose the text column with --text-field"),
    (lambda d: write_hf(d / "hf", {"body": ["a"]}), "hf: no column 'text' (columns: body)"),
    (lambda d: (d / "plain").mkdir() or str(d / "plain"), "plain; to read the files in it, give them: "),
    (lambda d: (d / "z.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 500)[:-30]) and str(d / "z.jsonl.gz"),
     "z.jsonl.gz: cannot read"),
], ids=["not-parquet", "parquet-no-column", "hf-no-column", "plain-folder", "truncated-gzip"])
def test_bad_record_input_is_one_line_error_naming_it(tmp_path, capsys, make, message):
    src = make(tmp_path)
    assert message in _one_line_error(capsys, src, tmp_path)


def test_datasetdict_folder_names_its_splits(tmp_path, capsys):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"text": ["a"]}), "test": Dataset.from_dict({"text": ["b"]})}).save_to_disk(
        str(tmp_path / "dd"))
    msg = _one_line_error(capsys, str(tmp_path / "dd"), tmp_path)
    assert msg == f"error: {tmp_path / 'dd'}: a DatasetDict (splits: test, train); give one split's folder, " \
                  f"e.g. {tmp_path / 'dd' / 'test'}"


def test_hub_dataset_offline_is_one_line_error(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    proc = subprocess.run(
        [sys.executable, "-m", "bert_ds.data_tools", "build", "--input", "hf:someone/some-corpus:en@validation",
         "--output", str(tmp_path / "o"), "--train-vocab", "100"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 2
    err = proc.stderr.strip().split("\n")
    assert len(err) == 1
    assert err[0].startswith("error: hf:someone/some-corpus:en@validation: cannot load from the Hugging Face hub (")
    assert not (tmp_path / "o").exists()
