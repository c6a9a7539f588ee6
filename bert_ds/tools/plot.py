"""Plot a training run's loss and accuracies against the optimizer step.

    python -m bert_ds.tools.plot RUN_DIR [--out FILE.png]

Reads ``RUN_DIR/metrics.jsonl`` (written by :mod:`bert_ds.train`) and writes one PNG
(default ``RUN_DIR/metrics.png``) with two panels: loss, and MLM / NSP accuracy, each
with the training curve and the validation points (records with ``"split": "val"``).

Design choices, and why:

- **The later record of a step wins.** A resumed run appends to the same file and
  re-runs the steps after its last checkpoint, so a step can appear twice; the later
  line is the one the run continued from.
- **Raw training values are drawn faint, with a moving average on top.** Per-step
  losses of small batches are noisy; the average shows the trend, the faint line
  shows the noise is not hidden.
- **An unfinished last line is skipped**, so a run can be plotted while it writes;
  a damaged line elsewhere (a crash mid-write in a run older than the repair on resume,
  a disk error) is skipped with one warning naming it, so one bad line never hides a
  whole run. A file with no record at all (empty, binary) is a one-line error.
- **Series that are absent or NaN are left out**, not drawn as gaps: ``--pair-task
  none`` runs have no NSP accuracy, and a run without ``--val-data`` has no val points.
- **Agg backend**, selected before pyplot is imported: no display is needed, and
  importing this module never changes another program's backend.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import UserError, guarded
from bert_ds.base.interrupts import import_whole

# (metric key, label) per panel; the colours pair train and val of one metric.
_PANELS = (
    ("loss", [("loss", "loss", "tab:blue")]),
    ("accuracy", [("mlm_acc", "MLM accuracy", "tab:green"), ("nsp_acc", "NSP accuracy", "tab:orange")]),
)


class MetricsError(UserError):
    """metrics.jsonl is missing, empty or unreadable."""


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and val records of a metrics.jsonl, each sorted by step, one record per step."""
    if not path.is_file():
        raise MetricsError(f"{path} does not exist (is the folder a bert_ds.train --output?)")
    train: dict[int, dict[str, Any]] = {}
    val: dict[int, dict[str, Any]] = {}
    damaged: list[int] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    step = int(record["step"])
                except (ValueError, KeyError, TypeError):
                    if line.endswith("\n"):  # else: the last line of a run still writing, not yet a record
                        damaged.append(number)
                    continue
                (val if record.get("split") == "val" else train)[step] = record
    except OSError as err:
        raise MetricsError(f"{path}: cannot read ({err.strerror or err})") from None
    if not train and not val:
        extra = f" ({len(damaged)} line(s) that are not metrics records)" if damaged else ""
        raise MetricsError(f"{path} holds no records{extra}")
    if damaged:
        print(f"warning: {path}: skipped {len(damaged)} damaged line(s) (line {', '.join(map(str, damaged[:5]))}"
              f"{', ...' if len(damaged) > 5 else ''})", file=sys.stderr)
    return [train[s] for s in sorted(train)], [val[s] for s in sorted(val)]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    out, total, queue = [], 0.0, []
    for v in values:
        queue.append(v)
        total += v
        if len(queue) > window:
            total -= queue.pop(0)
        out.append(total / len(queue))
    return out


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in records
             if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_metrics(train: list[dict[str, Any]], val: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    import_whole("numpy", "matplotlib.figure")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    window = max(1, len(train) // 25)
    for ax, (ylabel, metrics) in zip(axes, _PANELS):
        for key, label, colour in metrics:
            steps, values = _series(train, key)
            if steps:
                if window > 1:
                    ax.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
                    ax.plot(steps, moving_average(values, window), color=colour, linewidth=1.6,
                            label=f"train {label} (mean of {window})")
                else:
                    ax.plot(steps, values, color=colour, linewidth=1.6, label=f"train {label}")
            steps, values = _series(val, key)
            if steps:
                ax.plot(steps, values, color=colour, linestyle="--", marker="o", markersize=5,
                        label=f"val {label}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[1].set_ylim(0.0, 1.0)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        png = io.BytesIO()
        fig.savefig(png, format="png")
        atomic_write(out, png.getvalue())  # an earlier plot stays whole until the new one is
    except OSError as err:
        raise MetricsError(f"cannot write {out}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.tools.plot",
                                     description="Plot loss and MLM/NSP accuracy (train and val) of a run's "
                                                 "metrics.jsonl against the step, as a PNG.")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a bert_ds.train --output folder")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    return guarded(lambda: _plot(args.run_dir, args.out), interrupted="no plot written")


def _plot(run_dir: Path, out: Path | None) -> None:
    train, val = read_metrics(run_dir / "metrics.jsonl")
    written = plot_metrics(train, val, out or run_dir / "metrics.png", title=str(run_dir))
    print(f"wrote {written} ({len(train)} train steps, {len(val)} validation passes)")


if __name__ == "__main__":
    sys.exit(main())
