"""bert_ds.tools.plot: metrics.jsonl -> a PNG of loss and accuracies, and one-line errors."""

import json
import math
import struct

import pytest

from bert_ds.tools.plot import main, moving_average, read_metrics
from tests.conftest import run_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, steps=60, val_every=20, nsp=True):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 8.0 * math.exp(-step / 30) + 2.0 + 0.2 * math.sin(step),
                  "mlm_acc": min(0.6, step / 100), "lr": 1e-3, "tokens": 1000 * step, "tokens_per_s": 5000.0}
        record["nsp_acc"] = 0.5 + step / 400 if nsp else float("nan")
        lines.append(json.dumps(record))
        if step % val_every == 0:
            lines.append(json.dumps({"step": step, "loss": record["loss"] + 0.3, "mlm_loss": 2.0,
                                     "mlm_acc": record["mlm_acc"] - 0.05,
                                     "nsp_acc": record["nsp_acc"] - 0.02, "split": "val"}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_cli_writes_a_readable_png(tmp_path):
    run = _write_run(tmp_path / "run")
    proc = run_cli("bert_ds.tools.plot", str(run), "--out", str(tmp_path / "plots" / "curves.png"))
    out = tmp_path / "plots" / "curves.png"
    assert "60 train steps, 3 validation passes" in proc.stdout
    width, height = _png_size(out)
    assert (width, height) == (1200, 450)
    assert 20_000 < out.stat().st_size < 2_000_000  # drawn curves, not a blank canvas


def test_default_output_is_in_the_run_folder_and_nan_series_are_skipped(tmp_path, capsys):
    run = _write_run(tmp_path / "run", steps=10, val_every=10, nsp=False)
    assert main([str(run)]) == 0
    assert _png_size(run / "metrics.png") == (1200, 450)
    assert "wrote" in capsys.readouterr().out


def test_resumed_run_keeps_the_later_record_of_a_repeated_step(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 9.0} for s in (1, 2, 3)] + [{"step": s, "loss": 1.0} for s in (3, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, val = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in train] == [(1, 9.0), (2, 9.0), (3, 1.0), (4, 1.0)]
    assert val == []


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    ("", "holds no records"),
    ("\n\n", "holds no records"),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary \x00\n\x01\x02", "holds no records (3 line(s) that are not metrics records)"),
])
def test_missing_empty_or_damaged_file_is_a_one_line_error(tmp_path, capsys, content, message):
    run = tmp_path / "run"
    run.mkdir()
    if isinstance(content, bytes):
        (run / "metrics.jsonl").write_bytes(content)
    elif content is not None:
        (run / "metrics.jsonl").write_text(content)
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not (run / "metrics.png").exists()


def test_unfinished_last_line_of_a_live_run_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    train, _ = read_metrics(path)
    assert [r["step"] for r in train] == [1, 2]


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_a_damaged_line_is_skipped_with_one_warning(tmp_path, capsys):
    """A line cut by a crash inside the file (a run that resumed before the repair
    existed) costs that line, not the whole plot."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo{"step": 3, "loss": 1.8}\n'
                                       '{"step": 4, "loss": 1.7}\n')
    assert main([str(run)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: {run / 'metrics.jsonl'}: skipped 1 damaged line(s) (line 2)"]
    train, _ = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in train] == [1, 4]


@pytest.mark.parametrize("target", ["folder", "under_a_file"])
def test_an_output_that_cannot_be_written_is_a_one_line_error(tmp_path, capsys, target):
    run = _write_run(tmp_path / "run", steps=5, val_every=5)
    out = tmp_path / "out"
    if target == "folder":
        out.mkdir()
    else:  # a path whose parent is a file: no user, root included, can create it
        out.write_text("a file")
        out = out / "curves.png"
    assert main([str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {out}: ") and err.count("\n") == 1
