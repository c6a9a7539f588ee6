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

On a CPU the same run profiles the host ops (there are no kernels and no gaps). The
training run's own steps, engine included, are profiled by ``python -m bert_ds.train
--profile-steps`` (:mod:`bert_ds.train.profiling`, the same summary). torch and the model are
imported once the command line is read: ``--help`` needs neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from bert_ds.base.errors import guarded
from bert_ds.base.interrupts import import_whole
from bert_ds.tools import bench
from bert_ds.model.families import FAMILIES

def markdown(r: dict[str, Any]) -> str:
    from bert_ds.train.profiling import summary_lines

    return "\n".join([f"## One training step, profiled: {r['preset']}, seq {r['seq_len']}, batch {r['batch_size']}, "
                      f"variant ({r['variant']}) {r['kernels']}",
                      "",
                      f"- device: {r['device']}; {r['summary']['steps']} profiled steps after {r['warmup']} "
                      "warm-up steps",
                      *summary_lines(r["summary"])])


def profile_variant(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bert_ds.config import BatchPlan
    from bert_ds.kernels import probes
    from bert_ds.loader.pretraining import PretrainingLoader, to_device
    from bert_ds.model.build import build_model
    from bert_ds.model.families import model_preset
    from bert_ds.tools import bench_variants
    from bert_ds.train.profiling import TOP, summarize

    s = bench.settings_from(bench.parse_args(["--device", args.device or bench.visible_device(), "--preset",
                                              args.preset, "--seq-len", str(args.seq_len), "--variants", args.variant]))
    device = torch.device(s.device)
    autocast = bench_variants.autocast_for(s, device)
    samples, _ = bench_variants.open_samples(s, args.seq_len)
    batch_size = s.batch_for(args.seq_len)
    cfg = model_preset(args.preset, samples.vocab_size, pad_token_id=samples.special.pad)
    torch.manual_seed(s.seed)
    weights = build_model(dataclasses.replace(cfg, kernels="torch")).state_dict()
    model, loss_fn, optimizer, kernels = bench_variants.build_variant(s.family.bench.variants[args.variant], cfg, weights,
                                                                      s.lr, device, args.seq_len)
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
            "summary": summarize(prof.events(), args.steps, wall, TOP if args.top is None else args.top)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bert_ds.tools.profile_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda where torch sees a CUDA device, else cpu")
    p.add_argument("--preset", default="base")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--variant", choices=sorted({k for f in FAMILIES.values() for k in f.bench.variants}), default="a",
                   help="one of the preset's family's bench variants (python -m bert_ds.tools.bench --help)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after the bench's warm-up steps)")
    p.add_argument("--top", type=int, default=None,
                   help="kernels (or host ops) listed (default: as many as bert_ds.train --profile-steps lists)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--trace", type=Path, default=None, help="also write a Chrome trace (large)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return guarded(lambda: _main(args), interrupted="no profile written")


def _main(args: argparse.Namespace) -> None:
    import_whole("torch")
    result = profile_variant(args)
    bench.write_report(markdown(result), result, args.json, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
