"""One small interface for everything a user watches during a run.

Rank 0 writes ``metrics.jsonl`` (one JSON object per optimizer step, and one per
validation pass with ``"split": "val"``), TensorBoard scalars, and a progress bar.
Other ranks get a logger that does nothing, so call sites need no rank checks.
Lines are flushed as they are written: a crashed run keeps its metrics, and a line the
crash cut short is removed when the run resumes (:func:`drop_partial_line`), so the
resumed run's records never run on from a fragment.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


class MetricsLogger:
    def __init__(self, output: Path, *, enabled: bool, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress: bool = True):
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        output.mkdir(parents=True, exist_ok=True)
        cut = drop_partial_line(output / "metrics.jsonl")
        # Appending keeps the history of a resumed run in one file.
        self._file = open(output / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(output / "tensorboard"))
        if progress:
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
        if cut:
            self.print(f"metrics.jsonl: removed {cut} bytes of a last line cut short by an earlier crash")

    def log_step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._write(record)
        step = record["step"]
        self._scalars("train", record, step)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{record['loss']:.3f}", mlm_acc=f"{record.get('mlm_acc', 0):.3f}",
                                  tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)

    def log_val(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._write({**record, "split": "val"})
        self._scalars("val", record, record["step"])
        # a NaN (no pair task: no NSP accuracy) stays in the record and out of the line
        self.print(" ".join(f"{k}={_fmt(v)}" for k, v in record.items() if v == v), prefix="val")

    def print(self, message: str, prefix: str = "bert_ds") -> None:
        if not self.enabled:
            return
        line = f"[{prefix}] {message}"
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def _scalars(self, split: str, record: dict[str, Any], step: int) -> None:
        if self._tb is None:
            return
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
        self._file = self._tb = self._bar = None


def drop_partial_line(path: Path) -> int:
    """Truncate ``path`` after its last newline; returns the bytes removed (0: nothing to do).

    A record is one line written with its newline in one flushed write, so only the
    last line can be incomplete, and only after a crash.
    """
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, 2)
            if size == 0:
                return 0
            keep, block = size, 1 << 16
            while keep > 0:  # find the last newline, reading backwards
                start = max(0, keep - block)
                f.seek(start)
                chunk = f.read(keep - start)
                if size == keep and chunk.endswith(b"\n"):
                    return 0
                newline = chunk.rfind(b"\n")
                if newline >= 0:
                    keep = start + newline + 1
                    break
                keep = start
            f.truncate(keep)
            return size - keep
    except FileNotFoundError:
        return 0


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
