"""The table of ``benchmarks/engine_sweep.sh``: each variant of the engine path side by side.

    python -m bert_ds.tools.engine_sweep OUT_DIR

Reads each ``OUT_DIR/<variant>/`` (``summary.json``, ``metrics.jsonl``, ``rank0.json``: the
run's summary, its per-step records, its profiled steps) and prints Markdown: one row per
variant (real tokens/s, MFU, the median step time outside the profiled steps, the profiled
steps' GPU busy and idle time), then each variant's split of a step by stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _read(folder: Path) -> dict[str, Any]:
    """What the variant's run left: its summary, the steps' records and the profile (each may be missing)."""
    summary = folder / "summary.json"
    metrics = folder / "metrics.jsonl"
    profile = folder / "rank0.json"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return {"summary": json.loads(summary.read_text()) if summary.is_file() else None,
            "steps": [r for r in records if "step_time_s" in r],
            "profile": json.loads(profile.read_text())["summary"] if profile.is_file() else None}


def median_step_ms(steps: list[dict[str, Any]]) -> float | None:
    """The median step time, leaving out the first step (start-up) and the profiled last three."""
    times = [r["step_time_s"] for r in steps[1:-3]]
    return 1e3 * statistics.median(times) if times else None


def _ms(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table(out: Path) -> list[str]:
    lines = ["| variant | real tokens/s | MFU | peak memory GiB | median step ms | "
             "profiled: GPU busy / idle ms per step | most idle stage |", "|---|---:|---:|---:|---:|---:|---|"]
    details: list[str] = []
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        run = _read(folder)
        s, p = run["summary"], run["profile"]
        if s is None:
            lines.append(f"| {folder.name} | failed (see {folder.name}/train.log) | | | | | |")
            continue
        step_ms = median_step_ms(run["steps"])
        profiled = (f"{p['device_busy_ms_per_step']:.1f} / {p['idle_ms_per_step']:.1f}"
                    if p and p.get("idle_ms_per_step") is not None else "")
        stages = (p or {}).get("stages") or []
        worst = max(stages, key=lambda r: r["gpu_idle_ms_per_step"] or 0.0, default=None)
        mfu = "" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
        lines.append(f"| {folder.name} | {s['tokens_per_s']:,.0f} | {mfu} | {_ms(s.get('max_memory_gb'), 1)} | "
                     f"{_ms(step_ms, 1)} | {profiled} | "
                     f"{'' if worst is None or worst['gpu_idle_ms_per_step'] is None else worst['stage']} |")
        if stages:
            details += ["", f"### {folder.name}: a profiled step by stage", "",
                        "| stage | host ms/step | GPU busy ms/step | GPU idle ms/step |", "|---|---:|---:|---:|"]
            details += [f"| {r['stage']} | {r['host_ms_per_step']:.2f} | {_ms(r['gpu_busy_ms_per_step'])} | "
                        f"{_ms(r['gpu_idle_ms_per_step'])} |" for r in stages]
    return ["## The engine path, variant by variant (`benchmarks/engine_sweep.sh`)", "", *lines, *details]


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
