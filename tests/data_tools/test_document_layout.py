"""Plain text as it usually comes: hard-wrapped paragraphs (--join-wrapped-lines) and one
document per file (--documents file), beside BERT's one-sentence-per-line convention; and
inspect's warning when documents are too short for the sequence length."""

import json
from pathlib import Path

import pytest

from bert_ds.data_tools.__main__ import main
from bert_ds.data_tools.build import BuildOptions, build
from bert_ds.data_tools.manifest import open_dataset
from bert_ds.data_tools.text import CorpusReader, DocEnd, split_sentences

SAMPLE = Path(__file__).resolve().parents[2] / "data_tools" / "sample" / "valid.txt"

PARAGRAPHS = [
    ["The loader builds samples at load time.", "Each sample is a pure function of the seed."],
    ["Masks change every epoch. Whole words may", "be masked together, and pairs come from",
     "one document. Nothing is cached but the", "sample map."],
    ["Checkpoints are folders committed last."],
]


def wrapped_file(path: Path, paragraphs: list[list[str]]) -> Path:
    """Paragraphs of width-broken lines, a blank line between paragraphs."""
    path.write_text("\n\n".join("\n".join(lines) for lines in paragraphs) + "\n")
    return path


def items(paths, **layout):
    return list(CorpusReader([str(p) for p in paths], **layout))


def documents(paths, **layout) -> list[list[str]]:
    docs, current = [], []
    for item in items(paths, **layout):
        if isinstance(item, DocEnd):
            docs.append(current)
            current = []
        else:
            current.append(item)
    return docs


def test_bert_convention_reads_each_paragraph_as_a_document_of_line_fragments(tmp_path):
    docs = documents([wrapped_file(tmp_path / "a.txt", PARAGRAPHS)])
    assert docs == PARAGRAPHS  # three documents whose "sentences" are the width-broken lines


def test_join_wrapped_lines_and_one_document_per_file(tmp_path):
    a = wrapped_file(tmp_path / "a.txt", PARAGRAPHS)
    b = wrapped_file(tmp_path / "b.txt", PARAGRAPHS[:1])
    docs = documents([a, b], documents="file", join_wrapped=True)
    assert docs == [[" ".join(p) for p in PARAGRAPHS], [" ".join(PARAGRAPHS[0])]]
    # Each joined paragraph is what the build cuts into sentences: whole sentences again.
    assert split_sentences(docs[0][1]) == ["Masks change every epoch.",
                                           "Whole words may be masked together, and pairs come from one document.",
                                           "Nothing is cached but the sample map."]


def test_one_document_per_file_keeps_titles_and_blank_lines_inside(tmp_path):
    text = tmp_path / "wiki.txt"
    text.write_text(" = First = \n\nOne line.\n\n = Second = \n\nAnother line.\n")
    assert documents([text]) == [["One line."], ["Another line."]]
    assert documents([text], documents="file") == [["One line.", "Another line."]]


def test_a_paragraph_longer_than_a_piece_is_passed_on_in_pieces(tmp_path):
    line = "word " * 20
    path = wrapped_file(tmp_path / "long.txt", [[line.strip()] * 50])
    lines = [i for i in items([path], join_wrapped=True, piece_bytes=256) if isinstance(i, str)]
    assert len(lines) > 1 and all(len(x) < 256 + len(line) for x in lines)
    assert " ".join(lines).split() == (line * 50).split()


def test_resuming_from_a_document_end_reads_the_rest_unchanged(tmp_path):
    paths = [wrapped_file(tmp_path / f"{n}.txt", PARAGRAPHS) for n in "abc"]
    layout = dict(documents="file", join_wrapped=True)
    whole = items(paths, **layout)
    first_end = next(i for i in whole if isinstance(i, DocEnd))
    rest = list(CorpusReader([str(p) for p in paths], start=first_end.cursor, stats=first_end.stats, **layout))
    assert rest == whole[whole.index(first_end) + 1:]


def test_build_with_the_layout_options_and_inspect_warns_about_short_documents(tmp_path, capsys):
    files = [wrapped_file(tmp_path / f"doc{n}.txt", PARAGRAPHS * 3) for n in range(4)]
    vocab = tmp_path / "vocab"
    build(BuildOptions(inputs=[str(SAMPLE)], output=str(vocab), train_vocab=1024, progress=False, workers=1))
    common = ["build", "--input", *map(str, files), "--vocab", str(vocab / "vocab.txt"), "--workers", "1",
              "--no-progress"]
    assert main([*common, "--output", str(tmp_path / "lines")]) == 0
    assert main([*common, "--output", str(tmp_path / "docs"), "--documents", "file", "--join-wrapped-lines"]) == 0
    capsys.readouterr()

    as_lines, _ = open_dataset(tmp_path / "lines")
    as_docs, _ = open_dataset(tmp_path / "docs")
    assert as_lines.totals["docs"] == 4 * 9 and as_docs.totals["docs"] == 4
    assert as_docs.totals["sentences"] == 4 * 3 * 6  # 6 whole sentences per copy of PARAGRAPHS (2 + 3 + 1)
    assert as_docs.build["documents"] == "file" and as_docs.build["join_wrapped"] is True

    assert main(["inspect", str(tmp_path / "lines")]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: documents average ") and "--join-wrapped-lines" in err
    assert main(["inspect", str(tmp_path / "docs"), "--seq-len", "64"]) == 0
    assert capsys.readouterr().err == ""


def test_an_unknown_document_mode_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["build", "--input", str(SAMPLE), "--output", str(tmp_path / "o"), "--train-vocab", "100",
              "--documents", "page"])


def test_short_records_are_warned_about_without_the_plain_text_options(tmp_path, capsys):
    records = tmp_path / "short.jsonl"
    records.write_text("".join(json.dumps({"text": f"A short record number {i}. It has two sentences."}) + "\n"
                               for i in range(200)))
    vocab = tmp_path / "vocab"
    build(BuildOptions(inputs=[str(SAMPLE)], output=str(vocab), train_vocab=1024, progress=False, workers=1))
    assert main(["build", "--input", str(records), "--output", str(tmp_path / "data"), "--vocab",
                 str(vocab / "vocab.txt"), "--workers", "1", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "data")]) == 0
    err = capsys.readouterr().err
    # a record is a document already: the text-layout options would change nothing
    assert err.startswith("warning: documents average ") and "--join-wrapped-lines" not in err
