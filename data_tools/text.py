"""Reading raw text: the input convention, cleaning, and the sentence splitter.

Input convention (BERT's): plain UTF-8 text, or gzip when the name ends in ``.gz``;
one sentence per line; a blank line between documents. Documents never span files.
With ``--split-sentences`` a line may hold several sentences; :func:`split_sentences`
cuts it.

Text as most of it comes (documentation, books, web dumps) breaks lines by width, not by
sentence, and keeps one document per file. Two options read it as such:

* ``documents="file"`` (``--documents file``): each file is one document; blank lines
  separate paragraphs, not documents, and titles do not start new documents.
* ``join_wrapped=True`` (``--join-wrapped-lines``): the lines of a paragraph (a run of
  non-blank lines) are joined with a space, and the paragraph is cut into sentences
  by :func:`split_sentences`. A paragraph longer than ``piece_bytes`` is passed on in
  pieces of about that size, so memory stays bounded.

Without them, hard-wrapped prose becomes paragraph-sized documents whose "sentences"
are line fragments: short samples, and a sentence-pair task with little to learn from.

Headings (WikiText): a line matching ``HEADING_RE``, ``^\\s*(=+)\\s.*\\s\\1\\s*$``, is a
heading and is never text. Its level is the number of ``=`` before its title
(`` = Title = `` is 1, `` = = Section = = `` is 2). A level-1 heading (a title) ends
the current document and starts a new one; deeper headings are dropped. A file whose
first non-blank line is a title is read in *heading mode*: only titles separate its
documents, blank lines do not (WikiText puts a blank line between every line).
Otherwise the file is in *blank mode*: blank lines separate documents.

Cleaning, each counted in :class:`ReadStats`:

* invalid UTF-8 is decoded with U+FFFD replacement (``invalid_utf8`` counts the
  replacement characters it introduced);
* NUL bytes are removed (``nul_bytes``);
* ``\\r\\n`` line ends become ``\\n`` (``crlf_lines``); a UTF-8 BOM at the start of a
  file is dropped;
* a line longer than ``piece_bytes`` (default 1 MiB) is read in pieces of at most that
  many bytes, cut after the last space or tab in the piece (else at a UTF-8 character
  boundary), so memory stays bounded whatever the line length (``long_lines_cut``).
  Each piece is a line of its own from then on: without ``--split-sentences`` it is
  one sentence; WordPiece works word by word, so cutting at whitespace changes no
  token. Pieces of a cut line are never headings nor blank-line boundaries.

Record inputs (JSONL, Parquet, ``datasets`` tables; see :mod:`bert_ds.data_tools.sources`) hold
one document per record, in its text field (``--text-field``). A record holds
paragraphs, not one sentence per line, so its lines are always cut into sentences by
:func:`split_sentences` (by the build's workers; the reader yields the lines), with or
without ``--split-sentences``. The text is split at ``\\n``; each line is cleaned like
a file's line (a final ``\\r`` dropped and counted, NULs removed, cut into pieces of at
most ``piece_bytes``); blank lines separate paragraphs, never documents, and no line
is a heading. A record whose field is missing (or that is not a JSON object) is
skipped and counted as ``missing_field``; one whose field is not a string (null, a
number...) as ``not_string``. Both count as documents in. A record's resume position
is in its :class:`Cursor` (``mode`` ``"record"``): the byte offset of the next JSONL
line, or the index of the next row.

Documents are counted when they open (``documents``). A document may end up with no
text (a title with no paragraphs, a run of control characters); the build skips it
with reason ``empty`` so that documents in = written + skipped always holds.

:class:`CorpusReader` yields text lines (``str``, stripped, non-empty) and a
:class:`DocEnd` after each document's last line. Every ``DocEnd`` carries a
:class:`Cursor` from which reading resumes with the next document and a copy of the
counts up to that point, which is what lets an interrupted build resume at a shard
boundary with identical output and counts.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from bert_ds.base.errors import UserError
from bert_ds.data_tools.sources import (
    BLANK, MISSING, input_kind, input_size, open_records, parquet_rows, table_rows,
)

PIECE_BYTES = 1 << 20
DOCUMENT_MODES = ("blank", "file")  # what ends a plain-text document: a blank line (or a title), or the file's end
HEADING_RE = re.compile(r"^\s*(=+)\s.*\s\1\s*$")
# Split after . ! or ? when whitespace follows and then an uppercase letter (ASCII or
# Latin-1), a digit or an opening quote. Deterministic and dumb on purpose: "Mr. Smith"
# splits, "e.g. the" does not, a closing quote after the period blocks the split.
_SPLIT_AFTER = ".!?"
SENTENCE_MARKS = _SPLIT_AFTER  # a sentence ends with one of these characters, or with its line
_SPLIT_BEFORE = r"(?=[A-Z0-9\u00C0-\u00D6\u00D8-\u00DE\"'\u201C\u2018])"
SENTENCE_SPLIT_RE = re.compile(r"(?<=[" + _SPLIT_AFTER + r"])\s+" + _SPLIT_BEFORE)
# The same cuts, one pattern per mark: a pattern that starts with a literal lets the
# regex engine skip ahead to it, ~5x faster than trying the lookbehind at every position.
_SPLIT_AFTER_EACH = [re.compile(re.escape(mark) + r"\s+" + _SPLIT_BEFORE) for mark in _SPLIT_AFTER]
_BOM = b"\xef\xbb\xbf"
_REPLACEMENT = "\ufffd"
_REPLACEMENT_BYTES = _REPLACEMENT.encode()


def split_sentences(line: str) -> list[str]:
    """Sentences of one line by ``SENTENCE_SPLIT_RE``, stripped, empty ones dropped."""
    return [s for s in (p.strip() for p in SENTENCE_SPLIT_RE.split(line)) if s]


def mark_sentences(text: str, marker: str) -> tuple[str, int]:
    """``SENTENCE_SPLIT_RE.subn(marker, text)``, faster: (text with marker at each cut, cuts).

    One pass per mark gives the same cuts as one pass over all three, provided the
    marker holds no mark and no whitespace: a run of whitespace follows exactly one
    character, so the passes replace different runs, and a replaced run leaves no
    whitespace behind for a later pass to match.
    """
    cuts = 0
    for pattern, mark in zip(_SPLIT_AFTER_EACH, _SPLIT_AFTER):
        text, n = pattern.subn(mark + marker, text)
        cuts += n
    return text, cuts


def sentence_cuts(text: str) -> list[int]:
    """Positions of the marks after which :func:`split_sentences` cuts ``text``, in order."""
    return sorted(m.start() for pattern in _SPLIT_AFTER_EACH for m in pattern.finditer(text))


def heading_level(line: str) -> int:
    """0 for a text line, else the heading level (1 = title) per ``HEADING_RE``."""
    s = line.strip()
    if not s or s[0] != "=" or s[-1] != "=" or not HEADING_RE.match(s):
        return 0
    prefix = s[: len(s) - len(s.lstrip("= \t"))]
    return prefix.count("=")


@dataclass
class ReadStats:
    """Counts over everything read so far (all inputs)."""

    files: int = 0  # files finished
    bytes: int = 0  # uncompressed bytes read
    lines: int = 0
    documents: int = 0  # documents opened: the "documents in" of the summary
    headings: int = 0  # heading lines dropped
    invalid_utf8: int = 0  # U+FFFD characters introduced by decoding
    nul_bytes: int = 0
    crlf_lines: int = 0
    long_lines_cut: int = 0
    missing_field: int = 0  # records without the text field: skipped documents
    not_string: int = 0  # records whose text field is not a string: skipped documents

    def to_dict(self) -> dict:
        return asdict(self)

    def snapshot(self) -> ReadStats:
        """A copy, ~5x cheaper than ``copy.copy`` (one per document read)."""
        new = object.__new__(ReadStats)
        new.__dict__.update(self.__dict__)
        return new


@dataclass(frozen=True)
class Cursor:
    """Where to resume reading: input index, position in it, file mode."""

    source: int
    offset: int  # uncompressed byte offset; for Parquet and datasets tables a row index
    mode: str | None  # "heading" | "blank" | None (not yet known: start of file) | "record"

    def to_list(self) -> list:
        return [self.source, self.offset, self.mode]

    @classmethod
    def from_list(cls, v: list) -> Cursor:
        return cls(int(v[0]), int(v[1]), v[2])


@dataclass(frozen=True)
class DocEnd:
    """Marks the end of a document in the reader's output."""

    cursor: Cursor  # resume here to read the next document
    stats: ReadStats  # counts up to and including this document


class _Source:
    """One input file opened for line reading; ``raw_pos`` is the on-disk position."""

    def __init__(self, path: str, offset: int, size: int):
        self.path = path
        # A buffer no larger than the file: allocating 1 MiB costs more than reading a small file.
        self._raw = open(path, "rb", buffering=min(1 << 20, max(size, io.DEFAULT_BUFFER_SIZE)))
        if path.endswith(".gz"):
            self.stream = gzip.GzipFile(fileobj=self._raw, mode="rb")
        else:
            self.stream = self._raw
        if offset:
            self.stream.seek(offset)  # gzip seeks by decompressing forward

    @property
    def raw_pos(self) -> int:
        return self._raw.tell()

    def close(self) -> None:
        if self.stream is not self._raw:
            self.stream.close()
        self._raw.close()


def _pieces(stream: io.BufferedIOBase, piece_bytes: int) -> Iterator[tuple[bytes, bool, bool]]:
    """Yield (data, ends_line, part_of_cut_line); every data is at most piece_bytes."""
    carry = b""
    cut_line = False
    while True:
        want = piece_bytes - len(carry)
        chunk = stream.readline(want)
        at_eof = len(chunk) < want and not chunk.endswith(b"\n")
        data = carry + chunk if carry else chunk
        carry = chunk = b""  # hold no second copy while the piece is out
        if not data:
            return
        if at_eof or data.endswith(b"\n"):  # a whole line, or the last one of the file
            yield data, True, cut_line
            cut_line = False
            continue
        cut = max(data.rfind(b" "), data.rfind(b"\t")) + 1
        if cut == 0:  # no whitespace: cut before a UTF-8 lead byte, never inside a character
            cut = len(data)
            for back in range(1, 4):
                if data[len(data) - back] & 0xC0 != 0x80:
                    if data[len(data) - back] >= 0xC0:
                        cut = len(data) - back
                    break
        yield data[:cut], False, True
        carry = data[cut:]
        cut_line = True


def _clean_piece(data: bytes, at_file_start: bool, ends_line: bool) -> tuple[str, int, int, int]:
    """A piece of a file as the reader takes it: (its stripped text, NUL bytes removed, 1 if
    its line ended in CRLF else 0, U+FFFD characters introduced by decoding)."""
    n_nul = n_crlf = 0
    if at_file_start and data.startswith(_BOM):
        data = data[len(_BOM):]
    if ends_line and data.endswith(b"\n"):
        data = data[:-1]
        if data.endswith(b"\r"):
            data = data[:-1]
            n_crlf = 1
    if b"\x00" in data:
        n_nul = data.count(b"\x00")
        data = data.replace(b"\x00", b"")
    try:
        return data.decode("utf-8").strip(), n_nul, n_crlf, 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text.strip(), n_nul, n_crlf, text.count(_REPLACEMENT) - data.count(_REPLACEMENT_BYTES)


# -- where a part may start inside a file (see bert_ds.data_tools.shares) -----------------

def _file_pieces(path: str, offset: int, piece_bytes: int) -> Iterator[tuple[int, str, bool]]:
    """(start, stripped text, part of a cut line) of a plain file's pieces from ``offset``,
    a line start, exactly as the reader cuts and cleans them."""
    with open(path, "rb") as f:
        f.seek(offset)
        pos = offset
        for data, ends_line, cut_line in _pieces(f, piece_bytes):
            yield pos, _clean_piece(data, pos == 0, ends_line)[0], cut_line
            pos += len(data)


def file_mode(path: str, piece_bytes: int) -> str | None:
    """The file's document mode as the reader decides it from its first non-blank line:
    "heading" when that is a title, else "blank"; None for a file of blank lines only."""
    for _, s, cut_line in _file_pieces(path, 0, piece_bytes):
        if s or cut_line:
            return "heading" if not cut_line and heading_level(s) == 1 else "blank"
    return None


def _line_start(path: str, offset: int) -> int:
    """The first line start at or after ``offset`` (the file's size if none)."""
    if offset == 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        pos = offset - 1
        while block := f.read(1 << 20):
            at = block.find(b"\n")
            if at >= 0:
                return pos + at + 1
            pos += len(block)
    return pos


def document_start(path: str, offset: int, mode: str | None, piece_bytes: int) -> int:
    """The first position at or after ``offset`` where the reader starts a document afresh,
    by its own rules (the file's size if none): in heading mode the start of the next title
    line; in blank mode just after the first blank line from the next line start on."""
    pos = _line_start(path, offset)
    if mode not in ("heading", "blank"):
        return pos  # a file of blank lines: no document anywhere
    for start, s, cut_line in _file_pieces(path, pos, piece_bytes):
        if cut_line:
            continue
        if mode == "heading" and heading_level(s) == 1:
            return start
        if mode == "blank" and not s:
            return _line_start(path, start + 1)
    return os.path.getsize(path)


def position_bytes(path: str, offset: int, size: int) -> int:
    """On-disk bytes before a cursor offset: the offset itself, or a row's share of a table's bytes."""
    kind = input_kind(path)
    if kind == "parquet":
        return size * offset // max(parquet_rows(path), 1)
    if kind in ("hf_disk", "hf_hub"):
        return size * offset // max(table_rows(path), 1)
    return offset


class CorpusReader:
    """Reads inputs in order as a stream of text lines and :class:`DocEnd` markers.

    ``start`` and ``stats`` resume from a :class:`DocEnd` taken earlier; ``progress``
    is the number of on-disk input bytes consumed (compressed bytes for ``.gz``).
    ``text_field`` names the field that holds a record input's text.
    """

    def __init__(self, paths: list[str], *, start: Cursor | None = None,
                 stats: ReadStats | None = None, piece_bytes: int = PIECE_BYTES,
                 text_field: str = "text", documents: str = "blank", join_wrapped: bool = False,
                 stop: Cursor | None = None, origin: int = 0):
        if piece_bytes < 64:
            raise ValueError("piece_bytes must be at least 64")
        if documents not in DOCUMENT_MODES:
            raise ValueError(f"documents must be one of {', '.join(DOCUMENT_MODES)}, got {documents!r}")
        self.documents = documents
        self.join_wrapped = join_wrapped
        self.paths = list(paths)
        self.start = start or Cursor(0, 0, None)
        self.stop = stop or Cursor(len(self.paths), 0, None)
        self.origin = origin  # progress and total_bytes count from here (a part's first byte)
        self.stats = stats.snapshot() if stats is not None else ReadStats()
        self.piece_bytes = piece_bytes
        self.text_field = text_field
        self._kinds = [input_kind(p) for p in self.paths]
        self._sizes = [input_size(p) for p in self.paths]
        self._done_bytes = sum(self._sizes[: self.start.source])
        self._source = None  # the open input: a _Source, or a sources record reader
        self._index: int | None = None

    @property
    def yields_paragraphs(self) -> bool:
        """Whether the line last yielded holds a paragraph (a record's line, or joined wrapped
        lines) rather than one sentence: the build cuts those into sentences."""
        return self._index is not None and (self._kinds[self._index] != "text" or self.join_wrapped)

    @property
    def total_bytes(self) -> int:
        """On-disk bytes up to ``stop`` (a row position counted in proportion), from ``origin``."""
        end = sum(self._sizes[: self.stop.source])
        if self.stop.offset:
            end += position_bytes(self.paths[self.stop.source], self.stop.offset, self._sizes[self.stop.source])
        return end - self.origin

    @property
    def progress(self) -> int:
        here = self._source.raw_pos if self._source is not None else 0
        return self._done_bytes + here - self.origin

    def __iter__(self) -> Iterator[str | DocEnd]:
        last = min(self.stop.source + (1 if self.stop.offset else 0), len(self.paths))
        for index in range(self.start.source, last):
            first = index == self.start.source
            offset = self.start.offset if first else 0
            mode = self.start.mode if first else None
            stop_at = self.stop.offset if index == self.stop.source else float("inf")
            self._index = index
            try:
                if self._kinds[index] == "text":
                    yield from self._read_file(index, offset, mode, stop_at)
                else:
                    yield from self._read_records(index, offset, stop_at)
            except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
                raise UserError(f"{self.paths[index]}: cannot read: {e}") from None
            finally:
                if self._source is not None:
                    self._source.close()
                    self._source = None
            self._done_bytes += self._sizes[index]

    def _read_file(self, index: int, offset: int, mode: str | None, stop_at: float) -> Iterator[str | DocEnd]:
        st = self.stats
        src = self._source = _Source(self.paths[index], offset, self._sizes[index])
        pos = offset
        doc_open = False
        if self.documents == "file":
            mode = "file"
        paragraph = _Paragraph(self.piece_bytes) if self.join_wrapped else None
        for data, ends_line, cut_line in _pieces(src.stream, self.piece_bytes):
            line_start, pos = pos, pos + len(data)
            if line_start >= stop_at:  # the next part's first document starts here
                if paragraph is not None:
                    yield from paragraph.flush()
                if doc_open:
                    yield DocEnd(Cursor(index, line_start, mode), st.snapshot())
                return
            # Counts for this line are added after any DocEnd that precedes the line, so
            # a DocEnd's copy never includes a line that resuming from it reads again.
            n_bytes = len(data)
            s, n_nul, n_crlf, n_bad = _clean_piece(data, line_start == 0, ends_line)
            data = b""  # only s is needed from here: one copy of the piece, not two
            level = heading_level(s) if not cut_line else 0
            if level and paragraph is not None:
                yield from paragraph.flush()
            if level == 1 and doc_open and mode != "file":
                doc_open = False
                yield DocEnd(Cursor(index, line_start, mode), st.snapshot())
            st.bytes += n_bytes
            st.nul_bytes += n_nul
            st.crlf_lines += n_crlf
            st.invalid_utf8 += n_bad
            if ends_line:
                st.lines += 1
                if cut_line:
                    st.long_lines_cut += 1
            if not s and not cut_line:  # a blank line
                if paragraph is not None:
                    yield from paragraph.flush()
                if mode == "blank" and doc_open:
                    doc_open = False
                    yield DocEnd(Cursor(index, pos, mode), st.snapshot())
                continue
            if mode is None:
                mode = "heading" if level == 1 else "blank"
            if not doc_open and s:
                doc_open = True
                st.documents += 1
            if level:
                st.headings += 1
            elif s and paragraph is not None:
                yield from paragraph.add(s)
            elif s:
                yield s
        if paragraph is not None:
            yield from paragraph.flush()
        st.files += 1
        if doc_open:
            yield DocEnd(Cursor(index + 1, 0, None), st.snapshot())

    def _read_records(self, index: int, start: int, stop_at: float) -> Iterator[str | DocEnd]:
        st = self.stats
        src = self._source = open_records(self.paths[index], self.text_field, start)
        pos = start
        for next_pos, n_bytes, n_bad, value in src:
            if pos >= stop_at:  # this record is the next part's first
                return
            pos = next_pos
            st.bytes += n_bytes
            st.invalid_utf8 += n_bad
            if value is BLANK:
                continue
            st.documents += 1
            if value is MISSING:
                st.missing_field += 1
            elif not isinstance(value, str):
                st.not_string += 1
            else:
                yield from self._record_lines(value)
                yield DocEnd(Cursor(index, pos, "record"), st.snapshot())
        st.files += 1

    def _record_lines(self, text: str) -> Iterator[str]:
        """The non-blank lines of a record's text, cleaned as a file's lines are."""
        st = self.stats
        lines = text.split("\n")
        if lines[-1] == "":  # a final newline ends the last line, it opens none
            lines.pop()
        st.lines += len(lines)
        for line in lines:
            if line.endswith("\r"):
                line = line[:-1]
                st.crlf_lines += 1
            if "\x00" in line:
                st.nul_bytes += line.count("\x00")
                line = line.replace("\x00", "")
            s = line.strip()
            if not s:
                continue
            # 4 bytes per character at most: only a line that may be long is encoded.
            if len(s) * 4 > self.piece_bytes and len(data := s.encode()) > self.piece_bytes:
                st.long_lines_cut += 1
                for piece, _, _ in _pieces(io.BytesIO(data), self.piece_bytes):
                    if p := piece.decode().strip():
                        yield p
            else:
                yield s


class _Paragraph:
    """The lines of one hard-wrapped paragraph, joined; passed on whole, or in pieces of
    about ``limit`` characters when it grows past that (memory stays bounded)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.lines: list[str] = []
        self.size = 0

    def add(self, line: str) -> Iterator[str]:
        self.lines.append(line)
        self.size += len(line) + 1
        if self.size >= self.limit:
            yield from self.flush()

    def flush(self) -> Iterator[str]:
        if self.lines:
            yield " ".join(self.lines)
            self.lines, self.size = [], 0


def iter_text(paths: list[str], piece_bytes: int = PIECE_BYTES, text_field: str = "text", **layout) -> Iterator[str]:
    """Only the text lines of the inputs (for vocabulary training); ``layout``: ``documents``
    and ``join_wrapped`` as :class:`CorpusReader` takes them."""
    for item in CorpusReader(paths, piece_bytes=piece_bytes, text_field=text_field, **layout):
        if isinstance(item, str):
            yield item
