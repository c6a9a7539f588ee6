"""The table of ``benchmarks/engine_sweep.sh``: each variant of the engine path side by side.

    python -m bert_ds.tools.engine_sweep OUT_DIR

Reads each ``OUT_DIR/<variant>/`` (``summary.json``, ``metrics.jsonl``, ``rank0.json``: the
run's summary, its per-step records, its profiled steps) and prints Markdown: one row per
variant (real tokens/s and MFU by each clock, the median step time by each clock outside the
profiled steps, the profiled steps' GPU busy and idle time), then each variant's split of a step
by stage.

Every rate says its clock. A run's summary gives ``tokens_per_s`` and ``mfu`` by the host's
wall time over the measured steps (what a user's run takes) and ``tokens_per_s_device`` and
``mfu_device`` by the device's (CUDA events); a summary written before the device's figures
were added holds only ``tokens_per_s`` and ``mfu``, and those were the device's: they are
shown as such (:func:`rates`). Each step's record holds the host's time the step adds to the
run, ``wall_time_s`` (not in older records), and the device's span of its work, ``step_time_s``
(the host's clock on a CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

CLOCKS = ("wall", "device")


def rates(summary: dict[str, Any]) -> dict[str, tuple[float | None, float | None]]:
    """Per clock ("wall", "device"), the run's (real tokens/s, MFU); (None, None) where the
    summary has no figure by that clock (an older summary: no wall time)."""
    if "tokens_per_s_device" in summary:
        return {"wall": (summary["tokens_per_s"], summary.get("mfu")),
                "device": (summary["tokens_per_s_device"], summary.get("mfu_device"))}
    return {"wall": (None, None), "device": (summary["tokens_per_s"], summary.get("mfu"))}


def rate_text(summary: dict[str, Any]) -> str:
    """The run's figures by each clock it has, e.g. ``650,000 real tokens/s (wall), MFU 35.0%; ...``
    (no MFU where the run had no datasheet peak: a CPU)."""
    return "; ".join(f"{tokens:,.0f} real tokens/s ({clock}){'' if mfu is None else f', MFU {_percent(mfu)}'}"
                     for clock, (tokens, mfu) in rates(summary).items() if tokens is not None)


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def read_run(summary: Path, metrics: Path, profile: Path) -> dict[str, Any]:
    """What a run left: its summary, the steps' records and the profile (each may be missing)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return {"summary": json.loads(summary.read_text()) if summary.is_file() else None,
            "steps": [r for r in records if "step_time_s" in r],
            "profile": json.loads(profile.read_text())["summary"] if profile.is_file() else None}


def _read(folder: Path) -> dict[str, Any]:
    return read_run(folder / "summary.json", folder / "metrics.jsonl", folder / "rank0.json")


def median_step_ms(steps: list[dict[str, Any]], key: str = "step_time_s") -> float | None:
    """The median of the steps' ``key`` (``step_time_s``: the device's; ``wall_time_s``: the
    host's), leaving out the first step (start-up) and the profiled last three."""
    times = [r[key] for r in steps[1:-3] if key in r]
    return 1e3 * statistics.median(times) if times else None


def _ms(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _cells(values: tuple[float | None, float | None], fmt) -> list[str]:
    return ["-" if v is None else fmt(v) for v in values]


def row(name: str, run: dict[str, Any]) -> str:
    """One run's row of :func:`table`."""
    s, p = run["summary"], run["profile"]
    if s is None:
        return f"| {name} | failed (see {name}/train.log) | | | | | | | |"
    by_clock = rates(s)
    tokens = _cells(tuple(by_clock[c][0] for c in CLOCKS), lambda v: f"{v:,.0f}")
    mfu = _cells(tuple(by_clock[c][1] for c in CLOCKS), _percent)
    profiled = (f"{p['device_busy_ms_per_step']:.1f} / {p['idle_ms_per_step']:.1f}"
                if p and p.get("idle_ms_per_step") is not None else "")
    stages = (p or {}).get("stages") or []
    worst = max(stages, key=lambda r: r["gpu_idle_ms_per_step"] or 0.0, default=None)
    step_ms = " / ".join(_ms(median_step_ms(run["steps"], key), 1) or "-" for key in ("wall_time_s", "step_time_s"))
    return (f"| {name} | {' | '.join(tokens)} | {' | '.join(mfu)} | {_ms(s.get('max_memory_gb'), 1)} | "
            f"{'' if step_ms == '- / -' else step_ms} | {profiled} | "
            f"{'' if worst is None or worst['gpu_idle_ms_per_step'] is None else worst['stage']} |")


def table(out: Path, reference: tuple[str, dict[str, Any]] | None = None) -> list[str]:
    """The variants' table and their steps by stage; ``reference``: (name, :func:`read_run`) of
    a run shown first in the table, such as the shipped config measured outside the sweep."""
    lines = ["| variant | real tokens/s, wall | real tokens/s, device | MFU, wall | MFU, device | peak memory GiB | "
             "median step ms, wall / device | profiled: GPU busy / idle ms per step | most idle stage |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    if reference is not None:
        lines.append(row(*reference))
    details: list[str] = []
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        run = _read(folder)
        lines.append(row(folder.name, run))
        stages = (run["profile"] or {}).get("stages") or []
        if run["summary"] is not None and stages:
            details += ["", f"### {folder.name}: a profiled step by stage", "",
                        "| stage | host ms/step | GPU busy ms/step | GPU idle ms/step |", "|---|---:|---:|---:|"]
            details += [f"| {r['stage']} | {r['host_ms_per_step']:.2f} | {_ms(r['gpu_busy_ms_per_step'])} | "
                        f"{_ms(r['gpu_idle_ms_per_step'])} |" for r in stages]
    return ["## The engine path, variant by variant (`benchmarks/engine_sweep.sh`)", "",
            "Real tokens/s and MFU by the host's wall time over the measured steps (what a user's run takes) "
            "and by the device's (CUDA events); a run summarized before both were kept has the device's alone.", "",
            *lines, *details]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.tools.engine_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="engine_sweep.sh's OUT_DIR")
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        parser.error(f"{args.out} is not a folder")
    print("\n".join(table(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
