"""Where a training step's time goes: ``torch.profiler`` over chosen steps, summarised per step.

``python -m bert_ds.train ... --profile-steps 11-13`` profiles steps 11 to 13 of the run as it
is (the engine, the loader, the schedule; nothing is rebuilt for it) and writes, per rank,
into ``OUTPUT/profile/``:

- ``rank{R}.md`` and ``rank{R}.json``: per step, the wall time, the time the device was busy
  (the union of its kernels and copies) and the difference, the *idle gaps* where the GPU
  waited for the host; the same split for each stage of the step (:func:`stage`: loading,
  forward, backward, the update, ...), which says what the host was doing while the GPU
  waited; the host calls that wait for the device; the kernels (on a CPU: the host ops)
  that take the most time;
- ``rank{R}.trace.json.gz``: the Chrome trace, for Perfetto or ``chrome://tracing``.

:func:`summarize` is also the summary of ``python -m bert_ds.tools.profile_step`` (the bench
loop's variants, without the engine): the two are read side by side.
"""

from __future__ import annotations

import bisect
import json
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from bert_ds.base.atomic import atomic_write
from bert_ds.train.step_range import StepRange
from bert_ds.train.sync_debug import SyncRecorder

# Host calls that block until the device has finished earlier work.
BLOCKING = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
TOP = 25  # kernels (or host ops) listed
STAGE = "step."  # the names of :func:`stage`'s ranges start with this
OUTSIDE = "(outside the stages)"


# Every GPU kernel's time goes to one bucket, the first whose pattern its name matches, so
# that a step reads as GEMMs, attention, elementwise work, reductions, copies and idle time:
# the split the throughput targets are stated in (docs/benchmarks.md). Order matters:
# attention's own helper kernels (its dsum, its dQ conversion) are attention, a dtype copy is
# a copy before it is an elementwise kernel, a LayerNorm's column sums are normalization.
BUCKETS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"attention|flash|fmha|sdpa|varlen|\bmha|bds::.*\bconvert_kernel", re.I)),
    ("GEMM", re.compile(r"nvjet|gemm|gemv|cutlass|xmma|cublas|\b(sm\d+|ampere|hopper|volta|turing)_", re.I)),
    ("normalization", re.compile(r"layer_?norm|\bln_|_ln_|rms_?norm", re.I)),
    # not a bare "lamb": kernel names spell out their lambdas ("{lambda(...)}")
    ("optimizer", re.compile(r"\blamb_|_lamb\b|lamb_update|\badam|multi_tensor", re.I)),
    ("reductions", re.compile(r"reduce|softmax|nll|cross_?entropy|norm|argmax|sum", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy|convert|\bcat|index|gather|scatter|embedding", re.I)),
    ("elementwise", re.compile(r"elementwise|gelu|dropout|masked_scale|fill|add|mul|where", re.I)),
)
OTHER, IDLE = "other", "idle"


def bucket_of(kernel: str) -> str:
    """The :data:`BUCKETS` entry a GPU kernel's name falls in, else "other"."""
    return next((name for name, pattern in BUCKETS if pattern.search(kernel)), OTHER)


def stage(name: str) -> record_function:
    """A stage of the training step (``with stage("backward"): ...``), for the profile's
    per-stage split; outside a profile it costs a few microseconds."""
    return record_function(STAGE + name)


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as disjoint intervals in order."""
    out: list[tuple[float, float]] = []
    for start, stop in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds)."""
    return sum(stop - start for start, stop in merged(intervals))


def overlap_us(start: float, stop: float, union: list[tuple[float, float]]) -> float:
    """How much of [start, stop) the disjoint, ordered intervals ``union`` cover."""
    first = bisect.bisect_right(union, (start, float("inf"))) - 1  # the last interval starting at or before
    total = 0.0
    for a, b in union[max(first, 0):]:
        if a >= stop:
            break
        total += max(0.0, min(b, stop) - max(a, start))
    return total


def stage_split(stages: list[tuple[str, float, float]], intervals: list[tuple[float, float]],
                steps: int, wall_us: float) -> list[dict[str, Any]]:
    """Per stage name, ms per step: the host's time in it, and of that, the time the GPU was busy
    and idle (None without GPU intervals): the idle part is the GPU waiting on that stage's host
    work. The rest of the wall time (the loop's logging, checkpoints) is one more row."""
    if not stages:
        return []
    union = merged(intervals)
    totals: dict[str, list[float]] = {}
    for name, start, stop in stages:
        entry = totals.setdefault(name, [0.0, 0.0])
        entry[0] += stop - start
        entry[1] += overlap_us(start, stop, union)
    host = sum(h for h, _ in totals.values())
    busy = sum(b for _, b in totals.values())
    totals[OUTSIDE] = [max(wall_us - host, 0.0), max(busy_us(intervals) - busy, 0.0)]
    rows = []
    for name, (host, busy) in sorted(totals.items(), key=lambda kv: -(kv[1][0] - kv[1][1])):
        rows.append({"stage": name, "host_ms_per_step": host / steps / 1e3,
                     "gpu_busy_ms_per_step": busy / steps / 1e3 if intervals else None,
                     "gpu_idle_ms_per_step": (host - busy) / steps / 1e3 if intervals else None})
    return rows


def _is_annotation(event) -> bool:
    """A ``record_function`` range (``Optimizer.step#Lamb.step``) mirrored on the GPU timeline:
    it spans kernels rather than being one, so it is kept out of the busy time."""
    return bool(getattr(event, "is_user_annotation", False))


def _is_stage(event) -> bool:
    return event.name.startswith(STAGE)


def _top_level(event) -> bool:
    """A host op called by no other op (a stage's range does not count as a caller)."""
    parent = event.cpu_parent
    return parent is None or (_is_stage(parent) and parent.cpu_parent is None)


def summarize(events, steps: int, wall_s: float, top: int = TOP) -> dict[str, Any]:
    """The profile's figures per step: busy, idle, syncs, each stage's split and the top kernels (or host ops)."""
    kernels: dict[str, list[float]] = {}
    intervals: list[tuple[float, float]] = []
    syncs: dict[str, int] = {}
    host_ops: dict[str, float] = {}
    ranges: dict[str, float] = {}
    stages: list[tuple[str, float, float]] = []
    for e in events:
        if e.device_type == DeviceType.CUDA and _is_annotation(e):  # a record_function's span on the GPU
            if not _is_stage(e):
                ranges[e.name] = ranges.get(e.name, 0.0) + e.time_range.elapsed_us()
        elif e.device_type == DeviceType.CUDA:
            intervals.append((e.time_range.start, e.time_range.end))
            entry = kernels.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.elapsed_us()
        elif _is_stage(e):
            stages.append((e.name.removeprefix(STAGE), e.time_range.start, e.time_range.end))
        else:
            if e.name in BLOCKING:
                syncs[e.name] = syncs.get(e.name, 0) + 1
            if not e.name.startswith("cuda") and _top_level(e):
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
        "buckets": buckets({name: us for name, (_, us) in kernels.items()}, wall_us - busy, steps, wall_us)
        if intervals else [],
        "stages": stage_split(stages, intervals, steps, wall_us),
        "annotated_ranges": [{"name": name, "ms_per_step": us / steps / 1e3}
                             for name, us in sorted(ranges.items(), key=lambda kv: -kv[1])],
        "top_host_ops": [{"name": name, "ms_per_step": us / steps / 1e3}
                         for name, us in sorted(host_ops.items(), key=lambda kv: -kv[1])[:top]],
    }


def buckets(kernel_us: dict[str, float], idle_us: float, steps: int, wall_us: float) -> list[dict[str, Any]]:
    """Per bucket (:data:`BUCKETS`, then "other" and "idle"), ms per step and share of the wall
    time. Kernel time, not busy time: kernels that overlap on two streams both count, so the
    shares may add up to a little more than 100%."""
    total: dict[str, float] = {name: 0.0 for name, _ in BUCKETS} | {OTHER: 0.0}
    for name, us in kernel_us.items():
        total[bucket_of(name)] += us
    total[IDLE] = max(idle_us, 0.0)
    return [{"bucket": name, "ms_per_step": us / steps / 1e3, "share_of_wall": us / wall_us if wall_us else None}
            for name, us in total.items()]


def bucket_lines(columns: dict[str, dict[str, Any]]) -> list[str]:
    """A Markdown table of :func:`buckets` side by side: ``columns`` maps a heading (e.g.
    "seq 128") to a :func:`summarize` result; a bucket empty in every column is left out."""
    rows = {}
    for heading, summary in columns.items():
        for b in summary.get("buckets") or []:
            rows.setdefault(b["bucket"], {})[heading] = b
    heads = list(columns)
    lines = ["| bucket | " + " | ".join(f"{h} ms/step | {h} share" for h in heads) + " |",
             "|---|" + "---:|---:|" * len(heads)]
    for name, cells in rows.items():
        if all(c["ms_per_step"] < 0.005 for c in cells.values()):
            continue
        lines.append(f"| {name} | " + " | ".join(
            f"{cells[h]['ms_per_step']:.2f} | {100 * (cells[h]['share_of_wall'] or 0):.1f}%" if h in cells else "- | -"
            for h in heads) + " |")
    return lines


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def summary_lines(s: dict[str, Any], top: int = TOP) -> list[str]:
    """:func:`summarize`'s figures as Markdown: the per-step line items, then the ``top`` rows of its table."""
    lines = [f"- wall {s['wall_ms_per_step']:.2f} ms/step; device busy {s['device_busy_ms_per_step']:.2f} ms/step"
             + (f"; idle gaps {s['idle_ms_per_step']:.2f} ms/step" if s["idle_ms_per_step"] is not None else ""),
             f"- kernel launches per step: {s['kernel_launches_per_step']:.0f}; host calls that wait for the "
             f"device, per step: " + (", ".join(f"{k} {v:g}" for k, v in s["blocking_calls_per_step"].items())
                                      or "none"),
             *(f"- GPU span of `{r['name']}`: {r['ms_per_step']:.2f} ms/step" for r in s["annotated_ranges"]),
             ""]
    if s.get("stages"):  # what the host was doing while the GPU waited
        def ms(value: float | None) -> str:
            return "" if value is None else f"{value:.2f}"
        lines += ["| stage of the step | host ms/step | GPU busy ms/step | GPU idle ms/step |", "|---|---:|---:|---:|"]
        lines += [f"| {r['stage']} | {r['host_ms_per_step']:.2f} | {ms(r['gpu_busy_ms_per_step'])} | "
                  f"{ms(r['gpu_idle_ms_per_step'])} |" for r in s["stages"]]
        lines.append("")
    if s.get("host_syncs"):  # on a GPU: torch.cuda.set_sync_debug_mode("warn") over the profiled steps
        lines += ["| host sync at | reached from | per step |", "|---|---|---:|"]
        lines += [f"| `{r['where']}` | {_code(r['via'])} | {r['per_step']:g} |" for r in s["host_syncs"]]
        lines.append("")
    if s.get("buckets"):
        lines += bucket_lines({"step": s}) + [""]
    if s["top_kernels"]:
        lines += ["| kernel | calls/step | ms/step | share of busy |", "|---|---:|---:|---:|"]
        lines += [f"| `{k['name'][:90]}` | {k['calls_per_step']:g} | {k['ms_per_step']:.3f} | "
                  f"{100 * k['share_of_busy']:.1f}% |" for k in s["top_kernels"][:top]]
    else:
        lines += ["| host op | ms/step |", "|---|---:|"]
        lines += [f"| `{k['name'][:90]}` | {k['ms_per_step']:.3f} |" for k in s["top_host_ops"][:top]]
    return lines


class StepProfiler:
    """Profiles the steps of ``steps`` that this invocation runs; writes on the last of them,
    or, where the run ends inside the range (a stop, --exit-after), on :meth:`close`."""

    def __init__(self, steps: StepRange | None, output: Path, device: torch.device, rank: int):
        self.steps, self.folder, self.device, self.rank = steps, output / "profile", device, rank
        self._prof: profile | None = None
        self._syncs: SyncRecorder | None = None  # on a GPU: each sync of the profiled steps by its line
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
        if self.device.type == "cuda":
            self._syncs = SyncRecorder()
            self._syncs.start()
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
        self._stop_syncs()
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def _stop_syncs(self) -> SyncRecorder | None:
        syncs, self._syncs = self._syncs, None
        if syncs is not None:
            syncs.stop()
        return syncs

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _finish(self) -> Path:
        syncs = self._stop_syncs()  # before the closing synchronize, which is the profiler's own
        self._sync()
        wall = time.perf_counter() - self._start
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        steps = f"{self._first}-{self._first + self._count - 1}"
        summary = summarize(prof.events(), self._count, wall)
        if syncs is not None:
            summary["host_syncs"] = syncs.report(self._count)
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
