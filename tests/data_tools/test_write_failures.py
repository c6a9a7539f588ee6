"""R18 for a build: disk full while the tokenizer is installed ends in one line, exit 2,
with no temporary folder and no tokenizer file under a final name; a rerun completes."""

import errno
import os

from bert_ds.data_tools import tokenizer
from bert_ds.data_tools.__main__ import main
from bert_ds.data_tools.build import JOURNAL_NAME
from bert_ds.data_tools.manifest import MANIFEST_NAME, open_dataset
from bert_ds.data_tools.tokenizer import HF_FILES

from tests.data_tools.test_shard_build import SAMPLE

ARGS = ["--train-vocab", "1024", "--split-sentences", "--workers", "1", "--no-progress"]


def test_r18_disk_full_during_the_tokenizer_install(tmp_path, monkeypatch, capsys):
    real, calls = tokenizer.write_synced, []

    def write_synced(path, data):
        calls.append(path)
        if len(calls) == 2:  # vocab.txt again, after transformers wrote its files beside it
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    out = tmp_path / "data"
    monkeypatch.setattr(tokenizer, "write_synced", write_synced)
    rc = main(["build", "--input", str(SAMPLE), "--output", str(out), *ARGS])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith(f"error: {out}: build failed: ") and "No space left on device" in err[0]
    assert calls[1] == out / tokenizer._TMP_DIR / "vocab.txt"
    left = sorted(os.listdir(out))
    assert tokenizer._TMP_DIR not in left and MANIFEST_NAME not in left
    assert not set(HF_FILES) & set(left)
    assert not [n for n in left if n.startswith("shard_")]
    monkeypatch.undo()
    assert main(["build", "--input", str(SAMPLE), "--output", str(out), *ARGS]) == 0
    manifest, _ = open_dataset(out)
    assert manifest.shards and not (out / JOURNAL_NAME).exists()
