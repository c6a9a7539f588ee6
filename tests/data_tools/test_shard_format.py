"""The shard format: writer/reader round trip, crash safety, and R4 (every kind of damage
is one ShardError naming the file), opening cost, R10 fingerprints."""

import os
import statistics
import time
import zlib

import numpy as np
import pytest

from bert_ds.base.errors import ShardError, UserError
from bert_ds.data_tools.shard_format import (
    HEADER, HEADER_SIZE, MAX_SENTENCE_TOKENS, ShardInfo, ShardReader, ShardWriter, token_dtype,
)


def random_docs(rng, n_docs, vocab_size, max_sentences=12, max_len=40):
    def sentence():
        return rng.integers(0, vocab_size, size=int(rng.integers(1, max_len + 1)))

    return [[sentence() for _ in range(int(rng.integers(1, max_sentences + 1)))] for _ in range(n_docs)]


def write_shard(prefix, docs, vocab_size):
    with ShardWriter(prefix, vocab_size) as w:
        for d in docs:
            w.add_document(d)
        return w.close()


@pytest.fixture
def shard(tmp_path):
    """(prefix, docs, info) of a small valid uint16 shard."""
    rng = np.random.default_rng(0)
    docs = random_docs(rng, 37, 30522) + [[np.array([7, 8]), np.array([9]), np.array([10, 11, 12])]]
    prefix = tmp_path / "shard_00000"
    return prefix, docs, write_shard(prefix, docs, 30522)


def test_round_trip(shard):
    prefix, docs, info = shard
    with ShardReader(prefix) as r:
        assert r.dtype == np.dtype("<u2")
        assert (r.num_docs, r.num_sentences) == (len(docs), sum(len(d) for d in docs))
        assert r.num_tokens == sum(s.size for d in docs for s in d)
        assert r.max_token_id == max(int(s.max()) for d in docs for s in d)
        assert r.info() == info
        assert info.bin_bytes == 2 * r.num_tokens == os.path.getsize(f"{prefix}.bin")
        assert info.idx_bytes == os.path.getsize(f"{prefix}.idx")
        assert r.doc_bounds[0] == 0 and r.doc_bounds[-1] == r.num_sentences
        assert r.sentence_offsets[-1] == r.num_tokens
        i = 0
        for d, doc in enumerate(docs):
            got = r.document(d)
            assert len(got) == len(doc)
            for a, b in zip(got, doc, strict=True):
                np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(r.sentence(i), b)
                i += 1
        r.verify()
        with pytest.raises(IndexError):
            r.document(len(docs))


def test_uint32_for_large_vocab(tmp_path):
    docs = [[np.array([0, 65536, 69999]), np.array([70000 - 1])]]
    info = write_shard(tmp_path / "s", docs, 70000)
    with ShardReader(tmp_path / "s") as r:
        assert r.dtype == np.dtype("<u4") and info.bin_bytes == 16
        np.testing.assert_array_equal(r.document(0)[0], [0, 65536, 69999])
        assert r.max_token_id == 69999
        r.verify()
    assert token_dtype(65536) == np.dtype("<u2") and token_dtype(65537) == np.dtype("<u4")


def test_sentence_over_65535_tokens_is_split_in_pieces(tmp_path):
    n = 2 * MAX_SENTENCE_TOKENS + 7
    long = np.arange(n) % 1000
    write_shard(tmp_path / "s", [[np.array([5, 6]), long], [np.array([9])]], 1000)
    with ShardReader(tmp_path / "s") as r:
        assert r.sentence_lengths.tolist() == [2, MAX_SENTENCE_TOKENS, MAX_SENTENCE_TOKENS, 7, 1]
        assert r.doc_bounds.tolist() == [0, 4, 5]
        np.testing.assert_array_equal(np.concatenate(r.document(0)[1:]), long)


@pytest.mark.parametrize("bad", [-1, 100])
def test_writer_rejects_ids_outside_vocab_and_leaves_no_file(tmp_path, bad):
    prefix = tmp_path / "s"
    with pytest.raises(ShardError, match=rf"s\.bin: token id {bad} at position 2 of document 1"):
        with ShardWriter(prefix, 100) as w:
            w.add_document([np.array([1, 2, 3])])
            w.add_document([np.array([4, 5, bad], dtype=np.int64)])
    assert os.listdir(tmp_path) == []


def test_writer_rejects_empty_document_and_sentence(tmp_path):
    with ShardWriter(tmp_path / "s", 100) as w:
        with pytest.raises(ShardError, match="no sentences"):
            w.add_document([])
        with pytest.raises(ShardError, match="empty sentence"):
            w.add_document([np.array([1]), np.array([], dtype=np.int64)])
    assert os.listdir(tmp_path) == []


def test_failed_close_leaves_no_file_under_a_final_name(tmp_path, monkeypatch):
    calls = []

    def failing_write(self, f, data):
        calls.append(f.name)
        if str(f.name).endswith(".idx.tmp"):
            raise OSError(28, "No space left on device")
        f.write(data)

    monkeypatch.setattr(ShardWriter, "_write", failing_write)
    w = ShardWriter(tmp_path / "s", 100)
    w.add_document([np.array([1, 2])])
    with pytest.raises(OSError, match="No space"):
        w.close()
    assert any(c.endswith(".idx.tmp") for c in calls)
    assert os.listdir(tmp_path) == []


# -- R4: damage --------------------------------------------------------------------------

def _header(prefix):
    with open(f"{prefix}.idx", "rb") as f:
        return list(HEADER.unpack(f.read(HEADER_SIZE)))


def _rewrite(prefix, fields=None, body=None, fix_crc=True):
    """Rewrite the .idx with changed header fields and/or body, keeping its crc valid."""
    path = f"{prefix}.idx"
    data = open(path, "rb").read()
    h = list(HEADER.unpack(data[:HEADER_SIZE]))
    b = data[HEADER_SIZE:] if body is None else body
    for i, v in (fields or {}).items():
        h[i] = v
    if fix_crc:
        h[9] = zlib.crc32(b)
    with open(path, "wb") as f:
        f.write(HEADER.pack(*h) + b)


def _body(prefix):
    h = _header(prefix)
    data = open(f"{prefix}.idx", "rb").read()[HEADER_SIZE:]
    bounds = np.frombuffer(data, "<u8", count=h[3] + 1).copy()
    lengths = np.frombuffer(data, "<u2", offset=8 * (h[3] + 1)).copy()
    return bounds, lengths


def _truncate(path, nbytes):
    with open(path, "rb+") as f:
        f.truncate(os.path.getsize(path) - nbytes)


def _damage_bounds(prefix, fn):
    bounds, lengths = _body(prefix)
    fn(bounds)
    _rewrite(prefix, body=bounds.tobytes() + lengths.tobytes())


def _damage_lengths(prefix, fn, fix_crc=True):
    bounds, lengths = _body(prefix)
    fn(lengths)
    _rewrite(prefix, body=bounds.tobytes() + lengths.tobytes(), fix_crc=fix_crc)


def _swap_first_two_lengths(lengths):
    lengths[[0, 1]] = lengths[[1, 0]]
    if lengths[0] == lengths[1]:  # make the swap visible while keeping the sum
        lengths[0] += 1
        lengths[1] -= 1


def _set(i, value):
    """An in-place edit of a numpy array: a[i] = value(a)."""
    def edit(a):
        a[i] = value(a)
    return edit


# case: (damage(prefix), file suffix named in the error, message fragment)
DAMAGE = {
    "bad magic": (lambda p: _rewrite(p, {0: b"MEGATRON"}), ".idx", "bad magic"),
    "wrong version": (lambda p: _rewrite(p, {1: 2}), ".idx", "unsupported format version 2"),
    "wrong dtype code": (lambda p: _rewrite(p, {2: 7}), ".idx", "unknown dtype code 7"),
    "dtype code of the other width": (lambda p: _rewrite(p, {2: 2}), ".idx", "header inconsistent"),
    "truncated idx": (lambda p: _truncate(f"{p}.idx", 3), ".idx", "truncated"),
    "truncated idx header": (
        lambda p: _truncate(f"{p}.idx", os.path.getsize(f"{p}.idx") - 20), ".idx", "truncated: 20 bytes"),
    "truncated bin": (lambda p: _truncate(f"{p}.bin", 2), ".bin", "truncated"),
    "missing bin": (lambda p: os.unlink(f"{p}.bin"), ".bin", "missing"),
    "doc pointer past end": (
        lambda p: _damage_bounds(p, _set(-1, lambda b: b[-1] + 10)), ".idx", "past the end"),
    "doc pointers not monotonic": (
        lambda p: _damage_bounds(p, _set(1, lambda b: b[2] + 1)), ".idx", "empty or reversed"),
    "last doc short of the end": (
        lambda p: _damage_bounds(p, _set(-1, lambda b: b[-1] - 1)), ".idx", "last document ends at sentence"),
    "num_docs count mismatch": (lambda p: _rewrite(p, {3: _header(p)[3] + 1}), ".idx", "truncated"),
    "sentence lengths vs num_tokens": (
        lambda p: _damage_lengths(p, _set(0, lambda n: n[0] + 1)), ".idx", "sentence lengths sum to"),
    "zero-length sentence": (lambda p: _damage_lengths(p, _set(3, lambda n: 0)), ".idx", "has zero tokens"),
    "idx body changed, crc kept": (
        lambda p: _damage_lengths(p, _swap_first_two_lengths, fix_crc=False), ".idx", "index checksum mismatch"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_is_one_shard_error_naming_the_file(shard, case):
    prefix, _, _ = shard
    damage, suffix, message = DAMAGE[case]
    damage(prefix)
    with pytest.raises(ShardError) as e:
        ShardReader(prefix).verify()
    assert f"{prefix}{suffix}" in str(e.value)
    if message:
        assert message in str(e.value)
    assert isinstance(e.value, UserError)


def test_flipped_byte_in_bin_is_caught_by_verify(shard):
    prefix, _, _ = shard
    size = os.path.getsize(f"{prefix}.bin")
    with open(f"{prefix}.bin", "rb+") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x01]))  # low bit: the id stays inside the vocabulary
    with ShardReader(prefix) as r:  # opening reads only the index: still fine
        with pytest.raises(ShardError, match=r"shard_00000\.bin: checksum mismatch"):
            r.verify()


def test_token_above_header_max_is_located(shard):
    prefix, _, info = shard
    with open(f"{prefix}.bin", "rb+") as f:
        f.seek(2 * 5)
        f.write(np.array([info.max_token_id + 1], "<u2").tobytes())
    with ShardReader(prefix) as r:
        with pytest.raises(ShardError, match=rf"shard_00000\.bin: token id {info.max_token_id + 1} at token offset 5"):
            r.verify()


def test_open_is_cheap_for_tens_of_millions_of_tokens(tmp_path):
    rng = np.random.default_rng(1)
    n_tokens, sent_len, sents_per_doc = 20_000_000, 25, 40
    n_sent = n_tokens // sent_len
    tokens = rng.integers(0, 30522, size=n_tokens, dtype=np.uint16)
    with ShardWriter(tmp_path / "big", 30522) as w:
        lengths = np.full(sents_per_doc, sent_len)
        for d in range(n_sent // sents_per_doc):
            start = d * sents_per_doc * sent_len
            w.add_sentences(tokens[start : start + sents_per_doc * sent_len], lengths)
            w.end_document()
        info = w.close()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        r = ShardReader(tmp_path / "big")
        times.append(time.perf_counter() - t)
        r.close()
    ms = 1000 * statistics.median(times)
    per_token = (info.bin_bytes + info.idx_bytes) / info.num_tokens
    print(f"\nR4 open: {info.num_tokens:,} tokens, {info.num_sentences:,} sentences: {ms:.1f} ms median; "
          f"{per_token:.3f} bytes/token on disk")
    assert ms < 100
    assert per_token <= 2.2


def test_fingerprint_follows_content_not_path(tmp_path):
    """R10: a cache keyed by the fingerprint is rebuilt when the shard changes in place."""
    prefix = tmp_path / "s"
    write_shard(prefix, [[np.array([1, 2, 3])]], 100)
    first = ShardReader(prefix).fingerprint
    write_shard(prefix, [[np.array([1, 2, 3])]], 100)
    assert ShardReader(prefix).fingerprint == first  # same content, same key
    write_shard(prefix, [[np.array([1, 2, 4])]], 100)  # same sizes, other tokens
    assert ShardReader(prefix).fingerprint != first


def test_shard_info_fields():
    assert [f for f in ShardInfo.__dataclass_fields__] == [
        "name", "num_docs", "num_sentences", "num_tokens", "bin_bytes", "idx_bytes",
        "bin_crc32", "idx_crc32", "max_token_id",
    ]


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_an_index_checked_in_blocks_is_refused_as_one_checked_whole(shard, case, monkeypatch):
    """An open reads the index a block at a time and keeps none of it: the same error names
    the same place whatever the block size (problems straddling a block end included)."""
    from bert_ds.data_tools import shard_format

    prefix, _, _ = shard
    DAMAGE[case][0](prefix)
    messages = set()
    for block in (1 << 20, 3, 1):
        monkeypatch.setattr(shard_format, "_INDEX_BLOCK", block)
        with pytest.raises(ShardError) as e:
            ShardReader(prefix)
        messages.add(str(e.value))
    assert len(messages) == 1, messages


def test_an_open_reader_keeps_no_index_until_asked(shard, monkeypatch):
    from bert_ds.data_tools import shard_format

    prefix, docs, _ = shard
    monkeypatch.setattr(shard_format, "_INDEX_BLOCK", 5)
    with ShardReader(prefix) as r:
        assert not [k for k, v in vars(r).items() if isinstance(v, np.ndarray) and k != "tokens"]
        index = r.read_index()
        assert "_index" not in vars(r)  # read_index keeps nothing: a consumer frees each shard's in turn
        assert index.bounds.dtype == index.offsets.dtype == np.int64
        assert index.lengths.tolist() == [len(s) for d in docs for s in d]
        assert index.bounds.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()
        np.testing.assert_array_equal(index.offsets, np.cumsum([0] + index.lengths.tolist()))
        np.testing.assert_array_equal(r.sentence_offsets, index.offsets)  # the properties read it once
        assert "_index" in vars(r)
    # a shard rewritten under the same name after the open is not read as the one opened
    r = ShardReader(prefix)
    write_shard(prefix, docs[:3], 30522)
    with pytest.raises(ShardError, match=r"shard_00000\.idx: changed since the shard was opened"):
        r.read_index()


def test_file_array_reads_what_the_memory_map_holds(shard):
    import pickle

    from bert_ds.data_tools.shard_format import FileArray

    prefix, _, info = shard
    with ShardReader(prefix) as r:
        tokens = FileArray(f"{prefix}.bin", r.dtype, r.num_tokens)
        assert len(tokens) == r.num_tokens
        for lo, hi in ((0, 5), (17, 90), (r.num_tokens - 3, r.num_tokens), (4, 4), (10, r.num_tokens + 9)):
            np.testing.assert_array_equal(tokens[lo:hi], r.tokens[lo:hi])
        assert tokens[lo:hi].dtype == r.dtype
        again = pickle.loads(pickle.dumps(tokens))  # a worker opens the file itself
        np.testing.assert_array_equal(again[3:40], r.tokens[3:40])
        shifted = FileArray(f"{prefix}.bin", r.dtype, r.num_tokens - 8, offset=8 * r.dtype.itemsize)
        np.testing.assert_array_equal(shifted[0:5], r.tokens[8:13])
    _truncate(f"{prefix}.bin", info.bin_bytes // 2)
    with pytest.raises(ShardError, match=r"shard_00000\.bin: truncated"):
        tokens[info.num_tokens - 4: info.num_tokens]
