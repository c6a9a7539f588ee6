"""The on-disk token shard format: the one definition, used by writer and reader alike.

A shard is a pair of files sharing a prefix::

    PREFIX.bin   token ids of every sentence back to back, little-endian;
                 uint16 when the vocabulary has at most 65536 entries, else uint32
    PREFIX.idx   a fixed 64-byte header, then the body

Header (``HEADER``, little-endian, 64 bytes)::

    magic           8s   b"BERTDSI\\x00"
    version         u32  FORMAT_VERSION (1)
    dtype code      u8   1 = uint16, 2 = uint32   (then 3 zero bytes)
    num_docs        u64
    num_sentences   u64
    num_tokens      u64
    bin_size        u64  bytes of PREFIX.bin (= num_tokens * token size)
    bin_crc32       u32  zlib.crc32 of PREFIX.bin
    max_token_id    u32  largest token id in PREFIX.bin (0 for an empty shard)
    idx_crc32       u32  zlib.crc32 of the body below   (then 4 zero bytes)

Body::

    doc_bounds      uint64 x (num_docs + 1)   sentence index where each document starts;
                                              first 0, last num_sentences, strictly increasing
    sentence_lens   uint16 x num_sentences    tokens per sentence, each >= 1

Design choices:

* Token offsets are not stored: the reader derives them with one cumsum over
  ``sentence_lens`` at open. The index costs 2 bytes per sentence plus 8 per
  document (~0.1 byte/token for 20-token sentences), so a uint16 shard stays near
  2.1 bytes per token on disk.
* Sentence lengths are uint16. A sentence longer than 65535 tokens is split by the
  writer into consecutive pieces of at most 65535 tokens; readers see the pieces as
  sentences of the same document.
* Every document has at least one sentence and every sentence at least one token.
  The writer enforces it and the reader checks it, so consumers need no empty cases.
* Validation raises :class:`ShardError` naming the file and what is wrong, never
  ``assert`` (which ``python -O`` strips; Megatron's indexed_dataset relies on it).
  Opening checks everything that is cheap: header fields, both file sizes against the
  header, index structure and the index checksum; it never reads the ``.bin``. It reads the
  index body in blocks and keeps none of it, so opening the shards of a whole corpus costs
  memory that does not grow with the corpus; :meth:`ShardReader.read_index` reads (and checks)
  one shard's index again when it is wanted, and a consumer of many shards frees each in turn.
  :meth:`ShardReader.verify` reads the ``.bin`` and checks its checksum and max id.
* Crash safety: the writer writes ``PREFIX.bin.tmp`` and ``PREFIX.idx.tmp``, fsyncs
  both, renames ``.bin`` then ``.idx`` into place and fsyncs the directory. A final
  name therefore never holds a partial file, and because the ``.idx`` records the
  size and checksum of its ``.bin``, a ``.bin`` left over from another build is caught.
* :attr:`ShardReader.fingerprint` hashes the header, which holds the counts, sizes and
  both checksums: a cache keyed by it is rebuilt whenever the shard's content changes
  under the same path.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import struct
import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bert_ds.base.atomic import fsync_path
from bert_ds.base.errors import ShardError

MAGIC = b"BERTDSI\x00"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIB3xQQQQIII4x")
HEADER_SIZE = HEADER.size  # 64 bytes
DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
MAX_SENTENCE_TOKENS = 65535  # what a uint16 length holds
MAX_VOCAB_SIZE = 1 << 32
_READ_BLOCK = 1 << 24  # bytes per read in verify(): bounded memory on any shard size
_INDEX_BLOCK = 1 << 20  # entries per read while an open checks the index: bounded memory on any shard size


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest token dtype holding ids ``0 .. vocab_size - 1``."""
    if not 1 <= vocab_size <= MAX_VOCAB_SIZE:
        raise ShardError(f"vocab size {vocab_size} out of range [1, {MAX_VOCAB_SIZE}]")
    return DTYPE_CODES[1] if vocab_size <= 1 << 16 else DTYPE_CODES[2]


def _dtype_code(dtype: np.dtype) -> int:
    return next(code for code, dt in DTYPE_CODES.items() if dt == dtype)


@dataclass(frozen=True)
class ShardInfo:
    """What a finished shard holds; one entry of the manifest's ``shards`` list."""

    name: str  # file prefix relative to the dataset folder, e.g. "shard_00000"
    num_docs: int
    num_sentences: int
    num_tokens: int
    bin_bytes: int
    idx_bytes: int
    bin_crc32: int
    idx_crc32: int  # crc32 of the .idx body, as stored in its header
    max_token_id: int

    def to_dict(self) -> dict:
        return asdict(self)


def _split_long(lengths: np.ndarray) -> np.ndarray:
    """Split lengths above MAX_SENTENCE_TOKENS into consecutive full pieces plus a rest."""
    pieces = -(-lengths // MAX_SENTENCE_TOKENS)  # ceil division, >= 1 for lengths >= 1
    out = np.full(int(pieces.sum()), MAX_SENTENCE_TOKENS, dtype=np.int64)
    last = np.cumsum(pieces) - 1
    out[last] = lengths - MAX_SENTENCE_TOKENS * (pieces - 1)
    return out


class ShardWriter:
    """Writes one shard; documents are appended in order.

    ``add_document(sentences)`` takes a whole document. The streaming form,
    ``add_sentences(tokens, lengths)`` repeated and then ``end_document()``, lets a
    document of any size be written with bounded memory.

    Use as a context manager: leaving the block without :meth:`close` (an exception,
    a forgotten close) removes the temporary files, so nothing is left under a name.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int):
        self.prefix = Path(prefix)
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(self.vocab_size)
        self.bin_path = self.prefix.with_name(self.prefix.name + ".bin")
        self.idx_path = self.prefix.with_name(self.prefix.name + ".idx")
        self._bin_tmp = self.prefix.with_name(self.prefix.name + ".bin.tmp")
        self._idx_tmp = self.prefix.with_name(self.prefix.name + ".idx.tmp")
        self.num_docs = 0
        self.num_sentences = 0
        self.num_tokens = 0
        self.max_token_id = 0
        self._crc = 0
        self._lengths: list[np.ndarray] = []  # uint16 pieces of the body
        self._doc_bounds = [0]
        self._open_sentences = 0  # sentences of the document being written
        self._closed = False
        self._bin = open(self._bin_tmp, "wb", buffering=1 << 20)

    # -- writing -------------------------------------------------------------------
    def _write(self, f, data) -> None:
        """Every byte of both files goes through here (tests inject write errors)."""
        f.write(data)

    def add_sentences(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append sentences to the open document.

        tokens: (sum(lengths),) integer ids; lengths: (n,) tokens per sentence, each >= 1.
        """
        if self._closed:
            raise ValueError(f"{self.prefix}: writer is closed")
        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if tokens.ndim != 1 or lengths.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError("tokens and lengths must be 1-D integer arrays")
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {tokens.size} tokens given")
        if lengths.size == 0:
            return
        if int(lengths.min()) < 1:
            raise ShardError(f"{self.bin_path}: empty sentence in document {self.num_docs}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            pos = int(np.argmax(tokens == bad))
            raise ShardError(
                f"{self.bin_path}: token id {bad} at position {pos} of document {self.num_docs} "
                f"is outside the vocabulary [0, {self.vocab_size})"
            )
        if int(lengths.max()) > MAX_SENTENCE_TOKENS:
            lengths = _split_long(lengths)
        data = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._write(self._bin, data.data)
        self._crc = zlib.crc32(data.data, self._crc)
        self._lengths.append(lengths.astype("<u2"))
        self.max_token_id = max(self.max_token_id, hi)
        self.num_tokens += tokens.size
        self.num_sentences += lengths.size
        self._open_sentences += lengths.size

    def end_document(self) -> None:
        """Close the open document; it must hold at least one sentence."""
        if self._open_sentences == 0:
            raise ShardError(f"{self.bin_path}: document {self.num_docs} has no sentences")
        self._doc_bounds.append(self.num_sentences)
        self.num_docs += 1
        self._open_sentences = 0

    def add_document(self, sentences: list[np.ndarray]) -> None:
        """Write one document: a list of 1-D integer arrays, one per sentence."""
        arrays = [np.asarray(s) for s in sentences]
        lengths = np.array([a.size for a in arrays], dtype=np.int64)
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        self.add_sentences(tokens, lengths)
        self.end_document()

    # -- finishing -----------------------------------------------------------------
    def close(self) -> ShardInfo:
        """Finish both files and move them into place; returns what was written."""
        if self._closed:
            raise ValueError(f"{self.prefix}: writer is closed")
        if self._open_sentences:
            raise ValueError(f"{self.prefix}: close() with document {self.num_docs} still open")
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            bounds = np.asarray(self._doc_bounds, dtype="<u8")
            lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, "<u2")
            body = bounds.tobytes() + lengths.tobytes()
            idx_crc = zlib.crc32(body)
            bin_bytes = self.num_tokens * self.dtype.itemsize
            header = HEADER.pack(
                MAGIC, FORMAT_VERSION, _dtype_code(self.dtype), self.num_docs,
                self.num_sentences, self.num_tokens, bin_bytes, self._crc,
                self.max_token_id, idx_crc,
            )
            with open(self._idx_tmp, "wb") as f:
                self._write(f, header)
                self._write(f, body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._bin_tmp, self.bin_path)
            os.replace(self._idx_tmp, self.idx_path)
            fsync_path(self.bin_path.parent)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return ShardInfo(
            name=self.prefix.name, num_docs=self.num_docs, num_sentences=self.num_sentences,
            num_tokens=self.num_tokens, bin_bytes=bin_bytes, idx_bytes=HEADER_SIZE + len(body),
            bin_crc32=self._crc, idx_crc32=idx_crc, max_token_id=self.max_token_id,
        )

    def abort(self) -> None:
        """Drop the temporary files; final names are left as they were."""
        self._closed = True
        if not self._bin.closed:
            try:
                self._bin.close()
            except OSError:
                pass  # a full disk can fail the final flush too; the file goes anyway
        for tmp in (self._bin_tmp, self._idx_tmp):
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        if not self._closed:
            self.abort()


def map_tokens(bin_path: Path, num_tokens: int, dtype: np.dtype | str) -> np.ndarray:
    """A shard's ``.bin``, which holds its token ids and nothing else, as a read-only
    (num_tokens,) array over a memory map (the loader, which reads at random places, reads it
    with :class:`FileArray` instead)."""
    if num_tokens == 0:
        return np.zeros(0, dtype=dtype)  # mmap cannot map an empty file
    with open(bin_path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # outlives the descriptor
    return np.frombuffer(mapped, dtype=dtype, count=num_tokens)


def _strip_suffix(prefix: str | os.PathLike) -> Path:
    p = Path(prefix)
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


@dataclass(frozen=True)
class ShardIndex:
    """One shard's index in memory, as :meth:`ShardReader.read_index` returns it."""

    lengths: np.ndarray  # (num_sentences,) uint16 tokens per sentence, read-only
    offsets: np.ndarray  # (num_sentences + 1,) int64 token offset where each sentence starts, then num_tokens
    bounds: np.ndarray  # (num_docs + 1,) int64 sentence index where each document starts, then num_sentences


_NATIVE_FORMATS = {"<u2": "H", "<u4": "I", "<i4": "i", "<i8": "q", "<u8": "Q"}


class FileArray:
    """A 1-D little-endian array stored in a file from byte ``offset`` on, read with ``os.pread``.

    ``a[lo:hi]`` reads those elements into a new array: nothing of the file is mapped into the
    process, so reading at random places across a corpus leaves the process's resident memory
    as it was (a memory map keeps every page it touched, plus up to 15 neighbours the kernel maps
    with each fault). ``a[i]`` reads one element as a Python int. Pickled as its path; slices
    with a step of 1 only.
    """

    def __init__(self, path: str | os.PathLike, dtype: np.dtype | str, count: int, offset: int = 0):
        # ``path`` kept as given: a loader opening token files by the thousand skips making Paths
        self.path, self.dtype, self.count, self.offset = path, np.dtype(dtype), int(count), int(offset)
        self._itemsize = self.dtype.itemsize
        # memoryview's format of the dtype, where this machine's byte order is the file's
        self._native = _NATIVE_FORMATS.get(self.dtype.str) if sys.byteorder == "little" else None
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ShardError(f"{self.path}: cannot open: {e.strerror}") from None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, where: slice | int) -> np.ndarray | int:
        if isinstance(where, int):  # one element, as a Python int: no array is made
            if not 0 <= where < self.count:
                raise IndexError(f"{self.path}: element {where} outside [0, {self.count})")
            return int.from_bytes(self._read(where, where + 1), "little", signed=self.dtype.kind == "i")
        lo = where.start or 0
        hi = self.count if where.stop is None else where.stop
        return np.frombuffer(self._read(lo, hi), self.dtype)

    def ints(self, lo: int, hi: int) -> list[int]:
        """Elements ``[lo, hi)`` as Python ints: for a few elements, a third of the cost of an
        array's ``tolist()`` (no array is made)."""
        if self._native is None:
            return self[lo:hi].tolist()
        return memoryview(self._read(lo, hi)).cast(self._native).tolist()

    def _read(self, lo: int, hi: int) -> bytes:
        """The bytes of elements ``[lo, min(hi, count))``; ShardError if the file is shorter now."""
        n = max(0, min(hi, self.count) - lo) * self._itemsize
        at = self.offset + lo * self._itemsize
        data = os.pread(self._fd, n, at)
        if len(data) != n:
            raise ShardError(f"{self.path}: truncated: {n} bytes at byte {at} could not be read "
                             "(the file changed while open)")
        return data

    def __getstate__(self) -> dict:
        return {"path": self.path, "dtype": self.dtype, "count": self.count, "offset": self.offset}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def close(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


@contextmanager
def _reading() -> Iterator[None]:
    """File errors as one ShardError naming the file."""
    try:
        yield
    except FileNotFoundError as e:
        raise ShardError(f"{e.filename}: missing") from None
    except OSError as e:
        raise ShardError(f"{e.filename}: cannot read: {e.strerror}") from None


class _IndexCheck:
    """The checks of an index body, fed in blocks (documents' bounds, then sentence lengths),
    so that checking a shard holds one block at a time. The first problem of each kind is
    noted and :meth:`finish` raises the first kind found in a fixed order, the order in which a
    whole-array check would have found them."""

    def __init__(self, reader: ShardReader):
        self.reader, self.crc, self.problems = reader, 0, {}
        self.prev_bound: int | None = None  # the last bound of the previous block
        self.docs_seen = self.sentences_seen = self.tokens = 0

    def _note(self, rank: int, what: str) -> None:
        self.problems.setdefault(rank, what)

    def bounds(self, raw: bytes) -> np.ndarray:
        n_sent = self.reader.num_sentences
        block = np.frombuffer(raw, dtype="<u8")
        self.crc = zlib.crc32(raw, self.crc)
        if self.prev_bound is None and block.size and int(block[0]) != 0:
            self._note(0, f"document 0 starts at sentence {int(block[0])}, not 0")
        past = (block > n_sent).nonzero()[0]
        if past.size:
            d = self.docs_seen + int(past[0])
            self._note(1, f"document pointer {d} = sentence {int(block[past[0]])} is past the end ({n_sent} sentences)")
        ext = block.astype(np.int64) if self.prev_bound is None else np.concatenate([[self.prev_bound], block.astype(np.int64)])
        bad = (np.diff(ext) <= 0).nonzero()[0]
        if bad.size:
            j = int(bad[0])
            d = self.docs_seen - (self.prev_bound is not None) + j
            self._note(2, f"document {d} is empty or reversed (sentences {int(ext[j])}..{int(ext[j + 1])})")
        if block.size:
            self.prev_bound = int(ext[-1])
        self.docs_seen += block.size
        return block

    def lengths(self, raw: bytes) -> np.ndarray:
        block = np.frombuffer(raw, dtype="<u2")
        self.crc = zlib.crc32(raw, self.crc)
        if block.size and int(block.min()) == 0:
            self._note(4, f"sentence {self.sentences_seen + int(block.argmin())} has zero tokens")
        self.sentences_seen += block.size
        self.tokens += int(block.sum(dtype=np.int64))
        return block

    def finish(self) -> None:
        r = self.reader
        if self.prev_bound != r.num_sentences:
            self._note(3, f"last document ends at sentence {self.prev_bound}, header says num_sentences={r.num_sentences}")
        if self.tokens != r.num_tokens:
            self._note(5, f"sentence lengths sum to {self.tokens}, header says num_tokens={r.num_tokens}")
        if self.crc != r.idx_crc32:
            self._note(6, f"index checksum mismatch: crc32 {self.crc:#010x}, header says {r.idx_crc32:#010x}")
        if self.problems:
            raise r._fail(r.idx_path, self.problems[min(self.problems)])


class ShardReader:
    """Opens a shard cheaply (index checked in blocks and not kept, ``.bin`` mapped when first read).

    Attributes: ``prefix`` (Path), ``dtype``, ``num_docs``, ``num_sentences``,
    ``num_tokens``, ``max_token_id``, ``tokens`` (:func:`map_tokens` of the ``.bin``,
    (num_tokens,)), ``bin_crc32``, ``idx_crc32``, ``bin_bytes``, ``idx_bytes``,
    ``fingerprint``. ``sentence_lengths``, ``sentence_offsets`` and ``doc_bounds`` (those of
    :class:`ShardIndex`) are read on first use and kept until :meth:`close`; a consumer of many
    shards that wants each index once calls :meth:`read_index`, which keeps nothing.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = _strip_suffix(prefix)
        self.bin_path = self.prefix.with_name(self.prefix.name + ".bin")
        self.idx_path = self.prefix.with_name(self.prefix.name + ".idx")
        with _reading():
            with open(self.idx_path, "rb") as f:
                idx_size = os.fstat(f.fileno()).st_size
                self._parse_header(f.read(HEADER_SIZE), idx_size)
                self._check_bin_size(os.stat(self.bin_path).st_size)
                self._scan_body(f, block=_INDEX_BLOCK)

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        """The ``.bin`` memory-mapped, on first use: a mapping holds a file descriptor, and a corpus
        of thousands of shards opened together would otherwise exceed the process's limit."""
        return map_tokens(self.bin_path, self.num_tokens, self.dtype)

    def _fail(self, path: Path, what: str) -> ShardError:
        return ShardError(f"{path}: {what}")

    def _parse_header(self, header: bytes, idx_size: int) -> None:
        if len(header) < HEADER_SIZE:
            raise self._fail(self.idx_path, f"truncated: {idx_size} bytes, shorter than the {HEADER_SIZE}-byte header")
        (magic, version, code, self.num_docs, self.num_sentences, self.num_tokens,
         self.bin_bytes, self.bin_crc32, self.max_token_id, self.idx_crc32) = HEADER.unpack(header)
        if magic != MAGIC:
            raise self._fail(self.idx_path, f"bad magic {magic!r} at offset 0 (expected {MAGIC!r}): not a bert-ds shard index")
        if version != FORMAT_VERSION:
            raise self._fail(self.idx_path, f"unsupported format version {version} (this bert-ds reads {FORMAT_VERSION})")
        if code not in DTYPE_CODES:
            raise self._fail(self.idx_path, f"unknown dtype code {code} at offset 12 (known: 1=uint16, 2=uint32)")
        self.dtype = DTYPE_CODES[code]
        self._header = header
        expected = HEADER_SIZE + 8 * (self.num_docs + 1) + 2 * self.num_sentences
        if idx_size != expected:
            kind = "truncated" if idx_size < expected else "too long"
            raise self._fail(
                self.idx_path,
                f"{kind}: {idx_size} bytes, but the header (num_docs={self.num_docs}, "
                f"num_sentences={self.num_sentences}) needs {expected}",
            )
        self.idx_bytes = idx_size

    def _check_bin_size(self, bin_size: int) -> None:
        if self.bin_bytes != self.num_tokens * self.dtype.itemsize:
            raise self._fail(
                self.idx_path,
                f"header inconsistent: bin_size={self.bin_bytes} but num_tokens={self.num_tokens} "
                f"x {self.dtype.itemsize} bytes = {self.num_tokens * self.dtype.itemsize}",
            )
        if bin_size != self.bin_bytes:
            kind = "truncated" if bin_size < self.bin_bytes else "too long"
            raise self._fail(self.bin_path, f"{kind}: {bin_size} bytes, the index says {self.bin_bytes}")
        if self.dtype.itemsize == 2 and self.max_token_id > 0xFFFF:
            raise self._fail(self.idx_path, f"max_token_id {self.max_token_id} does not fit the uint16 dtype")

    def _read_blocks(self, f, itemsize: int, count: int, block: int | None) -> Iterator[bytes]:
        """``count`` entries of ``itemsize`` bytes from ``f``, ``block`` at a time (None: all at
        once); at least one (maybe empty) block."""
        done = 0
        while True:
            n = min(count - done, count if block is None else block)
            raw = f.read(n * itemsize)
            if len(raw) != n * itemsize:  # shrank after the size check
                raise self._fail(self.idx_path, f"truncated while reading: {f.tell()} bytes")
            yield raw
            done += n
            if done >= count:
                return

    def _scan_body(self, f, block: int | None) -> ShardIndex | None:
        """Check the index body (``f`` is just past the header), ``block`` entries per read; with
        ``block`` None each part is read whole and returned as a :class:`ShardIndex`."""
        check = _IndexCheck(self)
        bounds = lengths = None  # the last block of each (the whole part when block is None)
        for raw in self._read_blocks(f, 8, self.num_docs + 1, block):
            bounds = check.bounds(raw)
        for raw in self._read_blocks(f, 2, self.num_sentences, block):
            lengths = check.lengths(raw)
        check.finish()
        if block is not None:
            return None
        offsets = np.zeros(self.num_sentences + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return ShardIndex(lengths=lengths, offsets=offsets, bounds=bounds.astype(np.int64))

    def read_index(self) -> ShardIndex:
        """Read and check this shard's index again, returned whole; the reader keeps none of it.
        ShardError if the file is no longer the one opened (another header or size)."""
        with _reading():
            with open(self.idx_path, "rb") as f:
                if f.read(HEADER_SIZE) != self._header or os.fstat(f.fileno()).st_size != self.idx_bytes:
                    raise self._fail(self.idx_path, "changed since the shard was opened")
                return self._scan_body(f, block=None)

    @functools.cached_property
    def _index(self) -> ShardIndex:
        return self.read_index()

    @property
    def sentence_lengths(self) -> np.ndarray:
        return self._index.lengths

    @property
    def sentence_offsets(self) -> np.ndarray:
        return self._index.offsets

    @property
    def doc_bounds(self) -> np.ndarray:
        return self._index.bounds

    # -- access --------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """sha256 of the header: changes whenever counts, sizes or checksums change."""
        return hashlib.sha256(self._header).hexdigest()

    def info(self) -> ShardInfo:
        return ShardInfo(
            name=self.prefix.name, num_docs=self.num_docs, num_sentences=self.num_sentences,
            num_tokens=self.num_tokens, bin_bytes=self.bin_bytes, idx_bytes=self.idx_bytes,
            bin_crc32=self.bin_crc32, idx_crc32=self.idx_crc32, max_token_id=self.max_token_id,
        )

    def sentence(self, i: int) -> np.ndarray:
        """Token ids of sentence ``i``: (len,) view into the memory map."""
        if not 0 <= i < self.num_sentences:
            raise IndexError(f"{self.prefix}: sentence {i} out of range [0, {self.num_sentences})")
        return self.tokens[self.sentence_offsets[i] : self.sentence_offsets[i + 1]]

    def document(self, d: int) -> list[np.ndarray]:
        """The sentences of document ``d``, each a (len,) view."""
        if not 0 <= d < self.num_docs:
            raise IndexError(f"{self.prefix}: document {d} out of range [0, {self.num_docs})")
        o = self.sentence_offsets
        return [self.tokens[o[i] : o[i + 1]] for i in range(self.doc_bounds[d], self.doc_bounds[d + 1])]

    def verify(self) -> None:
        """Read both files fully: checksums, sizes and max token id against the header."""
        crc, top, pos = 0, 0, 0
        with _reading():
            size = os.stat(self.bin_path).st_size
            if size != self.bin_bytes:
                raise self._fail(self.bin_path, f"size changed since open: {size} bytes, the index says {self.bin_bytes}")
            with open(self.bin_path, "rb") as f:
                buf = bytearray(_READ_BLOCK - _READ_BLOCK % self.dtype.itemsize)
                while n := f.readinto(buf):
                    block = memoryview(buf)[:n]
                    crc = zlib.crc32(block, crc)
                    ids = np.frombuffer(block, dtype=self.dtype)
                    if ids.size:
                        m = int(ids.max())
                        if m > self.max_token_id:
                            at = pos + int(np.argmax(ids > self.max_token_id))
                            raise self._fail(self.bin_path, f"token id {m} at token offset {at} exceeds the "
                                                            f"header's max_token_id {self.max_token_id}")
                        top = max(top, m)
                    pos += ids.size
            with open(self.idx_path, "rb") as f:
                f.seek(HEADER_SIZE)
                idx_crc = 0
                while block := f.read(_READ_BLOCK):
                    idx_crc = zlib.crc32(block, idx_crc)
        if crc != self.bin_crc32:
            raise self._fail(self.bin_path, f"checksum mismatch: crc32 {crc:#010x}, the index says {self.bin_crc32:#010x}")
        if top != self.max_token_id and self.num_tokens:
            raise self._fail(self.bin_path, f"max token id is {top}, the index says {self.max_token_id}")
        if idx_crc != self.idx_crc32:
            raise self._fail(self.idx_path, f"index checksum mismatch: crc32 {idx_crc:#010x}, header says {self.idx_crc32:#010x}")

    def close(self) -> None:
        """Release the memory map and the index read for the properties (views handed out keep
        them alive until dropped)."""
        self.__dict__.pop("tokens", None)
        self.__dict__.pop("_index", None)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
