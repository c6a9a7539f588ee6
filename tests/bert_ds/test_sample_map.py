"""The sample map: BERT's chunking rules against a plain reference, and one build per dataset
however many processes open it, whatever happens to the builder."""

import hashlib
import pickle
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bert_ds.data_tools.manifest import open_dataset
from bert_ds.loader import sample_map
from bert_ds.data_tools.shard_format import FileArray
from bert_ds.loader.sample_map import (COUNT_BITS, MAP_DTYPE, ChunkTargets, bases, build_sample_map, kept_documents,
                                      open_sample_map, open_sentence_index)
from tests.conftest import SAMPLE, cli_env, end, run_cli, run_command, spawn


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The bundled corpus (both files) in several shards."""
    root = tmp_path_factory.mktemp("sample-map")
    run_cli("bert_ds.data_tools", "build", "--input", str(SAMPLE / "valid.txt"), str(SAMPLE / "test.txt"),
            "--output", str(root / "data"), "--train-vocab", "2048", "--split-sentences", "--workers", "1",
            "--shard-tokens", "150000")
    return root / "data"


def reference_map(readers, max_num_tokens, target_of, split="all", held_out=0.0):
    """BERT's chunking, one sentence at a time: a chunk takes sentences until its tokens reach
    the target drawn for its first sentence, or its document ends."""
    rows = []
    for s, reader in enumerate(readers):
        lengths = reader.sentence_lengths.tolist()
        bounds = reader.doc_bounds.tolist()
        targets = target_of(s, reader.num_sentences)
        keep = kept_documents(s, reader.num_docs, split, held_out)
        for d in range(reader.num_docs):
            if not keep[d]:
                continue
            first, last = bounds[d], bounds[d + 1]
            while first < last:
                target, tokens, end_ = int(targets[first]), 0, first
                while end_ < last and tokens < target:
                    tokens += lengths[end_]
                    end_ += 1
                rows.append((s, d, first, end_, target))
                first = end_
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def unpack(packed, readers):
    """(N, 3) int64 (shard, first, end) of a packed map, sentences numbered within each shard."""
    first = (packed >> np.uint64(COUNT_BITS)).astype(np.int64)
    count = (packed & np.uint64((1 << COUNT_BITS) - 1)).astype(np.int64)
    starts = np.asarray(bases([r.num_sentences for r in readers]), dtype=np.int64)
    shard = np.searchsorted(starts, first, side="right") - 1
    return np.stack([shard, first - starts[shard], first - starts[shard] + count], axis=1)


@pytest.mark.parametrize("walk", ["rounds", "walks", "both"])
@pytest.mark.parametrize("max_num_tokens, short_seq_prob, split", [
    (125, 0.1, "all"), (61, 0.5, "train"), (509, 0.0, "held_out"), (13, 1.0, "all"),
])
def test_map_is_bert_chunking_for_the_same_target_draws(shards, max_num_tokens, short_seq_prob, split, walk,
                                                        monkeypatch):
    # every document in rounds, every document walked alone (in windows of 5 sentences), or
    # rounds until few documents are open, as the build does
    monkeypatch.setattr(sample_map, "_FEW_OPEN", {"rounds": 0, "walks": 10**9, "both": 40}[walk])
    monkeypatch.setattr(sample_map, "_WALK_WINDOW", 5)
    _, readers = open_dataset(shards)
    assert len(readers) >= 3
    seed = 11

    targets = ChunkTargets(seed, max_num_tokens, short_seq_prob)

    def target_of(shard, n):
        return targets.many(shard, np.arange(n))

    got = build_sample_map(readers, max_num_tokens, short_seq_prob, seed, split, held_out=0.3)
    want = reference_map(readers, max_num_tokens, target_of, split, held_out=0.3)
    assert got.dtype == MAP_DTYPE and len(want) > 100
    np.testing.assert_array_equal(unpack(got, readers), want[:, [0, 2, 3]])
    short = want[:, 4] < max_num_tokens  # a short draw is uniform in [2, max]: it may be max itself
    assert abs(short.mean() - short_seq_prob * (max_num_tokens - 2) / (max_num_tokens - 1)) < 0.03
    assert ((want[:, 4] >= 2) & (want[:, 4] <= max_num_tokens)).all()


def test_target_draws_and_map_do_not_depend_on_how_the_build_is_batched(shards, monkeypatch):
    _, readers = open_dataset(shards)
    whole = build_sample_map(readers, 125, 0.1, 3)
    targets = ChunkTargets(3, 125, 0.1)
    sentences = np.arange(readers[1].num_sentences)
    # the loader's scalar draw (Python ints) is the build's array draw, and an array's draws
    # do not depend on the others in it
    one_by_one = [targets.one(1, i) for i in sentences.tolist()]
    assert targets.many(1, sentences).tolist() == one_by_one
    assert [int(targets.many(1, np.array([i]))[0]) for i in range(50)] == one_by_one[:50]
    assert min(one_by_one) < 125 and ChunkTargets(4, 125, 0.1).many(1, sentences).tolist() != one_by_one
    monkeypatch.setattr(sample_map, "_BUILD_BLOCK", 7)  # documents per build step
    np.testing.assert_array_equal(build_sample_map(readers, 125, 0.1, 3), whole)
    assert not np.array_equal(build_sample_map(readers, 125, 0.1, 4), whole)  # the seed matters


def test_map_and_index_are_read_from_the_cache_and_never_mapped(shards, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shards, data, ignore=shutil.ignore_patterns(".cache"))
    _, readers = open_dataset(data)
    first = open_sample_map(data, readers, 125, 0.1, 0)
    again = open_sample_map(data, readers, 125, 0.1, 0)
    assert isinstance(again, FileArray) and first.path == again.path and first.path.parent == data / ".cache"
    whole = build_sample_map(readers, 125, 0.1, 0)
    np.testing.assert_array_equal(again[0:len(again)], whole)
    assert again[len(again) - 1] == int(whole[-1])  # one element: a Python int
    # the map file: an .npy header and 8 bytes per sample, nothing else
    assert again.path.stat().st_size - again.offset == 8 * len(whole)
    # pickled as its path: a loader worker reads the same file
    assert len(pickle.dumps(again)) < 1000 and pickle.loads(pickle.dumps(again)).ints(0, 5) == whole[:5].tolist()

    offsets, bounds = open_sentence_index(data, readers)
    np.testing.assert_array_equal(offsets[0:len(offsets)], np.concatenate([r.sentence_offsets for r in readers]))
    np.testing.assert_array_equal(bounds[0:len(bounds)], np.concatenate([r.doc_bounds for r in readers]))


# -- one build per dataset, in separate processes --------------------------------------------------

_OPENER = """
import hashlib, logging, sys, time
from pathlib import Path
import numpy as np
from bert_ds.data_tools.manifest import open_dataset
from bert_ds.loader import sample_map

logging.basicConfig(level=logging.INFO, format="%(message)s")
data, start, mode, marker = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
build = sample_map._map_parts

def slow_build(*args, **kwargs):  # long enough that every opener arrives while it runs
    time.sleep(1.5)
    return build(*args, **kwargs)

def stuck_build(*args, **kwargs):
    marker.touch()
    time.sleep(600)

def stuck_write(f, header):  # the header and a few rows under the temporary name, then stuck
    write_header(f, header)
    f.write(np.arange(15, dtype=np.int32).tobytes())
    f.flush()
    marker.touch()
    time.sleep(600)

if mode == "slow":
    sample_map._map_parts = slow_build
elif mode == "stuck-build":
    sample_map._map_parts = stuck_build
elif mode == "stuck-write":
    write_header = np.lib.format.write_array_header_1_0
    np.lib.format.write_array_header_1_0 = stuck_write
_, readers = open_dataset(data)
time.sleep(max(0.0, start - time.time()))
mapped = sample_map.open_sample_map(data, readers, 125, 0.1, 5)
print(hashlib.sha256(mapped[0:len(mapped)].tobytes()).hexdigest(), mapped.path, type(mapped).__name__)
"""


def _opener(data, mode, marker, start=0.0):
    env = {**cli_env(), "XDG_CACHE_HOME": str(data.parent / "user-cache")}
    return [sys.executable, "-c", _OPENER, str(data), str(start), mode, str(marker)], env


def _fresh_copy(shards, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shards, data, ignore=shutil.ignore_patterns(".cache"))
    _, readers = open_dataset(data)
    expected = hashlib.sha256(build_sample_map(readers, 125, 0.1, 5).tobytes()).hexdigest()
    return data, expected


def test_concurrent_cold_opens_build_once_and_share_the_map(shards, tmp_path):
    data, expected = _fresh_copy(shards, tmp_path)
    start = time.time() + 3.0  # every opener has imported numpy and opened the shards by then
    procs = []
    for _ in range(3):
        cmd, env = _opener(data, "slow", tmp_path / "unused", start)
        procs.append(spawn(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    builds = sum(err.count("sample map built") for _, err in outputs)
    assert builds == 1, outputs
    lines = [out.split() for out, _ in outputs]
    assert {line[0] for line in lines} == {expected}
    (path,) = {line[1] for line in lines}
    assert path.startswith(str(data / ".cache") + "/")
    assert {line[2] for line in lines} == {"FileArray"}


@pytest.mark.parametrize("where", ["stuck-build", "stuck-write"])
def test_a_builder_killed_mid_way_neither_blocks_nor_corrupts_the_next_open(shards, tmp_path, where):
    data, expected = _fresh_copy(shards, tmp_path)
    marker = tmp_path / "holding-the-lock"
    cmd, env = _opener(data, where, marker)
    builder = spawn(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not marker.exists():
        assert builder.poll() is None and time.time() < deadline, builder.communicate()
        time.sleep(0.05)
    if where == "stuck-write":
        assert list((data / ".cache").glob("*.npy.tmp")), "the builder had started writing"
    builder.send_signal(signal.SIGKILL)
    end(builder)

    cmd, env = _opener(data, "plain", marker)
    after = run_command(cmd, timeout=60, env=env)  # a lock left held would time this out
    assert after.returncode == 0, after.stderr
    assert after.stderr.count("sample map built") == 1
    assert after.stdout.split()[0] == expected
    assert not list((data / ".cache").glob("*.tmp"))


def test_a_drawing_process_keeps_few_token_files_open(shards):
    """A corpus of thousands of shards must not hold a descriptor per shard in every process:
    token files open as they are drawn from, at most ``open_files`` at a time (a share of the
    process's limit), and the samples do not depend on which are open."""
    import resource

    from bert_ds.config import DataConfig
    from bert_ds.loader import pretraining

    cfg = DataConfig(train=str(shards))
    unbounded = pretraining.PretrainingDataset(shards, cfg, seed=4)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert unbounded.open_files == max(64, soft // 4) and unbounded.open_files < soft
    positions = range(0, len(unbounded), 3)
    expected = [unbounded[p]["input_ids"].tolist() for p in positions]
    assert len(unbounded._token_files) >= 3
    bounded = pretraining.PretrainingDataset(shards, cfg, seed=4)
    bounded.open_files = 2
    shards_drawn = set()
    for p, want in zip(positions, expected, strict=True):
        assert bounded[p]["input_ids"].tolist() == want
        shards_drawn.add(bounded.chunk(bounded.permutation(0)(p))[0])
        assert len(bounded._token_files) <= 2
    assert len(shards_drawn) >= 3


def test_a_corpus_of_more_shards_than_the_open_file_limit_opens_and_draws(tmp_path):
    """Opening checks every shard but holds no descriptor for any (the token files are mapped or
    opened when read), so a corpus of over 300 shards opens, verifies and draws under a limit of 256."""
    from bert_ds.data_tools.bench import write_synthetic

    data = tmp_path / "many"
    write_synthetic(data, 800_000, shard_tokens=2000)
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from bert_ds.config import DataConfig\n"
        "from bert_ds.data_tools.verify import verify_dataset\n"
        "from bert_ds.loader.pretraining import PretrainingDataset\n"
        "problems, manifest = verify_dataset(sys.argv[1])\n"
        "ds = PretrainingDataset(sys.argv[1], DataConfig(train=sys.argv[1]), seed=0)\n"
        "drawn = {ds.chunk(ds.permutation(0)(p))[0] for p in range(len(ds)) if ds[p] is not None}\n"
        "print(len(manifest.shards), problems, len(drawn), ds.open_files, len(ds._token_files))\n"
    )
    proc = run_command([sys.executable, "-c", script, str(data)], timeout=300, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards, problems, drawn, allowed, held = proc.stdout.split(" ", 1)[0], *proc.stdout.split()[1:]
    assert int(shards) > 256 and problems == "[]" and int(drawn) == int(shards)
    assert int(allowed) == 64 and int(held) <= 64
