"""Partitioned builds: the same build command started N times (by torchrun, or with --part I/N)
builds N parts whose union is a single build's documents and tokens, whatever the input kind
and wherever the cuts fall; one vocabulary trained once for all; a lost part rebuilt alone;
the parent folder's refusals; verify and inspect of a parent; the user errors of --part."""

import gzip
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bert_ds.base.errors import ShardError
from bert_ds.data_tools.__main__ import main
from bert_ds.data_tools.build import BuildOptions, build
from bert_ds.data_tools.manifest import Manifest, open_dataset
from bert_ds.data_tools.partition import Part, dataset_folders, part_name
from tests.conftest import SAMPLE, run_cli

INPUTS = [str(SAMPLE / "valid.txt"), str(SAMPLE / "test.txt")]
QUIET = dict(workers=1, progress=False)
SHARD_TOKENS = "100000"


def documents(folders):
    """Every document of the folders, in order, as a tuple of sentences of token ids."""
    docs = []
    for folder in folders:
        _, readers = open_dataset(folder)
        for r in readers:
            docs += [tuple(tuple(s.tolist()) for s in r.document(d)) for d in range(r.num_docs)]
            r.close()
    return docs


def tree(folder):
    """{relative path: bytes} of every file under ``folder``."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_union_is_single(parent, single):
    folders = dataset_folders(parent)
    want = documents([single])
    assert documents(folders) == want and len(want) > 0
    parts, whole = [Manifest.load(f) for f in folders], Manifest.load(single)
    for key in ("docs", "sentences", "tokens"):
        assert sum(m.totals[key] for m in parts) == whole.totals[key]
    for key in ("documents_in", "documents_written", "input_bytes", "lines", "headings_dropped"):
        assert sum(m.stats[key] for m in parts) == whole.stats[key], key
    assert sum(m.stats["documents_skipped"]["empty"] for m in parts) == whole.stats["documents_skipped"]["empty"]
    keys = {m.build["partition"]["corpus_key"] for m in parts}
    assert len(keys) == 1 and [m.build["partition"]["index"] for m in parts] == list(range(len(folders)))
    return parts


def build_parts(inputs, parent, count, vocab, **opts):
    for i in range(count):
        build(BuildOptions(inputs=inputs, output=str(parent), vocab=vocab, part=Part(i, count, "--part"),
                           **QUIET, **opts))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A single build of the bundled corpus (both files) with a vocabulary trained on it."""
    out = tmp_path_factory.mktemp("single") / "ds"
    build(BuildOptions(inputs=INPUTS, output=str(out), train_vocab=2048, **QUIET))
    return out


@pytest.fixture(scope="module")
def by_flag(single, tmp_path_factory):
    """The same corpus in 3 parts, built with --part I/3 one after another."""
    parent = tmp_path_factory.mktemp("flag") / "parts"
    for i in range(3):
        code = main(["build", "--input", *INPUTS, "--output", str(parent), "--vocab", str(single / "vocab.txt"),
                     "--workers", "1", "--shard-tokens", SHARD_TOKENS, "--no-progress", "--part", f"{i}/3"])
        assert code == 0
    return parent


def test_torchrun_and_part_flags_build_the_same_parts_whose_union_is_the_single_build(single, by_flag, tmp_path):
    parent = tmp_path / "parts"
    proc = run_cli("bert_ds.data_tools", "build", "--input", *INPUTS, "--output", str(parent), "--vocab",
                   str(single / "vocab.txt"), "--workers", "1", "--shard-tokens", SHARD_TOKENS, nproc=3)
    for i in range(3):
        assert f"part {i}/3 (torchrun: RANK/WORLD_SIZE): " in proc.stdout
    assert sorted(p.name for p in parent.iterdir()) == [part_name(i, 3) for i in range(3)]
    assert tree(parent) == tree(by_flag)  # byte-identical, whoever started the processes
    parts = assert_union_is_single(parent, single)
    # Both inputs are larger than a share: each cut fell inside a file, at a title (heading mode).
    ranges = [s for m in parts for s in m.sources if "range" in s]
    assert len(ranges) == 4 and all(m.totals["docs"] > 0 for m in parts)


def test_vocabulary_is_trained_once_for_all_parts_under_torchrun(single, tmp_path):
    parent = tmp_path / "parts"
    # No --workers: 3 processes on this host share its CPUs (LOCAL_WORLD_SIZE).
    proc = run_cli("bert_ds.data_tools", "build", "--input", *INPUTS, "--output", str(parent), "--train-vocab",
                   "2048", "--shard-tokens", SHARD_TOKENS, "--no-progress", nproc=3)
    out = proc.stdout + proc.stderr
    assert out.count("training") == 1, out
    vocabs = {(parent / part_name(i, 3) / "vocab.txt").read_bytes() for i in range(3)}
    # Trained on all inputs, as a single build trains it.
    assert vocabs == {(single / "vocab.txt").read_bytes()}
    assert (parent / "tokenizer" / "vocab.txt").read_bytes() == (single / "vocab.txt").read_bytes()
    record = json.loads((parent / "tokenizer" / "trained_from.json").read_text())
    assert record["train_vocab"] == 2048 and [p for p, _ in record["inputs"]] == INPUTS
    assert_union_is_single(parent, single)
    # A rerun: every part is already built, nothing trained or written.
    before = tree(parent)
    again = run_cli("bert_ds.data_tools", "build", "--input", *INPUTS, "--output", str(parent), "--train-vocab",
                    "2048", "--workers", "1", "--shard-tokens", SHARD_TOKENS, "--no-progress", nproc=3)
    assert again.stdout.count("already built") == 3 and "training" not in again.stdout + again.stderr
    assert tree(parent) == before


# -- cuts in every input kind -------------------------------------------------------------------

WORDS = ("alpha beta gamma delta river stone light house north summer winter paper glass "
         "music table green quiet").split()


def sentence(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "."


def paragraphs(n, seed=0):
    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(rng.randint(1, 6))) for _ in range(n)]


def write_blank(path, n, seed=0):
    rng = random.Random(seed)
    docs = ["\n".join(sentence(rng) for _ in range(rng.randint(1, 8))) for _ in range(n)]
    path.write_text("\n\n".join(docs) + "\n")
    return str(path)


def write_wikitext(path, n, seed=0):
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        lines += ["", f" = Article {i} = ", ""]
        for _ in range(rng.randint(1, 4)):
            lines += [" = = Section = = ", "", " ".join(sentence(rng) for _ in range(3)), ""]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_jsonl(path, n, seed=0):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in paragraphs(n, seed)))
    return str(path)


def write_parquet(path, n, seed=0):
    pq.write_table(pa.table({"text": paragraphs(n, seed)}), path, row_group_size=7)
    return str(path)


def write_gz(path, n, seed=0):
    text = Path(write_blank(path.with_suffix(""), n, seed)).read_bytes()
    path.write_bytes(gzip.compress(text, mtime=0))
    return str(path)


@pytest.mark.parametrize("kind, count, make, where", [
    ("blank", 4, lambda d: [write_blank(d / "a.txt", 300)], "range"),
    ("heading", 3, lambda d: [write_wikitext(d / "w.txt", 120)], "range"),
    ("jsonl", 3, lambda d: [write_jsonl(d / "r.jsonl", 250)], "range"),
    ("parquet", 3, lambda d: [write_parquet(d / "r.parquet", 250)], "rows"),
    ("gz", 2, lambda d: [write_gz(d / "big.txt.gz", 300), write_blank(d / "small.txt", 30, seed=1)], None),
])
def test_every_input_kind_is_cut_without_losing_or_doubling_a_document(single, tmp_path, kind, count, make,
                                                                        where):
    inputs = make(tmp_path)
    vocab = str(single / "vocab.txt")
    whole = tmp_path / "single"
    build(BuildOptions(inputs=inputs, output=str(whole), vocab=vocab, **QUIET))
    build_parts(inputs, tmp_path / "parts", count, vocab)
    parts = assert_union_is_single(tmp_path / "parts", whole)
    cut = [s for m in parts for s in m.sources if where and where in s]
    if where:
        assert len(cut) >= 2, [m.sources for m in parts]
        assert cut[0][where][1] == cut[1][where][0]  # neighbours agree on the cut
    else:  # the .gz cannot be read from the middle: one part reads it whole
        gz = [s for m in parts for s in m.sources if s["path"].endswith(".gz")]
        assert len(gz) == 1 and "range" not in gz[0]


def test_an_empty_share_is_an_empty_dataset(single, tmp_path):
    inputs = [write_blank(tmp_path / "tiny.txt", 2)]
    build_parts(inputs, tmp_path / "parts", 3, str(single / "vocab.txt"))
    folders = dataset_folders(tmp_path / "parts")
    manifests = [Manifest.load(f) for f in folders]
    assert [len(m.shards) for m in manifests] == [1, 0, 1]  # cuts 1 and 2 move on to one blank line
    assert sum(m.totals["docs"] for m in manifests) == 2


# -- a lost part, the parent's rules, verify and inspect ------------------------------------------

def part_args(parent, i, vocab, count=3, *more):
    return ["build", "--input", *INPUTS, "--output", str(parent), "--vocab", str(vocab), "--workers", "1",
            "--shard-tokens", SHARD_TOKENS, "--no-progress", "--part", f"{i}/{count}", *more]


def test_a_lost_part_is_rebuilt_alone(single, by_flag, tmp_path, capsys):
    parent = tmp_path / "parts"
    shutil.copytree(by_flag, parent)
    before = tree(parent)
    shutil.rmtree(parent / part_name(1, 3))
    (parent / part_name(1, 3)).mkdir()  # as a node that died before its first shard leaves it
    with pytest.raises(ShardError, match=r"parts: part 1 of 3 is missing or unfinished .*rerun its build"):
        dataset_folders(parent)
    capsys.readouterr()
    for i in range(3):
        assert main(part_args(parent, i, single / "vocab.txt")) == 0
    out = capsys.readouterr().out
    assert out.count("already built") == 2 and "part 1/3: built " in out
    assert tree(parent) == before
    assert len(dataset_folders(parent)) == 3


def test_parent_refusals(single, by_flag, tmp_path, capsys):
    vocab = single / "vocab.txt"
    other = tmp_path / "other-count"
    shutil.copytree(by_flag, other)
    cases = {
        other: "holds parts of a build in 3 parts",
        tmp_path / "files": "holds files that are no part of a partitioned build (notes.txt)",
        single: "holds a finished dataset",
    }
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "notes.txt").write_text("mine")
    for parent, message in cases.items():
        before = tree(parent)
        capsys.readouterr()
        assert main(part_args(parent, 0, vocab, 2)) == 2
        err = capsys.readouterr().err
        assert message in err and err.startswith("error: ") and err.count("\n") == 1, err
        assert tree(parent) == before
    # --overwrite: the parts of the other count go, the new part is built.
    assert main(part_args(other, 0, vocab, 2, "--overwrite")) == 0
    assert sorted(p.name for p in other.iterdir() if not p.name.startswith(".")) == [part_name(0, 2)]


def test_a_vocabulary_trained_for_another_build_is_refused(tmp_path, capsys):
    inputs = [write_blank(tmp_path / "a.txt", 200)]
    parent = tmp_path / "parts"
    (parent / "tokenizer").mkdir(parents=True)
    (parent / "tokenizer" / "trained_from.json").write_text(json.dumps({"train_vocab": 999}))
    before = tree(parent)
    args = ["build", "--input", *inputs, "--output", str(parent), "--train-vocab", "300", "--workers", "1",
            "--part", "0/2", "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "a vocabulary trained for another build (other train vocab" in err and err.count("\n") == 1
    assert tree(parent) == before
    assert main(args + ["--overwrite"]) == 0  # trained anew
    assert capsys.readouterr().out.count("training a vocabulary") == 1
    assert json.loads((parent / "tokenizer" / "trained_from.json").read_text())["train_vocab"] == 300
    assert main(args[:-3] + ["--part", "1/2"]) == 0  # the other part uses it
    assert "training" not in capsys.readouterr().out
    assert len({(f / "vocab.txt").read_bytes() for f in dataset_folders(parent)}) == 1


def test_verify_and_inspect_take_the_parent(by_flag, tmp_path, capsys):
    assert main(["verify", str(by_flag)]) == 0
    parts = [Manifest.load(f) for f in dataset_folders(by_flag)]
    shards, tokens = sum(len(m.shards) for m in parts), sum(m.totals["tokens"] for m in parts)
    assert capsys.readouterr().out == f"ok: 3 parts, {shards} shards, {tokens} tokens\n"
    assert main(["inspect", str(by_flag), "--decode", "2"]) == 0
    out = capsys.readouterr().out
    assert "3 parts" in out and f"tokens: {tokens:,}" in out
    for i, m in enumerate(parts):
        assert f"part {i}: {part_name(i, 3)}: {len(m.shards)} shards, {m.totals['docs']:,} documents" in out
    assert out.count("--- document") == 2
    damaged = tmp_path / "damaged"
    shutil.copytree(by_flag, damaged)
    shard = damaged / part_name(2, 3) / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", str(damaged)]) == 1
    err = capsys.readouterr().err
    assert str(shard) in err and err.startswith("error: ")
    shutil.rmtree(damaged / part_name(0, 3))
    assert main(["verify", str(damaged)]) == 1
    assert "part 0 of 3 is missing or unfinished" in capsys.readouterr().err


@pytest.mark.parametrize("args, env, message", [
    (["--part", "3/3"], {}, "--part 3/3: the index must be 0 to 2"),
    (["--part", "a/b"], {}, "--part a/b: write I/N"),
    (["--part=-1/2"], {}, "--part -1/2: write I/N"),
    (["--part", "0/0"], {}, "--part 0/0: the number of parts must be"),
    ([], {"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
    ([], {"PMI_SIZE": "4"}, "PMI_SIZE is set but PMI_RANK is not"),
    (["--part", "0/2"], {"RANK": "0", "WORLD_SIZE": "3"}, "--part 0/2 names 2 parts, but torchrun"),
])
def test_user_errors_of_part(single, tmp_path, capsys, monkeypatch, args, env, message):
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    code = main(["build", "--input", *INPUTS, "--output", str(out), "--vocab", str(single / "vocab.txt"), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not out.exists()


def test_a_part_stopped_mid_build_resumes_from_its_journal(single, by_flag, tmp_path, monkeypatch, capsys):
    from bert_ds.data_tools.shard_format import ShardWriter

    parent = tmp_path / "parts"
    real = ShardWriter._write

    def write(self, f, data):
        if "shard_00001.bin" in str(getattr(f, "name", "")):
            raise OSError(28, "No space left on device")
        return real(self, f, data)

    monkeypatch.setattr(ShardWriter, "_write", write)
    assert main(part_args(parent, 1, single / "vocab.txt")) == 2
    assert "No space left on device" in capsys.readouterr().err
    monkeypatch.undo()
    assert [p.name for p in (parent / part_name(1, 3)).glob("shard_*.bin")] == ["shard_00000.bin"]
    assert main(part_args(parent, 1, single / "vocab.txt", 3, "--workers", "2")) == 0
    assert "(1 reused)" in capsys.readouterr().out
    assert tree(parent / part_name(1, 3)) == tree(by_flag / part_name(1, 3))


def test_a_part_waits_for_the_vocabulary_trainer_and_says_who_it_is(tmp_path):
    import subprocess
    import sys

    from bert_ds.data_tools.parent import ParentLock
    from tests.conftest import REPO, spawn

    inputs = [write_blank(tmp_path / "a.txt", 200)]
    parent = tmp_path / "parts"
    with ParentLock(parent, "part 0/2"):
        proc = spawn([sys.executable, "-m", "bert_ds.data_tools", "build", "--input", *inputs, "--output",
                      str(parent), "--train-vocab", "300", "--workers", "1", "--part", "1/2"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        lines = [proc.stdout.readline(), proc.stdout.readline()]
    assert lines[0].startswith("part 1/2 (--part): 1 input(s)")
    assert lines[1].startswith(f"part 1/2: waiting for {parent / '.parts.lock'}, held by part 0/2 (pid ")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.startswith("part 1/2: training a vocabulary of 300 entries on all 1 input(s)")
