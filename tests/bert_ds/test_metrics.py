"""metrics.jsonl: a last line cut short by a crash is removed when the run resumes."""

import json

import pytest

from bert_ds.train.metrics import MetricsLogger, drop_partial_line


@pytest.mark.parametrize("content,kept", [
    (b"", b""),
    (b'{"step": 1}\n', b'{"step": 1}\n'),
    (b'{"step": 1}\n{"step": 2, "lo', b'{"step": 1}\n'),
    (b'{"step": 1, "lo', b""),
])
def test_drop_partial_line(tmp_path, content, kept):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content)
    assert drop_partial_line(path) == len(content) - len(kept)
    assert path.read_bytes() == kept


def test_drop_partial_line_finds_a_newline_far_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    head = b'{"step": 1}\n'
    path.write_bytes(head + b"x" * 200_000)  # longer than one backwards read
    assert drop_partial_line(path) == 200_000 and path.read_bytes() == head
    assert drop_partial_line(tmp_path / "absent.jsonl") == 0


def test_a_resumed_logger_appends_whole_records_after_a_cut_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    log = MetricsLogger(tmp_path, enabled=True, total_steps=3, start_step=1, tensorboard=False, progress=False)
    log.log_step({"step": 2, "loss": 1.9, "tokens_per_s": 1.0})
    log.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[1]["loss"] == 1.9
    assert "removed 15 bytes of a last line cut short" in capsys.readouterr().err
