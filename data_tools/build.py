"""Raw text -> tokenizer files + token shards + manifest.json (written last).

Pipeline: the main process reads the inputs (:class:`bert_ds.data_tools.text.CorpusReader`:
text files, JSONL, Parquet, ``datasets`` tables) and cuts the stream of lines into
chunks of about ``CHUNK_CHARS`` characters; worker processes tokenize a chunk with
one ``encode_batch`` call (one input per line), cut sentences (the lines of record
inputs always, other lines with ``--split-sentences``) at the ids of their final marks,
see ``_Tokenize``, and return flat numpy arrays (the
workers start while the main process installs the tokenizer); the main process writes
the results, in input order, into ``shard_00000``, ``shard_00001``, ... A shard
is closed at the first document end after it holds ``shard_tokens`` tokens, so
documents never span shards.

Design choices:

* Determinism: chunks are cut by the main process from the input alone and results
  are written in chunk order, so ``--workers`` changes speed, never bytes. The
  manifest holds no timestamps and not the worker count. Vocabulary training is made
  deterministic in :mod:`bert_ds.data_tools.tokenizer`.
* The tokenizer is the bottleneck; everything else is numpy on whole chunks (no
  Python loop per token). A document may span chunks (a 100 MB line arrives as 1 MiB
  pieces), and the shard writer takes it sentence batch by sentence batch, so memory
  is bounded by the chunks in flight (2 per worker), not by the largest document.
* Crash safety and resume (R9): each shard is written under temporary names and
  renamed into place; after each shard ``build.journal.json`` records (atomically) its
  ShardInfo, the reader cursor after its last document and the counts so far, keyed by
  a hash of the sources, the tokenizer and every option that shapes the output. A
  rerun with the same key keeps each recorded shard whose files open, verify and match
  the record, and resumes reading at the cursor after the last kept one; output is
  byte-identical to an uninterrupted build. ``manifest.json`` is removed when a build
  starts and written last; the journal is removed after it.
* A build never replaces data it was not asked to (R12). The same key, recorded in the
  manifest, tells a finished build of the same inputs and options (nothing to do) from
  anything else. Into a folder holding a finished dataset of other inputs or options,
  an interrupted build of other ones, or files that are no dataset, a build refuses
  with one line unless ``overwrite`` is set, and decides that before its first write
  (and, where the folder's own record allows, before training a vocabulary). The
  journal is written before anything else, so a folder a build was killed in is
  always recognised as that build's.
* Partitioned builds (``part`` of N > 1): the same build of one share of the inputs
  (:mod:`bert_ds.data_tools.shares`) into ``DIR/part-0000I-of-0000N``
  (:mod:`bert_ds.data_tools.partition`), with every rule above applying to that folder; the
  parent's own rules and the one vocabulary all parts share are :mod:`bert_ds.data_tools.parent`'s.
  A part's manifest records ``build["partition"]`` and lists as sources only what it read;
  its plan key covers its share. An empty share is a dataset of no shards, not an error.
* The tokenizer: a WordPiece vocabulary trained or loaded (:mod:`bert_ds.data_tools.tokenizer`),
  whose sentences are encoded one by one as BERT's are, or any fast tokenizer given with
  ``--tokenizer`` (:mod:`bert_ds.data_tools.fast_tokenizer`), whose lines are encoded with their
  whitespace (``_Tokenize._as_text``): a byte-level BPE's tokens carry it.
* Errors: bad input raises :class:`UserError` (one line, exit 2); a failing write
  (disk full) becomes a UserError naming the folder, after the shard writer has
  removed its temporary files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import UserError
from bert_ds.base.locking import LOCK_NAME, FolderLock
from bert_ds.data_tools.fast_tokenizer import FastTokenizer, load_fast_tokenizer
from bert_ds.data_tools.manifest import MANIFEST_NAME, Manifest, created_by
from bert_ds.data_tools.parent import (
    TOKENIZER_DIR, ParentLock, check_parent, has_tokenizer, remove, shared_tokenizer,
)
from bert_ds.data_tools.partition import Part
from bert_ds.data_tools.shares import Share, share_of, share_sources
from bert_ds.data_tools.shard_format import (
    FORMAT_VERSION, MAX_SENTENCE_TOKENS, ShardError, ShardInfo, ShardReader, ShardWriter, token_dtype,
)
from bert_ds.data_tools.sources import RECORD_KINDS, check_inputs, input_kind, input_size, source_info
from bert_ds.data_tools.text import (
    DOCUMENT_MODES, HEADING_RE, PIECE_BYTES, SENTENCE_MARKS, SENTENCE_SPLIT_RE, CorpusReader, Cursor, DocEnd, ReadStats, mark_sentences,
    sentence_cuts, split_sentences,
)
from bert_ds.data_tools.tokenizer import (
    HF_FILES, Normalization, TokenizerSpec, holds_cased_tokens, install_tokenizer, load_vocabulary, train_vocab,
    vocab_fingerprint,
)

DEFAULT_SHARD_TOKENS = 1 << 26  # ~64M tokens: 128 MiB of uint16 per shard
CHUNK_CHARS = 1 << 18  # characters per tokenization task: ~60k tokens, ~10 MB of Encodings
_MAX_PARTS = 4096  # documents per chunk, bounds chunks of many empty documents
JOURNAL_NAME = "build.journal.json"
# The tokenizer a build encodes with: a WordPiece vocabulary and its normalizer, or a --tokenizer's
Vocabulary = tuple[bytes, Normalization] | FastTokenizer


class EmptyCorpus(UserError):
    """The inputs held no document to write (every one empty, or without its text field)."""


class WorkerDied(UserError):
    """A tokenizer process ended without its result (killed, out of memory)."""


_SHARD_FILE = re.compile(r"^shard_(\d{5,})\.(bin|idx)(\.tmp)?$")


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


@dataclass
class BuildOptions:
    inputs: list[str]
    output: str
    vocab: str | None = None  # vocab.txt or tokenizer.json to load
    train_vocab: int | None = None  # or: train a WordPiece vocabulary of this size
    tokenizer: str | None = None  # or: any HF fast tokenizer, kept as it is (fast_tokenizer.py)
    special_tokens: dict[str, str] = field(default_factory=dict)  # --tokenizer: kind -> token its config does not name
    workers: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    split_sentences: bool = False
    lowercase: bool | None = None  # None: as the given tokenizer has it (see tokenizer.py); True when training
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    piece_bytes: int = PIECE_BYTES  # longest line read in one piece (shapes output)
    progress: bool = True  # tqdm bars on stderr
    text_field: str = "text"  # the field of JSONL / Parquet / datasets records that holds the text
    documents: str = "blank"  # plain text: a blank line ends a document ("blank"), or the file's end ("file")
    join_wrapped: bool = False  # plain text: join a paragraph's lines, then cut it into sentences
    overwrite: bool = False  # replace whatever DIR holds (a dataset of other inputs, other files' neighbours)
    part: Part = field(default_factory=Part)  # build this part of the inputs into DIR/part-I-of-N (partition.py)

    def __post_init__(self):
        if [self.vocab, self.train_vocab, self.tokenizer].count(None) != 2:
            raise UserError("give exactly one of --vocab FILE, --train-vocab SIZE or --tokenizer PATH")
        if self.tokenizer is None and self.special_tokens:
            raise UserError("--special-token names a special token of a --tokenizer; a WordPiece vocabulary "
                            "has its own ([PAD], [UNK], [CLS], [SEP], [MASK])")
        if self.tokenizer is not None and self.lowercase is not None:
            flag = "--lowercase" if self.lowercase else "--no-lowercase"
            raise UserError(f"{flag}: a --tokenizer is kept as it is, its normalizer included: drop {flag}")
        if self.workers < 1:
            raise UserError(f"--workers must be at least 1, got {self.workers}")
        if self.shard_tokens < 1:
            raise UserError(f"--shard-tokens must be at least 1, got {self.shard_tokens}")
        if self.piece_bytes < 64:
            raise UserError(f"piece_bytes must be at least 64, got {self.piece_bytes}")
        if self.documents not in DOCUMENT_MODES:
            raise UserError(f"--documents must be one of {', '.join(DOCUMENT_MODES)}, got {self.documents!r}")
        check_inputs(self.inputs, self.text_field)
        if self.vocab is not None and not os.path.exists(self.vocab):
            raise UserError(f"vocabulary not found: {self.vocab}")
        if self.tokenizer is not None and not os.path.exists(self.tokenizer):
            raise UserError(f"tokenizer not found: {self.tokenizer}")
        if os.path.exists(self.output) and not os.path.isdir(self.output):
            raise UserError(f"--output {self.output} exists and is not a folder")

    @property
    def has_records(self) -> bool:
        """Whether an input holds records (JSONL, Parquet, a datasets table)."""
        return any(input_kind(p) in RECORD_KINDS for p in self.inputs)

    def reader(self, share: Share | None = None, **resume) -> CorpusReader:
        """A reader of the inputs (or of ``share`` of them), from its start or from ``start=``, ``stats=``."""
        if share is not None:
            resume = {"start": share.start, "stop": share.stop, "origin": share.first_byte, **resume}
        return CorpusReader(self.inputs, piece_bytes=self.piece_bytes, text_field=self.text_field,
                            documents=self.documents, join_wrapped=self.join_wrapped, **resume)


@dataclass
class Counts:
    """Counts of the tokenizing side; with ReadStats they make the summary."""

    documents_written: int = 0
    skipped_empty: int = 0  # documents with no token at all
    sentences: int = 0  # sentences written (a piece of a >65535-token sentence counts)
    tokens: int = 0
    empty_sentences: int = 0  # sentences with no token (only control characters...), dropped
    long_sentences_split: int = 0  # sentences over 65535 tokens, written in pieces


@dataclass
class BuildResult:
    directory: Path
    manifest: Manifest
    seconds: float
    vocab_seconds: float
    shards_reused: int
    already_built: bool = False  # DIR held this very build, finished: nothing was written
    label: str = ""  # "part I/N" of a partitioned build: each summary line starts with it

    @property
    def bytes_on_disk(self) -> int:
        return sum(s.bin_bytes + s.idx_bytes for s in self.manifest.shards)

    def summary(self) -> str:
        text = self._summary()
        return "\n".join(f"{self.label}: {line}" for line in text.split("\n")) if self.label else text

    def _summary(self) -> str:
        if self.already_built:
            return (f"{self.directory} is already built from these inputs and options "
                    f"({len(self.manifest.shards)} shard(s), {self.manifest.totals['tokens']:,} tokens); nothing to do")
        m, st = self.manifest, self.manifest.stats
        tokens = m.totals["tokens"]
        skipped = st["documents_skipped"]
        secs = max(self.seconds, 1e-9)
        return "\n".join([
            f"built {self.directory}: {len(m.shards)} shard(s) ({self.shards_reused} reused), "
            f"vocab {m.vocab_size} ({m.token_dtype}), manifest.json written last",
            f"documents: {st['documents_in']:,} in, {st['documents_written']:,} written, "
            f"{sum(skipped.values()):,} skipped ({', '.join(f'{k}: {v:,}' for k, v in skipped.items())})",
            f"sentences: {m.totals['sentences']:,} ({st['empty_sentences_dropped']:,} empty dropped, "
            f"{st['long_sentences_split']:,} over 65535 tokens split); tokens: {tokens:,}",
            f"input: {st['input_bytes']:,} bytes in {len(m.sources)} file(s), {st['lines']:,} lines, "
            f"{st['headings_dropped']:,} headings dropped; invalid UTF-8 replaced: {st['invalid_utf8_replaced']:,}, "
            f"NUL bytes removed: {st['nul_bytes_removed']:,}, CRLF lines: {st['crlf_lines']:,}, "
            f"long lines cut: {st['long_lines_cut']:,}",
            f"disk: {self.bytes_on_disk:,} bytes in shards ({self.bytes_on_disk / max(tokens, 1):.3f} bytes/token)",
            f"time: {self.seconds:.2f} s (vocabulary {self.vocab_seconds:.2f} s), "
            f"{st['input_bytes'] / secs / 1e6:.2f} MB/s, {tokens / secs:,.0f} tokens/s",
        ])


# -- tokenization (runs in worker processes, or in-process for --workers 1) --------------

# The fallback when sentence ends cannot be found at mark ids (see _Tokenize._by_marks):
# the tokenizer cuts its input at special tokens before normalizing, so sentences joined
# by one come out as if encoded one by one, each followed by the marker's id.
_MARKER = "[SEP]"
_INPUT_CHARS = 4096  # characters per joined input: a measured optimum (longer is slower)


def _groups(lines: list[str], size: int) -> Iterator[list[str]]:
    """Consecutive lines in groups of about ``size`` characters (at least one line each)."""
    group: list[str] = []
    chars = 0
    for line in lines:
        group.append(line)
        chars += len(line)
        if chars >= size:
            yield group
            group, chars = [], 0
    if group:
        yield group


def _is_any(a: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``np.isin(a, values)`` for a few values: one comparison each, no sort."""
    hit = a == values[0]
    for v in values[1:]:
        hit |= a == v
    return hit


def _per_part(tokens: np.ndarray, lengths: np.ndarray, owner: np.ndarray, n_parts: int):
    """The worker's result: tokens, non-empty lengths, per part sentences kept and dropped empty."""
    keep = lengths > 0
    kept = np.bincount(owner[keep], minlength=n_parts)
    empty = np.bincount(owner[~keep], minlength=n_parts)
    return tokens, lengths[keep], kept, empty


class _Tokenize:
    """Lines of a chunk's parts -> flat arrays for the writer.

    ``split[j]`` says whether the lines of part j are cut into sentences. Returns
    tokens (n_tokens,) uint32, lengths (n_sentences,) int64 of the non-empty
    sentences, and per part (n_parts,) int64: sentences kept, sentences dropped empty.
    Lines are stripped and non-empty, as :class:`CorpusReader` yields them.

    ``text`` (a ``--tokenizer``'s, whose tokens carry whitespace, unlike WordPiece's): the
    whitespace between lines and sentences is kept in the tokens (:meth:`_as_text`).
    """

    def __init__(self, tokenizer_json: str, text: bool = False):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tokenizer_json)
        self.text = text
        if text:  # both act on whole inputs, and an input is a line here, not a model's sequence
            tok.no_truncation()
            tok.no_padding()
        # encode_batch_fast (tokenizers >= 0.20) skips offset tracking, ~20% faster.
        self.encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        self.marker_id = tok.token_to_id(_MARKER)
        # Joining is exact only where the marker is cut out as one special token and
        # nothing (truncation, padding) acts on a whole input.
        self.can_join = (self.marker_id is not None and tok.truncation is None and tok.padding is None
                         and self.encode([_MARKER], add_special_tokens=False)[0].ids == [self.marker_id])
        # Each sentence mark is a word of its own to BERT's pre-tokenizer, so where every
        # mark is a token of the vocabulary, a line's k-th mark character is its k-th mark id.
        mark_ids = [tok.token_to_id(m) for m in SENTENCE_MARKS]
        self.mark_ids = np.array(mark_ids if None not in mark_ids else [], dtype=np.uint32)
        self.mark_chars = np.array([ord(m) for m in SENTENCE_MARKS], dtype=np.uint32)
        self.can_mark = (self.mark_ids.size == len(SENTENCE_MARKS) and tok.truncation is None
                         and tok.padding is None and type(tok.pre_tokenizer).__name__ == "BertPreTokenizer"
                         and self.encode([SENTENCE_MARKS], add_special_tokens=False)[0].ids == mark_ids)

    def __call__(self, parts: list[list[str]],
                 split: list[bool]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self.text:
            return self._as_text(parts, split)
        result = self._by_marks(parts, split) if self.can_mark else None
        if result is None and self.can_join:
            result = self._joined(parts, split)
        return result if result is not None else self._one_by_one(parts, split)

    def _flat_ids(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of all texts back to back (uint32), and the number per text."""
        encs = self.encode(texts, add_special_tokens=False)
        counts = np.fromiter(map(len, encs), dtype=np.int64, count=len(encs))
        ids = np.fromiter(chain.from_iterable(e.ids for e in encs), dtype=np.uint32, count=int(counts.sum()))
        return ids, counts

    def _one_by_one(self, parts: list[list[str]], split: list[bool]):
        """One tokenizer input per sentence."""
        sentences: list[str] = []
        per_part = []
        for lines, cut in zip(parts, split, strict=True):
            n = len(sentences)
            if cut:
                for line in lines:
                    sentences += split_sentences(line)
            else:
                sentences += lines
            per_part.append(len(sentences) - n)
        tokens, lengths = self._flat_ids(sentences)
        return _per_part(tokens, lengths, np.repeat(np.arange(len(parts)), per_part), len(parts))

    def _as_text(self, parts: list[list[str]], split: list[bool]):
        """One tokenizer input per line, ending in its newline; a line cut into sentences gives
        one input per sentence, each after the first starting with the space before it.

        A byte-level BPE (GPT-2's pre-tokenizer, ModernBERT's) cuts text before a space that
        precedes a word and around a newline, so these inputs encode to the same tokens as the
        document's text whole, and a document decodes to its lines, each ending in a newline
        (the reader's lines are stripped: blank lines and indentation are not kept)."""
        texts: list[str] = []
        per_part = []
        for lines, cut in zip(parts, split, strict=True):
            n = len(texts)
            for line in lines:
                pieces = split_sentences(line) if cut else [line]
                texts += [pieces[0], *(" " + p for p in pieces[1:])]
                texts[-1] += "\n"
            per_part.append(len(texts) - n)
        tokens, lengths = self._flat_ids(texts)
        return _per_part(tokens, lengths, np.repeat(np.arange(len(parts)), per_part), len(parts))

    def _by_marks(self, parts: list[list[str]], split: list[bool]):
        """One tokenizer input per line, cut into sentences after the mark ids at the cuts;
        None when a line's mark ids do not pair one to one with its mark characters.

        Cheapest for the tokenizer (~15% less than any input cut at sentences: its cost
        grows with the pieces it is given, not only with the characters)."""
        lines = list(chain.from_iterable(parts))
        per_line = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        line_part = np.repeat(np.arange(len(parts)), per_line)
        ids, counts = self._flat_ids(lines)
        line_end = np.cumsum(counts)  # token index after each line
        # The chunk as one string, lines apart by NUL (never in a line: the reader drops it,
        # and no whitespace run crosses it, so no cut does): character positions index it.
        text = "\0".join(lines)
        chars = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        mark_at = np.flatnonzero(_is_any(chars, self.mark_chars))
        line_start = np.zeros(len(lines), dtype=np.int64)
        np.cumsum(np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))[:-1] + 1, out=line_start[1:])
        mark_tok = np.flatnonzero(_is_any(ids, self.mark_ids))
        chars_per_line = np.bincount(np.searchsorted(line_start, mark_at, side="right") - 1, minlength=len(lines))
        ids_per_line = np.bincount(np.searchsorted(line_end, mark_tok, side="right"), minlength=len(lines))
        if not np.array_equal(chars_per_line, ids_per_line):
            return None
        cut_at = np.asarray(sentence_cuts(text), dtype=np.int64)
        cut_line = np.searchsorted(line_start, cut_at, side="right") - 1
        keep = np.asarray(split, dtype=bool)[line_part[cut_line]]
        cut_end = mark_tok[np.searchsorted(mark_at, cut_at[keep])] + 1  # token index after each cut's mark
        ends = np.sort(np.concatenate([cut_end, line_end]), kind="stable")
        lengths = np.diff(ends, prepend=0)
        sentences = np.bincount(cut_line[keep], minlength=len(lines)) + 1
        return _per_part(ids, lengths, np.repeat(line_part, sentences), len(parts))

    def _joined(self, parts: list[list[str]], split: list[bool]):
        """Sentences joined by the marker, about _INPUT_CHARS per input; None when the
        text itself holds the marker (its id would be taken for a sentence end)."""
        texts: list[str] = []
        sentences: list[int] = []  # per input
        owner: list[int] = []  # per input: its part
        for j, (lines, cut) in enumerate(zip(parts, split, strict=True)):
            for group in _groups(lines, _INPUT_CHARS):
                text, n = _MARKER.join(group), len(group)
                if cut:
                    # Lines are stripped, so no whitespace touches a marker and no split
                    # crosses one: this cuts exactly where split_sentences does.
                    text, more = mark_sentences(text, _MARKER)
                    n += more
                texts.append(text + _MARKER)
                sentences.append(n)
                owner.append(j)
        ids, counts = self._flat_ids(texts)
        ends = np.flatnonzero(ids == self.marker_id)
        input_of_end = np.searchsorted(np.cumsum(counts), ends, side="right")
        if not np.array_equal(np.bincount(input_of_end, minlength=len(texts)), sentences):
            return None
        lengths = np.diff(ends, prepend=-1) - 1
        tokens = np.delete(ids, ends)
        owners = np.repeat(np.asarray(owner, dtype=np.int64), sentences)
        return _per_part(tokens, lengths, owners, len(parts))


def _worker_main(conn) -> None:
    """A tokenizing process: the tokenizer path first, then (parts, split) tasks until None."""
    # Ctrl-C in a terminal reaches the whole process group; the main process decides what
    # happens (it stops the workers itself), so a worker never dies mid-message of it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One rayon thread per worker process: N single-threaded workers beat N workers
    # that each fight for every core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        given = conn.recv()  # (tokenizer.json's path, text): spawned before it is installed (see _Workers)
        if given is None:
            return
        path, text = given
        tokenize = _Tokenize(Path(path).read_text(encoding="utf-8"), text)
        while (task := conn.recv()) is not None:
            conn.send(tokenize(*task))
    except (EOFError, ConnectionError):  # the main process is gone, or stopped (Ctrl-C): nothing left to do
        # ConnectionResetError too: the main process closes its end with this worker's last result
        # unread when it is stopped between results, and the next recv() is then reset, not EOF.
        pass


@dataclass
class _Chunk:
    parts: list[list[str]]  # lines of consecutive documents (or pieces of one)
    ends: list[DocEnd | None]  # per part: its document's end, or None if it continues
    split: list[bool]  # per part: cut its lines into sentences
    progress: int  # input bytes consumed when the chunk was cut


def _chunks(reader: CorpusReader, chunk_chars: int, split_sentences: bool) -> Iterator[_Chunk]:
    parts: list[list[str]] = []
    ends: list[DocEnd | None] = []
    split: list[bool] = []
    lines: list[str] = []
    size = 0
    for item in reader:
        # A part holds lines of one document, so of one input: the reader still reads
        # that input when the part closes, at its DocEnd or at a cut.
        if isinstance(item, str):
            lines.append(item)
            size += len(item)
            if size < chunk_chars:
                continue
            parts.append(lines)
            ends.append(None)
        else:
            parts.append(lines)
            ends.append(item)
        split.append(split_sentences or reader.yields_paragraphs)
        if ends[-1] is not None and size < chunk_chars and len(parts) < _MAX_PARTS:
            lines = []
            continue
        yield _Chunk(parts, ends, split, reader.progress)
        parts, ends, split, lines, size = [], [], [], [], 0
    if parts:
        yield _Chunk(parts, ends, split, reader.progress)


class _Workers:
    """The tokenizing processes of a build (none with ``--workers 1``).

    Chunk i goes to worker i mod N over that worker's own pipe, so results come back in
    chunk order without any reordering. Unlike a multiprocessing.Pool this sees a worker
    that died (its sentinel fires while its result is awaited: one line, not a hang), and
    stops in bounded time on every path: workers are killed and reaped on exit, never left
    holding a queue lock the way Pool.terminate can wait on forever.

    They are spawned before the tokenizer is installed: a fresh process takes a few
    tenths of a second to import numpy and tokenizers, and that now overlaps the main
    process's own set-up. :meth:`start` then sends each the path of the installed
    ``tokenizer.json``, the one that encodes the shards (and whether it encodes lines as text).
    """

    def __init__(self, count: int):
        self.count = count
        self._local: _Tokenize | None = None
        self._procs: list = []
        self._conns: list = []
        self._started = False  # whether they were given the tokenizer (else they have nothing to finish)
        if count > 1:
            ctx = multiprocessing.get_context("spawn")  # fork after tokenizers used threads can deadlock
            for _ in range(count):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(theirs,), daemon=True)
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(mine)

    def start(self, directory: Path, spec: TokenizerSpec) -> None:
        self._started = True
        if not self._procs:
            self._local = _Tokenize(spec.tokenizer_json, spec.text)
            return
        for conn in self._conns:
            conn.send((str(directory / "tokenizer.json"), spec.text))

    def tokenized(self, chunks: Iterator[_Chunk]) -> Iterator[tuple[_Chunk, tuple]]:
        """Yield (chunk, result) in chunk order, one chunk in flight per worker.

        One, not more: a worker blocked sending a large result while the main process is
        blocked sending it the next chunk would wait on each other forever. A worker gets
        its next chunk as soon as its result is in, before the main process writes that
        result out, so it does not idle while the shards are written.
        """
        if not self._procs:
            for c in chunks:
                yield c, self._local(c.parts, c.split)
            return
        pending: deque = deque()  # (chunk, worker index), oldest first
        for i, c in enumerate(chunks):
            w = i % self.count
            if len(pending) == self.count:  # worker w holds chunk i - count, the oldest
                c0, _ = pending.popleft()
                result = self._result(w)
                self._conns[w].send((c.parts, c.split))
                pending.append((c, w))
                yield c0, result
            else:
                self._conns[w].send((c.parts, c.split))
                pending.append((c, w))
        while pending:
            c0, w = pending.popleft()
            yield c0, self._result(w)

    def _result(self, w: int):
        conn, proc = self._conns[w], self._procs[w]
        multiprocessing.connection.wait([conn, proc.sentinel])
        if not conn.poll():  # the sentinel fired: the worker is gone and nothing more will come
            proc.join()
            raise WorkerDied(f"a tokenizer worker process died (exit status {proc.exitcode}); finished "
                             "shards are kept, rerun the same command to resume")
        return conn.recv()

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc) -> None:
        for conn in self._conns:
            conn.close()  # a worker waiting for work sees EOF and ends
        for proc in self._procs:
            proc.join(timeout=1.0 if exc[0] is None and self._started else 0.0)
            if proc.is_alive():  # busy (or interrupted mid-task): its result is not needed
                proc.kill()
                proc.join()


# -- resume journal ------------------------------------------------------------------------

def _plan_key(sources: list[dict], tokenizer: Vocabulary, opts: BuildOptions, extra: dict | None = None) -> str:
    plan = {
        "shard_format": FORMAT_VERSION, "created_by": created_by(), "sources": sources, **_tokenizer_key(tokenizer),
        "split_sentences": opts.split_sentences, "shard_tokens": opts.shard_tokens,
        "piece_bytes": opts.piece_bytes,
        # Only where it shapes the output: journals of text-only builds stay valid.
        **({"text_field": opts.text_field} if opts.has_records else {}),
        **({"documents": opts.documents} if opts.documents != "blank" else {}),
        **({"join_wrapped": True} if opts.join_wrapped else {}),
        **(extra or {}),
    }
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def _tokenizer_key(tokenizer: Vocabulary) -> dict:
    """What the plan key takes of the tokenizer (a WordPiece one's entries are as they always were)."""
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.key()
    vocab, normalization = tokenizer
    return {"tokenizer": vocab_fingerprint(vocab), "normalizer": normalization.to_json()}


def _install(directory: Path, tokenizer: Vocabulary) -> TokenizerSpec:
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.install(directory)
    return install_tokenizer(directory, *tokenizer)


def _journal(key: str, records: list[dict], opts: BuildOptions) -> dict:
    """The resume journal: the plan key, the shards finished so far, and the options known
    before a vocabulary (a trained one's size and case), by which a rerun knows that the
    vocabulary already in the folder is the one it would train."""
    return {"key": key, "shards": records, "options": _known_options(opts)}


def _journaled(directory: Path, default: int) -> int:
    """How many shards the journal on disk records (``default`` if it cannot be read)."""
    try:
        return len(json.loads((directory / JOURNAL_NAME).read_text(encoding="utf-8"))["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


def _write_json(path: Path, obj: object) -> None:
    atomic_write(path, json.dumps(obj))


def _resumable(directory: Path, key: str) -> list[dict]:
    """Journal records of shards that can be kept as they are, in order."""
    try:
        journal = json.loads((directory / JOURNAL_NAME).read_text(encoding="utf-8"))
        if journal.get("key") != key:
            return []
        records = journal["shards"]
    except (OSError, ValueError, KeyError, AttributeError):
        return []  # no journal, or one we cannot trust: build from the start
    kept = []
    for i, rec in enumerate(records):
        try:
            info = ShardInfo(**rec["info"])
            Cursor.from_list(rec["cursor"]), ReadStats(**rec["read"]), Counts(**rec["counts"])
            if info.name != shard_name(i):
                break
            with ShardReader(directory / info.name) as r:
                if r.info() != info:
                    break
                r.verify()
        except (ShardError, TypeError, KeyError, ValueError, IndexError):
            break
        kept.append(rec)
    return kept


@dataclass(frozen=True)
class _Existing:
    """What a build finds in its output folder before it writes anything."""
    kind: str  # "nothing", "dataset" (a manifest), "interrupted" (a journal)
    key: str | None = None  # the plan key recorded there (None: not recorded or unreadable)
    sources: list | None = None  # a dataset's recorded sources
    shards: int = 0
    tokens: int = 0
    options: dict = field(default_factory=dict)  # recorded build options: a manifest's "build", a journal's "options"

    def built_otherwise(self, sources: list[dict], opts: BuildOptions) -> bool:
        """A dataset of other inputs, or of options known to differ before any vocabulary
        exists; an option the record lacks (an older manifest) is left to the plan key."""
        return self.kind == "dataset" and (self.sources != sources or any(
            name in self.options and self.options[name] != value for name, value in _known_options(opts).items()))


def _given_options(opts: BuildOptions) -> dict:
    """The options a manifest records (``_manifest``'s "build") as they were given."""
    return {"split_sentences": opts.split_sentences, "documents": opts.documents, "join_wrapped": opts.join_wrapped,
            "shard_tokens": opts.shard_tokens, "piece_bytes": opts.piece_bytes,
            **({"text_field": opts.text_field} if opts.has_records else {})}


def _known_options(opts: BuildOptions) -> dict:
    """The options a manifest records that do not depend on the vocabulary; a trained one's
    size and case are known before it is trained."""
    known = _given_options(opts)
    if opts.train_vocab is not None:
        known.update(vocab={"train": opts.train_vocab}, lowercase=True if opts.lowercase is None else opts.lowercase)
    return known


def _existing(directory: Path, overwrite: bool) -> _Existing:
    """Reads the folder's record; refuses a non-empty folder that holds no build (R12)."""
    if not directory.is_dir() or not any(p.name != LOCK_NAME for p in directory.iterdir()):
        return _Existing("nothing")
    if (directory / MANIFEST_NAME).exists():
        try:
            manifest = Manifest.load(directory)
            return _Existing("dataset", manifest.build.get("plan_key"), manifest.sources, len(manifest.shards),
                             manifest.totals.get("tokens", 0), manifest.build)
        except ShardError:
            return _Existing("dataset")  # damaged: no record to match, so only --overwrite replaces it
    try:
        journal = json.loads((directory / JOURNAL_NAME).read_text(encoding="utf-8"))
        if not isinstance(journal, dict):
            return _Existing("interrupted")
        options = journal.get("options")
        return _Existing("interrupted", journal.get("key"), options=options if isinstance(options, dict) else {})
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        return _Existing("interrupted")
    if not overwrite:
        raise UserError(f"{directory} is not empty and holds no bert-ds dataset; choose a new or empty "
                        "--output, or pass --overwrite to build into it")
    return _Existing("nothing")


def _refuse_other(directory: Path, existing: _Existing) -> None:
    if existing.kind == "dataset":
        what = (f"a finished dataset ({existing.shards} shard(s), {existing.tokens:,} tokens)"
                if existing.shards else "a dataset whose manifest does not load")
        raise UserError(f"{directory} already holds {what} built from other inputs or options; "
                        "choose another --output, or pass --overwrite to replace it")
    raise UserError(f"{directory} holds an interrupted build of other inputs or options; rerun that "
                    "build to finish it, choose another --output, or pass --overwrite to replace it")


def _remove_stale(directory: Path, keep_shards: int) -> None:
    """Remove temporary files, and shard files numbered keep_shards or above."""
    for p in directory.iterdir():
        m = _SHARD_FILE.match(p.name)
        if (m and (m.group(3) or int(m.group(1)) >= keep_shards)) or p.name in (
            MANIFEST_NAME + ".tmp", JOURNAL_NAME + ".tmp"
        ):
            p.unlink()


# -- the build -------------------------------------------------------------------------------

def _text_lines(opts: BuildOptions, desc: str) -> Iterator[str]:
    """The inputs' text lines, with a progress bar over input bytes."""
    reader = opts.reader()
    with tqdm(total=reader.total_bytes, unit="B", unit_scale=True, desc=desc, file=sys.stderr,
              disable=not opts.progress) as bar:
        for n, item in enumerate(reader):
            if isinstance(item, str):
                yield item
            if n % 4096 == 0:
                bar.update(reader.progress - bar.n)
        bar.update(reader.progress - bar.n)


def _vocab(opts: BuildOptions) -> Vocabulary:
    """(vocab.txt bytes, the normalizer), loaded or trained, or the --tokenizer; writes nothing."""
    if opts.tokenizer is not None:
        return load_fast_tokenizer(opts.tokenizer, opts.special_tokens)
    if opts.vocab is None:
        lowercase = True if opts.lowercase is None else opts.lowercase
        passes = iter(("vocab: alphabet", "vocab: train"))
        return train_vocab(lambda: _text_lines(opts, next(passes)), opts.train_vocab, lowercase), \
            Normalization(lowercase=lowercase)
    vocab, given = load_vocabulary(opts.vocab)
    if given is None:  # a bare vocab.txt: cased exactly when it holds cased tokens, unless told
        lowercase = not holds_cased_tokens(vocab) if opts.lowercase is None else opts.lowercase
        return vocab, Normalization(lowercase=lowercase)
    if opts.lowercase is not None and opts.lowercase != given.lowercase:
        flag = "--lowercase" if opts.lowercase else "--no-lowercase"
        raise UserError(f"{opts.vocab}: this tokenizer {'lowercases' if given.lowercase else 'keeps case'}; "
                        f"{flag} would change it and the model it belongs to: drop {flag}")
    return vocab, given


@dataclass
class _Plan:
    """What one build process makes: a plain build, or one part of a partitioned build."""

    directory: Path
    tokenizer: Callable[[], Vocabulary]  # loads or trains it; may wait for another part
    part: Part = field(default_factory=Part)
    share: Share | None = None  # of a part: its share of the inputs
    sizes: list[int] = field(default_factory=list)  # of a part: every input's size


def build(opts: BuildOptions) -> BuildResult:
    """Run a build; UserError for bad input, for a folder it must not replace, and for write failures."""
    t0 = time.perf_counter()
    # The workers start first: their imports overlap hashing the inputs, loading the
    # vocabulary and installing the tokenizer (a build that ends early stops them unused).
    with _Workers(opts.workers) as workers:
        plan = _part_plan(opts) if opts.part.partitioned else _Plan(Path(opts.output), lambda: _vocab(opts))
        return _build(opts, plan, workers, t0)


def _part_plan(opts: BuildOptions) -> _Plan:
    """A part's plan: the parent checked (nothing written yet), its share cut, one line said."""
    part, output = opts.part, Path(opts.output)
    sizes = [input_size(p) for p in opts.inputs]
    record = _vocab_record(opts, sizes) if opts.train_vocab is not None else None
    removals = check_parent(output, part.count, opts.overwrite, record)
    share = share_of(opts.inputs, part.index, part.count, opts.documents, opts.piece_bytes, sizes)
    print(f"{part.label} ({part.origin}): {len(share.sources())} input(s), {share.bytes / 1e6:.1f} MB of "
          f"{share.total_bytes / 1e6:.1f} MB -> {part.folder(output)}", flush=True)

    def tokenizer() -> Vocabulary:
        if record is None and not removals:
            return _vocab(opts)
        if record is not None and not removals and not opts.overwrite and has_tokenizer(output, record):
            return load_vocabulary(str(output / TOKENIZER_DIR))  # renamed into place whole: no lock needed
        with ParentLock(output, part.label):
            remove(removals)
            if record is None:
                return _vocab(opts)
            folder = shared_tokenizer(output, record, opts.overwrite, part.label, lambda: _vocab(opts))
        return load_vocabulary(str(folder))

    return _Plan(part.folder(output), tokenizer, part, share, sizes)


def _vocab_record(opts: BuildOptions, sizes: list[int]) -> dict:
    """What a vocabulary shared by the parts is trained from (parent.py's trained_from.json)."""
    return {
        "train_vocab": opts.train_vocab, "lowercase": True if opts.lowercase is None else opts.lowercase,
        "inputs": [[p, n] for p, n in zip(opts.inputs, sizes, strict=True)],
        "documents": opts.documents, "join_wrapped": opts.join_wrapped, "piece_bytes": opts.piece_bytes,
        "text_field": opts.text_field if opts.has_records else None,
    }


def _build(opts: BuildOptions, plan: _Plan, workers: _Workers, t0: float) -> BuildResult:
    directory = plan.directory
    existed = directory.exists()
    try:
        # Everything that can fail on bad input comes before the first write to DIR,
        # so a failed build never spoils a dataset already there.
        sources = share_sources(opts.inputs, plan.share) if plan.share else [source_info(p) for p in opts.inputs]
        existing = _existing(directory, opts.overwrite)
        if existing.built_otherwise(sources, opts) and not opts.overwrite:
            _refuse_other(directory, existing)  # decided before a vocabulary is trained
        reused = _reused_vocab(directory, existing, opts, plan)
        if reused is not None and _keys(opts, plan, sources, reused)[0] == existing.key:
            tokenizer = reused
        else:
            tokenizer = plan.tokenizer()
        key, partition = _keys(opts, plan, sources, tokenizer)
        with FolderLock(directory, "a data_tools build"):
            # Again under the lock, which decides: another build may have finished meanwhile.
            existing = _existing(directory, opts.overwrite)
            if existing.kind == "dataset" and existing.key == key:
                manifest = Manifest.load(directory)
                return BuildResult(directory, manifest, time.perf_counter() - t0, 0.0, len(manifest.shards),
                                   already_built=True, label=plan.part.label if partition else "")
            if existing.kind != "nothing" and existing.key != key and not opts.overwrite:
                _refuse_other(directory, existing)
            try:
                manifest, records, t_vocab = _build_locked(opts, directory, workers, sources,
                                                           tokenizer, key, t0, (plan.share, partition))
            except UserError:
                # Bad input found while reading (a JSONL line, a Parquet row, an empty corpus) in
                # a folder that held nothing: with no shard finished there is nothing to resume,
                # so the folder is left as it was and the fixed input's rerun starts clean.
                if existing.kind == "nothing" and _journaled(directory, default=1) == 0:
                    _clear(directory)
                raise
    except UserError:
        if not existed:  # made by this build; the lock's file went with the lock
            _remove_if_empty(directory)
        raise
    except OSError as e:
        raise UserError(f"{directory}: build failed: {e}") from None
    return BuildResult(directory, manifest, time.perf_counter() - t0, t_vocab, len(records),
                       label=plan.part.label if partition else "")


def _reused_vocab(directory: Path, existing: _Existing, opts: BuildOptions,
                  plan: _Plan) -> tuple[bytes, Normalization] | None:
    """A rerun of a build, finished or interrupted, that trained its vocabulary with these
    options: the vocabulary in the folder, a candidate for the one training would give. It is
    that one where the plan key made with it is the folder's (training is deterministic and
    the key covers the inputs); the caller checks, and trains where not. A finished rerun is
    then found done at once, an interrupted one resumes at once. None where the vocabulary
    must be loaded or trained as the build says."""
    known = _known_options(opts)
    if (opts.train_vocab is None or opts.overwrite or plan.part.partitioned or existing.kind == "nothing"
            or any(existing.options.get(name) != value for name, value in known.items())):
        return None
    try:
        vocab, normalization = load_vocabulary(str(directory))
    except (UserError, OSError, ValueError):  # damaged: train, and let the plan key decide
        return None
    return None if normalization is None else (vocab, normalization)


def _clear(directory: Path) -> None:
    """Remove what a build wrote into a folder that held nothing: its journal, tokenizer files and shards."""
    _remove_stale(directory, keep_shards=0)
    for name in (JOURNAL_NAME, *HF_FILES):
        (directory / name).unlink(missing_ok=True)


def _remove_if_empty(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not empty, or gone: either way nothing of ours is left
        directory.rmdir()


def _keys(opts: BuildOptions, plan: _Plan, sources: list[dict], tokenizer: Vocabulary) -> tuple[str, dict | None]:
    """The plan key of this folder (its resume key), and a part's partition record.

    A part's corpus_key is the same in every part: the whole input list by (path, size),
    not by content, so no part reads the whole corpus to compute it."""
    if not plan.part.partitioned:
        return _plan_key(sources, tokenizer, opts), None
    part = plan.part
    whole = [{"path": p, "bytes": n} for p, n in zip(opts.inputs, plan.sizes, strict=True)]
    corpus_key = _plan_key(whole, tokenizer, opts, {"parts": part.count})
    key = _plan_key(sources, tokenizer, opts, {"partition": [part.index, part.count, corpus_key]})
    return key, {"index": part.index, "count": part.count, "corpus_key": corpus_key}


def _build_locked(opts: BuildOptions, directory: Path, workers: _Workers, sources: list[dict],
                  tokenizer: Vocabulary, key: str,
                  t0: float, part: tuple[Share | None, dict | None]) -> tuple[Manifest, list[dict], float]:
    """The build proper, in a folder this process holds; returns (manifest, reused records, set-up seconds).
    ``part``: a part's share of the inputs and its partition record (None, None for a plain build)."""
    records = _resumable(directory, key)
    # From here on the folder is not a dataset until the new manifest lands; the
    # journal comes first, so a build killed at any later point is recognised.
    (directory / MANIFEST_NAME).unlink(missing_ok=True)
    _write_json(directory / JOURNAL_NAME, _journal(key, records, opts))
    _remove_stale(directory, keep_shards=1 << 62)
    spec = _install(directory, tokenizer)
    workers.start(directory, spec)
    t_vocab = time.perf_counter() - t0
    share, partition = part
    manifest = _write_shards(opts, directory, spec, key, records, workers, share)
    manifest.sources = sources
    manifest.build["plan_key"] = key
    if partition is not None:
        manifest.build["partition"] = partition
    manifest.save(directory)
    (directory / JOURNAL_NAME).unlink(missing_ok=True)
    return manifest, records, t_vocab


def _write_shards(opts: BuildOptions, directory: Path, spec: TokenizerSpec, key: str,
                  records: list[dict], workers: _Workers, share: Share | None = None) -> Manifest:
    if records:
        last = records[-1]
        reader = opts.reader(share, start=Cursor.from_list(last["cursor"]), stats=ReadStats(**last["read"]))
        counts = Counts(**last["counts"])
    else:
        reader = opts.reader(share)
        counts = Counts()
    shards = [ShardInfo(**r["info"]) for r in records]
    journal = _journal(key, list(records), opts)
    bar = tqdm(total=reader.total_bytes, initial=reader.progress, unit="B", unit_scale=True,
               desc="tokenize", file=sys.stderr, disable=not opts.progress)
    writer: ShardWriter | None = None
    doc_sentences = 0  # sentences of the open document so far
    stream = workers.tokenized(_chunks(reader, CHUNK_CHARS, opts.split_sentences))
    try:
        for chunk, (tokens, lengths, per_part, empty_per_part) in stream:
            sent_at = np.zeros(len(per_part) + 1, dtype=np.int64)
            np.cumsum(per_part, out=sent_at[1:])
            tok_at = np.zeros(lengths.size + 1, dtype=np.int64)
            np.cumsum(lengths, out=tok_at[1:])
            long_at = np.searchsorted(sent_at, np.flatnonzero(lengths > MAX_SENTENCE_TOKENS), side="right") - 1
            long_per_part = np.bincount(long_at, minlength=len(per_part)).tolist()
            # Python ints: a chunk may hold thousands of small documents, one loop step each.
            sent_at, empty_per_part = sent_at.tolist(), empty_per_part.tolist()
            for j, end in enumerate(chunk.ends):
                # Counted per part, not per chunk: a shard may end inside a chunk, and
                # the counts in its journal record must cover exactly what precedes it.
                counts.empty_sentences += empty_per_part[j]
                s0, s1 = sent_at[j], sent_at[j + 1]
                if s1 > s0:
                    counts.long_sentences_split += long_per_part[j]
                    if writer is None:
                        writer = ShardWriter(directory / shard_name(len(shards)), spec.vocab_size)
                    writer.add_sentences(tokens[tok_at[s0] : tok_at[s1]], lengths[s0:s1])
                    doc_sentences += s1 - s0
                if end is None:
                    continue
                if doc_sentences:
                    writer.end_document()
                    counts.documents_written += 1
                else:
                    counts.skipped_empty += 1
                doc_sentences = 0
                if writer is not None and writer.num_tokens >= opts.shard_tokens:
                    shards.append(_finish_shard(writer, counts, end, journal, directory))
                    writer = None
            bar.update(chunk.progress - bar.n)
        if writer is not None:
            end = DocEnd(Cursor(len(opts.inputs), 0, None), reader.stats)
            shards.append(_finish_shard(writer, counts, end, journal, directory))
            writer = None
    except BaseException:
        # A stop between a shard's rename and its journal record would leave it under its
        # final name with no record: only the shards the journal on disk records stay.
        _remove_stale(directory, keep_shards=_journaled(directory, len(shards)))
        raise
    finally:
        stream.close()  # closes the input being read on every path
        if writer is not None:
            writer.abort()
        bar.close()
    _remove_stale(directory, keep_shards=len(shards))
    skipped = _check_documents(opts, reader.stats, counts)
    return _manifest(opts, spec, shards, counts, reader.stats, skipped)


def _check_documents(opts: BuildOptions, st: ReadStats, counts: Counts) -> dict[str, int]:
    """Every document read is written or skipped for a reason; returns the skips by reason.
    A build that wrote no document is a user error (an empty corpus), but for a part of a
    partitioned build: its share may hold no document, and the corpus is judged whole where it is read."""
    skipped = {"empty": counts.skipped_empty}
    if opts.has_records:  # the record inputs' own reasons, counted by the reader
        skipped.update(missing_field=st.missing_field, not_string=st.not_string)
    if counts.documents_written + sum(skipped.values()) != st.documents:
        raise RuntimeError(f"bug: {st.documents} documents in, but {counts.documents_written} written "
                           f"+ {skipped} skipped")
    if counts.documents_written == 0 and not opts.part.partitioned:
        reasons = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in skipped.items() if n or k == "empty")
        raise EmptyCorpus(
            f"empty corpus: no document written from {', '.join(opts.inputs)} "
            f"({st.documents} documents in, {reasons})"
        )
    return skipped


def _manifest(opts: BuildOptions, spec: TokenizerSpec, shards: list[ShardInfo], counts: Counts, st: ReadStats,
              skipped: dict[str, int]) -> Manifest:
    return Manifest(
        vocab_size=spec.vocab_size,
        token_dtype=token_dtype(spec.vocab_size).name,
        lowercase=spec.lowercase,
        special_tokens=spec.special_tokens,
        tokenizer_fingerprint=spec.fingerprint,
        shards=shards,
        totals={
            "docs": sum(s.num_docs for s in shards),
            "sentences": sum(s.num_sentences for s in shards),
            "tokens": sum(s.num_tokens for s in shards),
        },
        build={
            "vocab": _vocab_option(opts),
            "lowercase": spec.lowercase,
            "normalizer": spec.normalizer,
            **({"tokenizer_sha256": _sha256(spec.tokenizer_json)} if opts.tokenizer is not None else {}),
            **_given_options(opts),
            "sentence_split_re": (SENTENCE_SPLIT_RE.pattern
                                  if opts.split_sentences or opts.has_records or opts.join_wrapped else None),
            "heading_re": HEADING_RE.pattern,
        },
        stats={
            "documents_in": st.documents,
            "documents_written": counts.documents_written,
            "documents_skipped": skipped,
            "sentences": counts.sentences,
            "tokens": counts.tokens,
            "empty_sentences_dropped": counts.empty_sentences,
            "long_sentences_split": counts.long_sentences_split,
            "input_bytes": st.bytes,
            "lines": st.lines,
            "headings_dropped": st.headings,
            "invalid_utf8_replaced": st.invalid_utf8,
            "nul_bytes_removed": st.nul_bytes,
            "crlf_lines": st.crlf_lines,
            "long_lines_cut": st.long_lines_cut,
        },
    )


def _vocab_option(opts: BuildOptions) -> dict:
    """The manifest's ``build.vocab``: how the tokenizer was had."""
    if opts.train_vocab is not None:
        return {"train": opts.train_vocab}
    return {"file": opts.vocab} if opts.vocab is not None else {"tokenizer": opts.tokenizer}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _finish_shard(writer: ShardWriter, counts: Counts, end: DocEnd, journal: dict, directory: Path) -> ShardInfo:
    info = writer.close()
    counts.sentences += info.num_sentences
    counts.tokens += info.num_tokens
    journal["shards"].append({
        "info": info.to_dict(), "cursor": end.cursor.to_list(),
        "read": end.stats.to_dict(), "counts": asdict(counts),
    })
    _write_json(directory / JOURNAL_NAME, journal)
    return info
