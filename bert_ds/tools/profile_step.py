"""Where one training step's time goes: ``torch.profiler`` over a few steps of a bench variant.

    python -m bert_ds.tools.profile_step [--device cpu|cuda] [--preset base] [--seq-len 128]
                                         [--variant a|b|c] [--steps 3] [--json FILE]

It builds the variant exactly as :mod:`bert_ds.tools.bench` does (same weights, same
synthetic batches, same loader), runs its warm-up steps, then profiles ``--steps`` steps
and prints:

- the step's wall time, the time the device was busy (the union of its kernels and
  copies) and the difference, the *idle gaps*: time the GPU waited for the host;
- the host calls that wait for the device (stream/device/event synchronisations and
  blocking copies), per step: each one drains the queue of launched work;
- the kernels that take the most device time, per step, with their share of the busy time.

On a CPU the same run profiles the host ops (there are no kernels and no gaps).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bert_ds.base.errors import guarded
from bert_ds.config import BatchPlan
from bert_ds.kernels import probes
from bert_ds.loader.pretraining import PretrainingLoader, to_device
from bert_ds.model.bert import BertForPreTraining, model_preset
from bert_ds.tools import bench

# Host calls that block until the device has finished earlier work.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
              "cudaMemcpy", "cudaStreamWaitEvent")
BLOCKING = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


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


def summarize(events, steps: int, wall_s: float, top: int) -> dict[str, Any]:
    """The profile's figures per step: busy, idle, syncs and the top kernels."""
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


def markdown(r: dict[str, Any]) -> str:
    s = r["summary"]
    lines = [f"## One training step, profiled: {r['preset']}, seq {r['seq_len']}, batch {r['batch_size']}, "
             f"variant ({r['variant']}) {r['kernels']}",
             "",
             f"- device: {r['device']}; {s['steps']} profiled steps after {r['warmup']} warm-up steps",
             f"- wall {s['wall_ms_per_step']:.2f} ms/step; device busy {s['device_busy_ms_per_step']:.2f} ms/step"
             + (f"; idle gaps {s['idle_ms_per_step']:.2f} ms/step" if s["idle_ms_per_step"] is not None else ""),
             f"- kernel launches per step: {s['kernel_launches_per_step']:.0f}; host calls that wait for the "
             f"device, per step: " + (", ".join(f"{k} {v:g}" for k, v in s["blocking_calls_per_step"].items())
                                      or "none"),
             *(f"- GPU span of `{r['name']}`: {r['ms_per_step']:.2f} ms/step" for r in s["annotated_ranges"]),
             ""]
    if s["top_kernels"]:
        lines += ["| kernel | calls/step | ms/step | share of busy |", "|---|---:|---:|---:|"]
        lines += [f"| `{k['name'][:90]}` | {k['calls_per_step']:g} | {k['ms_per_step']:.3f} | "
                  f"{100 * k['share_of_busy']:.1f}% |" for k in s["top_kernels"]]
    else:
        lines += ["| host op | ms/step |", "|---|---:|"]
        lines += [f"| `{k['name'][:90]}` | {k['ms_per_step']:.3f} |" for k in s["top_host_ops"]]
    return "\n".join(lines)


def profile_variant(args: argparse.Namespace) -> dict[str, Any]:
    s = bench.settings_from(bench.parse_args(["--device", args.device, "--preset", args.preset,
                                              "--seq-len", str(args.seq_len), "--variants", args.variant]))
    device = torch.device(s.device)
    autocast = bench.autocast_for(s, device)
    samples, _ = bench.open_samples(s, args.seq_len)
    batch_size = s.batch_for(args.seq_len)
    cfg = model_preset(args.preset, samples.vocab_size, pad_token_id=samples.special.pad)
    torch.manual_seed(s.seed)
    weights = BertForPreTraining(dataclasses.replace(cfg, kernels="torch")).state_dict()
    model, loss_fn, optimizer, kernels = bench.build_variant(bench.VARIANTS[args.variant], cfg, weights, s.lr,
                                                             device, args.seq_len)
    loader = PretrainingLoader(samples, BatchPlan.resolve(batch_size, batch_size, world_size=1), rank=0,
                               num_workers=s.workers, pin_memory=device.type == "cuda")

    def step() -> None:
        batch = to_device(loader.next_step()[0], device, non_blocking=True)
        with autocast():
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(s.warmup):
        step()
    probes.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        probes.synchronize(device)
        wall = time.perf_counter() - start
    if args.trace is not None:
        prof.export_chrome_trace(str(args.trace))
    return {"device": probes.environment(device)["device"], "preset": args.preset, "seq_len": args.seq_len,
            "batch_size": batch_size, "variant": args.variant, "kernels": kernels, "warmup": s.warmup,
            "summary": summarize(prof.events(), args.steps, wall, args.top)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bert_ds.tools.profile_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="base")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--variant", choices=sorted(bench.VARIANTS), default="a")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after the bench's warm-up steps)")
    p.add_argument("--top", type=int, default=25, help="kernels (or host ops) listed")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--trace", type=Path, default=None, help="also write a Chrome trace (large)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return guarded(lambda: _main(args))


def _main(args: argparse.Namespace) -> None:
    result = profile_variant(args)
    bench.write_report(markdown(result), result, args.json, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
