"""Reading raw text: the sentence splitter, the heading rule, R6 (bad bytes, empty
documents, one huge line) and resuming the reader from any document end."""

import gzip
import hashlib
import tracemalloc

import pytest

from bert_ds.base.errors import UserError
from bert_ds.data_tools.text import (
    SENTENCE_SPLIT_RE, CorpusReader, DocEnd, heading_level, iter_text, mark_sentences, split_sentences,
)


def read_docs(paths, **kw):
    """[[line, ...], ...] per document, and the reader (for its stats)."""
    reader = CorpusReader([str(p) for p in paths], **kw)
    docs, cur = [], []
    for item in reader:
        if isinstance(item, DocEnd):
            docs.append(cur)
            cur = []
        else:
            cur.append(item)
    assert cur == []  # every line belongs to a document that ended
    return docs, reader


@pytest.mark.parametrize("line, expected", [
    ("One. Two! Three? four.", ["One.", "Two!", "Three? four."]),
    ("It is 5 @.@ 5 m tall . The end .", ["It is 5 @.@ 5 m tall .", "The end ."]),
    # A quote after the stop counts as an opening quote, even when it closes one.
    ('He said . " Go home . " Then 1990 came .', ["He said .", '" Go home .', '" Then 1990 came .']),
    ("H. americanus is a lobster. e.g. this stays", ["H. americanus is a lobster. e.g. this stays"]),
    ("Émile left. Über alles", ["Émile left.", "Über alles"]),
    ("   ", []),
])
def test_split_sentences(line, expected):
    assert split_sentences(line) == expected


@pytest.mark.parametrize("text", [
    "One. Two! Three? four.", "A.  B!\tC?\u00a0D.\u3000E", "?! ?. .? Z", "...  A!!! B??? C", "x.\nY! \n Z",
    'He said . " Go home . " Then 1990 came .', "End. [SEP]Next. É. ‘q’. “Q”. 'a'. \"b\".", "no cut here. e.g. this",
])
def test_mark_sentences_cuts_where_the_split_regex_does(text):
    assert mark_sentences(text, "[SEP]") == SENTENCE_SPLIT_RE.subn("[SEP]", text)


@pytest.mark.parametrize("line, level", [
    (" = Homarus gammarus = ", 1),
    (" = = Description = = ", 2),
    (" = = = Early life = = = ", 3),
    ("= A = B =", 1),
    ("a = b = c", 0),
    ("==", 0),
    (" = not closed", 0),
])
def test_heading_level(line, level):
    assert heading_level(line) == level


def test_wikitext_titles_split_documents_and_headings_are_dropped(tmp_path):
    p = tmp_path / "wiki.txt"
    p.write_text("\n = A = \n\n text a1 \n\n = = Sec = = \n\n text a2 \n\n = B = \n\n = = Only = = \n\n = C = \n\n text c \n")
    docs, reader = read_docs([p])
    assert docs == [["text a1", "text a2"], [], ["text c"]]
    st = reader.stats
    assert (st.documents, st.headings, st.lines) == (3, 5, 16)


def test_blank_mode_documents(tmp_path):
    p = tmp_path / "bert.txt"
    p.write_text("s1\ns2\n\n\n\ns3\n = = Sec = = \ns4\n\n = = Lone = = \n\nlast")
    docs, reader = read_docs([p])
    assert docs == [["s1", "s2"], ["s3", "s4"], [], ["last"]]
    assert reader.stats.documents == 4


def test_r6_bad_bytes_are_cleaned_and_counted(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(
        b"\xef\xbb\xbfcaf\xe9 ok\r\n"  # BOM, one invalid byte, CRLF
        b"nul\x00 in\x00side\r\n"  # two NULs, CRLF
        b"\r\n"  # blank (CRLF) line: document boundary
        b"\xff\xfe two bad\n"
        b"real \xef\xbf\xbd stays\n"  # a genuine U+FFFD is not counted
        b"\n\n"
        b"\x00\x00\n"  # a line of NULs only is blank after cleaning
        b"\n"
        b"\x01\x02\n"  # control characters: a document the tokenizer finds empty
    )
    docs, reader = read_docs([p])
    assert docs == [["caf\ufffd ok", "nul inside"], ["\ufffd\ufffd two bad", "real \ufffd stays"], ["\x01\x02"]]
    st = reader.stats
    assert st.invalid_utf8 == 3
    assert st.nul_bytes == 4
    assert st.crlf_lines == 3
    assert st.documents == 3
    assert st.bytes == p.stat().st_size
    assert st.lines == 10


def _word_digest(pieces):
    h = hashlib.sha256()
    for piece in pieces:
        h.update((" ".join(piece.split()) + " ").encode())
    return h.hexdigest()


def test_r6_huge_line_is_read_in_bounded_pieces(tmp_path):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa ".split()
    line = " ".join(words[i % len(words)] + str(i % 97) for i in range(1_000_000))  # ~7.6 MB
    p = tmp_path / "huge.txt"
    p.write_text("before\n\n" + line + "\nafter\n")
    size = len(line.encode())
    want = _word_digest([line])
    del line

    docs, reader = read_docs([p])  # default pieces of at most 1 MiB
    assert docs[0] == ["before"] and docs[1][-1] == "after"
    pieces = docs[1][:-1]
    assert len(pieces) in (-(-size // (1 << 20)), -(-size // (1 << 20)) + 1)
    assert all(len(x.encode()) <= 1 << 20 for x in pieces)
    assert _word_digest(pieces) == want  # cut only at whitespace: no word broken or lost
    assert reader.stats.long_lines_cut == 1 and reader.stats.lines == 4
    assert reader.stats.bytes == p.stat().st_size
    del docs, pieces

    piece = 1 << 17
    tracemalloc.start()
    try:
        n_pieces = sum(isinstance(item, str) and len(item) > 10 for item in CorpusReader([str(p)], piece_bytes=piece))
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert n_pieces >= size // piece
    print(f"\nR6: a {size / 1e6:.1f} MB line in {n_pieces} pieces of {piece >> 10} KiB: peak traced memory {peak / 1e6:.2f} MB")
    # The 1 MiB read buffer plus a few pieces in flight; nothing proportional to the line.
    assert peak < (1 << 20) + 8 * piece < size / 3


def test_huge_line_without_whitespace_is_cut_between_characters(tmp_path):
    p = tmp_path / "nospace.txt"
    p.write_text("é" * 700 + "\n")  # 1400 bytes, 2 bytes per character
    docs, reader = read_docs([p], piece_bytes=301)
    assert "".join(docs[0]) == "é" * 700
    assert reader.stats.invalid_utf8 == 0
    assert all(len(x.encode()) <= 301 for x in docs[0])


def test_gzip_input_reads_like_plain(tmp_path):
    text = "\n = T = \n\n one . Two . \n\n = U = \n\n three \n"
    plain, gz = tmp_path / "a.txt", tmp_path / "a.txt.gz"
    plain.write_text(text)
    with gzip.open(gz, "wt") as f:
        f.write(text)
    assert read_docs([plain])[0] == read_docs([gz])[0] == [["one . Two ."], ["three"]]


def test_corrupt_gzip_is_a_user_error(tmp_path):
    p = tmp_path / "bad.txt.gz"
    p.write_bytes(gzip.compress(b"hello\nworld\n" * 1000)[:-40])
    with pytest.raises(UserError, match="bad.txt.gz: cannot read"):
        list(iter_text([str(p)]))


def test_resuming_from_any_document_end_gives_the_same_rest(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt.gz"
    a.write_bytes(b"\n = A = \n\n a1 \n\n = B = \n\xff b1 \r\n\n = C = \n\n = D = \n d\x00 \n")
    with gzip.open(b, "wb") as f:
        f.write(b"x1\nx2\n\n\ny1\n = = S = = \n\nz" + b" long" * 100 + b"\n")
    paths = [str(a), str(b)]
    full = list(CorpusReader(paths, piece_bytes=128))
    final = CorpusReader(paths, piece_bytes=128)
    list(final)
    ends = [i for i, item in enumerate(full) if isinstance(item, DocEnd)]
    assert len(ends) == 7  # A B C D | x y z
    for i in ends:
        end = full[i]
        rest = CorpusReader(paths, start=end.cursor, stats=end.stats, piece_bytes=128)
        got = list(rest)
        assert [x if isinstance(x, str) else x.cursor for x in got] == \
               [x if isinstance(x, str) else x.cursor for x in full[i + 1 :]]
        assert rest.stats == final.stats
