"""Where a training step's time goes: ``torch.profiler`` over chosen steps, summarised per step.

``python -m bert_ds.train ... --profile-steps 11-13`` profiles steps 11 to 13 of the run as it
is (the engine, the loader, the schedule; nothing is rebuilt for it) and writes, per rank,
into ``OUTPUT/profile/``:

- ``rank{R}.md`` and ``rank{R}.json``: per step, the wall time, the time the device was busy
  (the union of its kernels and copies) and the difference, the *idle gaps* where the GPU
  waited for the host; the host calls that wait for the device; the kernels (on a CPU: the
  host ops) that take the most time;
- ``rank{R}.trace.json.gz``: the Chrome trace, for Perfetto or ``chrome://tracing``.

:func:`summarize` is also the summary of ``python -m bert_ds.tools.profile_step`` (the bench
loop's variants, without the engine): the two are read side by side.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import ConfigError

# Host calls that block until the device has finished earlier work.
BLOCKING = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
TOP = 25  # kernels (or host ops) listed


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def _is_annotation(event) -> bool:
    """A ``record_function`` range (``Optimizer.step#Lamb.step``) mirrored on the GPU timeline:
    it spans kernels rather than being one, so it is kept out of the busy time."""
    return bool(getattr(event, "is_user_annotation", False))


def summarize(events, steps: int, wall_s: float, top: int = TOP) -> dict[str, Any]:
    """The profile's figures per step: busy, idle, syncs and the top kernels (or host ops)."""
    kernels: dict[str, list[float]] = {}
    intervals: list[tuple[float, float]] = []
    syncs: dict[str, int] = {}
    host_ops: dict[str, float] = {}
    ranges: dict[str, float] = {}
    for e in events:
        if e.device_type == DeviceType.CUDA and _is_annotation(e):  # a record_function's span on the GPU
            ranges[e.name] = ranges.get(e.name, 0.0) + e.time_range.elapsed_us()
        elif e.device_type == DeviceType.CUDA:
            intervals.append((e.time_range.start, e.time_range.end))
            entry = kernels.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.elapsed_us()
        else:
            if e.name in BLOCKING:
                syncs[e.name] = syncs.get(e.name, 0) + 1
            if not e.name.startswith("cuda") and e.cpu_parent is None:
                host_ops[e.name] = host_ops.get(e.name, 0.0) + e.time_range.elapsed_us()
    busy = busy_us(intervals)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    wall_us = wall_s * 1e6
    return {
        "steps": steps,
        "wall_ms_per_step": wall_us / steps / 1e3,
        "device_busy_ms_per_step": busy / steps / 1e3,
        "idle_ms_per_step": max(wall_us - busy, 0.0) / steps / 1e3 if intervals else None,
        "kernel_launches_per_step": sum(n for n, _ in kernels.values()) / steps,
        "blocking_calls_per_step": {k: v / steps for k, v in sorted(syncs.items())},
        "top_kernels": [{"name": name, "calls_per_step": n / steps, "ms_per_step": us / steps / 1e3,
                         "share_of_busy": us / busy if busy else None} for name, (n, us) in ranked],
        "annotated_ranges": [{"name": name, "ms_per_step": us / steps / 1e3}
                             for name, us in sorted(ranges.items(), key=lambda kv: -kv[1])],
        "top_host_ops": [{"name": name, "ms_per_step": us / steps / 1e3}
                         for name, us in sorted(host_ops.items(), key=lambda kv: -kv[1])[:top]],
    }


def summary_lines(s: dict[str, Any], top: int = TOP) -> list[str]:
    """:func:`summarize`'s figures as Markdown: the per-step line items, then the ``top`` rows of its table."""
    lines = [f"- wall {s['wall_ms_per_step']:.2f} ms/step; device busy {s['device_busy_ms_per_step']:.2f} ms/step"
             + (f"; idle gaps {s['idle_ms_per_step']:.2f} ms/step" if s["idle_ms_per_step"] is not None else ""),
             f"- kernel launches per step: {s['kernel_launches_per_step']:.0f}; host calls that wait for the "
             f"device, per step: " + (", ".join(f"{k} {v:g}" for k, v in s["blocking_calls_per_step"].items())
                                      or "none"),
             *(f"- GPU span of `{r['name']}`: {r['ms_per_step']:.2f} ms/step" for r in s["annotated_ranges"]),
             ""]
    if s["top_kernels"]:
        lines += ["| kernel | calls/step | ms/step | share of busy |", "|---|---:|---:|---:|"]
        lines += [f"| `{k['name'][:90]}` | {k['calls_per_step']:g} | {k['ms_per_step']:.3f} | "
                  f"{100 * k['share_of_busy']:.1f}% |" for k in s["top_kernels"][:top]]
    else:
        lines += ["| host op | ms/step |", "|---|---:|"]
        lines += [f"| `{k['name'][:90]}` | {k['ms_per_step']:.3f} |" for k in s["top_host_ops"][:top]]
    return lines


@dataclass(frozen=True)
class StepRange:
    """``--profile-steps``: the first and last step profiled, both included."""

    first: int
    last: int

    @classmethod
    def parse(cls, text: str) -> StepRange:
        """``"11-13"`` or ``"12"``; a ConfigError naming the flag otherwise."""
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
        if match is None:
            raise ConfigError(f"--profile-steps must be STEP or FIRST-LAST (e.g. 11-13), got {text!r}")
        first = int(match.group(1))
        last = int(match.group(2) or first)
        if not 1 <= first <= last:
            raise ConfigError(f"--profile-steps {text}: steps count from 1 and FIRST must not exceed LAST")
        return cls(first, last)

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


class StepProfiler:
    """Profiles the steps of ``steps`` that this invocation runs; writes on the last of them,
    or, where the run ends inside the range (a stop, --exit-after), on :meth:`close`."""

    def __init__(self, steps: StepRange | None, output: Path, device: torch.device, rank: int):
        self.steps, self.folder, self.device, self.rank = steps, output / "profile", device, rank
        self._prof: profile | None = None
        self._first = self._count = 0
        self._start = 0.0

    def before(self, step: int) -> None:
        """Called before training ``step``."""
        if self.steps is None or self._prof is not None or not self.steps.first <= step <= self.steps.last:
            return
        self._sync()  # earlier steps' work is not charged to the profiled ones
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._first, self._count, self._start = step, 0, time.perf_counter()

    def after(self, step: int) -> Path | None:
        """Called after training ``step``; the Markdown summary's path once the range is done."""
        if self._prof is None:
            return None
        self._count += 1
        return self._finish() if step >= self.steps.last else None

    def close(self) -> Path | None:
        """The run's end: a range cut short (a stop, --exit-after) is written for the steps it holds."""
        if self._prof is not None and self._count:
            return self._finish()
        self.discard()
        return None

    def discard(self) -> None:
        """Stop profiling, write nothing (the run failed)."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _finish(self) -> Path:
        self._sync()
        wall = time.perf_counter() - self._start
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        steps = f"{self._first}-{self._first + self._count - 1}"
        summary = summarize(prof.events(), self._count, wall)
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"rank{self.rank}"
        prof.export_chrome_trace(str(stem.with_suffix(".trace.json.gz")))  # torch gzips a .gz path itself
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        record = {"steps": steps, "rank": self.rank, "device": device, "summary": summary}
        atomic_write(stem.with_suffix(".json"), json.dumps(record, indent=2) + "\n")
        markdown = stem.with_suffix(".md")
        atomic_write(markdown, "\n".join([f"## Training steps {steps} profiled: rank {self.rank}, {device}", "",
                                       *summary_lines(summary)]) + "\n")
        return markdown
