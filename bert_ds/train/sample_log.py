"""``--log-samples``: which global stream positions each rank trained on at each step, to
check that a resume neither repeats nor skips samples (:func:`consumed_positions`)."""

from __future__ import annotations

import json
import os
from pathlib import Path


class SampleLog:
    """One JSON line per rank and step, ``{"step", "rank", "positions": [[lo, hi], ...]}``
    (half-open ranges of global stream positions, one per micro-batch). All ranks append to one
    file, one write() per line, so lines never interleave."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, step: int, rank: int, micro_batches) -> None:
        ranges = [[b[0], b[-1] + 1] for b in micro_batches]
        os.write(self._fd, (json.dumps({"step": step, "rank": rank, "positions": ranges}) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def consumed_positions(path: Path) -> list[int]:
    """The global stream positions that the final model was trained on, in order, from a
    --log-samples file that may span several invocations.

    A line for a (step, rank) that is already recorded means a restart redid that step from a
    checkpoint: everything recorded from that step on belonged to the abandoned attempt and is
    dropped. A resume that repeats or skips samples shows up as duplicates or gaps in the result.
    """
    steps: dict[int, dict[int, list[list[int]]]] = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r["rank"] in steps.get(r["step"], {}):
            steps = {s: v for s, v in steps.items() if s < r["step"]}
        steps.setdefault(r["step"], {})[r["rank"]] = r["positions"]
    out: list[int] = []
    for step in sorted(steps):
        out += sorted(p for ranges in steps[step].values() for lo, hi in ranges for p in range(lo, hi))
    return out
