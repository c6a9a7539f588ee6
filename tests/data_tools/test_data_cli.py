"""The ``python -m bert_ds.data_tools`` command line: help, one-line errors with exit 2, verify
and inspect on sound and damaged datasets."""

import subprocess
import sys

import numpy as np
import pytest

from bert_ds.data_tools.__main__ import main
from bert_ds.data_tools.shard_format import ShardWriter


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small dataset built through the CLI with a hand-made vocabulary."""
    root = tmp_path_factory.mktemp("cli")
    words = "the a lobster is blue red sea it . , and of".split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words + ["##s"]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (root / "in.txt").write_text("The lobster is blue.\nIt is red.\n\nThe sea, and the lobsters.\n")
    rc = main(["build", "--input", str(root / "in.txt"), "--output", str(root / "d"),
               "--vocab", str(root / "vocab.txt"), "--workers", "1", "--no-progress"])
    assert rc == 0
    return root


@pytest.mark.parametrize("argv", [["--help"], ["build", "--help"], ["verify", "--help"], ["inspect", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage: python -m bert_ds.data_tools" in capsys.readouterr().out


def _one_line_error(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip().split("\n")
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: ")
    return err[0]


def test_missing_input_file(tmp_path, capsys):
    msg = _one_line_error(capsys, ["build", "--input", str(tmp_path / "nope.txt"), "--output", str(tmp_path / "o"),
                                   "--train-vocab", "100"])
    assert msg == f"error: input not found: {tmp_path / 'nope.txt'}"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("vocab_args", [[], ["--vocab", "VOCAB", "--train-vocab", "100"]])
def test_neither_or_both_vocab_options(dataset, tmp_path, capsys, vocab_args):
    args = [a.replace("VOCAB", str(dataset / "vocab.txt")) for a in vocab_args]
    msg = _one_line_error(capsys, ["build", "--input", str(dataset / "in.txt"), "--output", str(tmp_path / "o")] + args)
    assert "exactly one of --vocab FILE, --train-vocab SIZE or --tokenizer PATH" in msg


def test_vocabulary_without_special_tokens(dataset, tmp_path, capsys):
    (tmp_path / "v.txt").write_text("[PAD]\n[UNK]\nthe\n")
    msg = _one_line_error(capsys, ["build", "--input", str(dataset / "in.txt"), "--output", str(tmp_path / "o"),
                                   "--vocab", str(tmp_path / "v.txt")])
    assert "lacks the special token(s) [CLS], [SEP], [MASK]" in msg


def test_bad_flag_value_is_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["build", "--input", "x", "--output", "y", "--train-vocab", "-5"])
    assert e.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_verify_ok(dataset, capsys):
    assert main(["verify", str(dataset / "d")]) == 0
    assert capsys.readouterr().out.strip() == "ok: 1 shards, 17 tokens"


def test_verify_reports_every_damaged_file(dataset, tmp_path, capsys):
    import shutil

    d = tmp_path / "d"
    shutil.copytree(dataset / "d", d)
    with open(d / "shard_00000.bin", "rb+") as f:
        f.seek(4)
        f.write(b"\x01\x00")
    (d / "vocab.txt").write_text((d / "vocab.txt").read_text() + "extra\n")
    proc = subprocess.run([sys.executable, "-m", "bert_ds.data_tools", "verify", str(d)], capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().split("\n")
    assert proc.returncode == 1
    assert len(lines) == 2
    assert lines[0].startswith(f"error: {d / 'vocab.txt'}: tokenizer fingerprint")
    assert lines[1].startswith(f"error: {d / 'shard_00000.bin'}: checksum mismatch")


def test_verify_without_manifest(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 1
    assert "manifest.json: missing" in capsys.readouterr().err


def test_verify_catches_ids_beyond_vocab_in_a_foreign_shard(dataset, tmp_path, capsys):
    import shutil

    d = tmp_path / "d"
    shutil.copytree(dataset / "d", d)
    with ShardWriter(d / "shard_00000", 1000) as w:  # same name, ids the dataset's vocab lacks
        w.add_document([np.array([5, 999])])
        w.close()
    assert main(["verify", str(d)]) == 1
    err = capsys.readouterr().err
    assert f"{d / 'shard_00000.idx'}: max token id 999 >= vocab size 18" in err


def test_inspect(dataset, capsys):
    assert main(["inspect", str(dataset / "d"), "--decode", "2"]) == 0
    out = capsys.readouterr().out
    assert "documents:   2   sentences: 3   tokens: 17" in out
    assert "bytes/token" in out and "sentence length (tokens): p50" in out
    assert "the lobster is blue.\nit is red.\n" in out and "the sea, and the lobsters." in out


def test_inspect_of_a_damaged_dataset_is_a_one_line_error(tmp_path, capsys):
    msg = _one_line_error(capsys, ["inspect", str(tmp_path)])
    assert "manifest.json: missing" in msg
