"""What one drawing process costs: samples per CPU second and resident memory, on one dataset.

    python benchmarks/loader_cost.py --data DIR
    python benchmarks/loader_cost.py --synthetic 4e6 --shard-tokens 2000   # a corpus of many shards

It draws ``--draws`` random positions per round (``ds[p]``: map, index and tokens read, pair built,
masked) for ``--rounds`` rounds and prints each round's samples per CPU second (the process's own
CPU time: steadier than the clock on a shared machine) and their median, the number of shards,
and the process's RSS after the open and after the draws. It measures the ``bert_ds`` that Python
imports, so two commits compare by running it with ``PYTHONPATH`` set to each checkout in turn,
alternating, on the same dataset (the sample maps of both are cached side by side).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(data: Path, rounds: int, draws: int, pair_task: str) -> dict:
    import numpy as np
    import torch  # noqa: F401 -- as in a trainer: its libraries are part of the process's memory

    from bert_ds.config import DataConfig
    from bert_ds.loader.pretraining import PretrainingDataset

    cfg = DataConfig(train=str(data), max_seq_length=128, pair_task=pair_task)
    PretrainingDataset(data, cfg, seed=0)  # builds the caches: the measured open is a cached one
    ds = PretrainingDataset(data, cfg, seed=0)
    after_open = _rss_mb()
    rng = np.random.default_rng(1)
    rates = []
    for _ in range(rounds):
        positions = rng.integers(0, len(ds), draws).tolist()
        t0 = time.process_time()
        for p in positions:
            ds[p]
        rates.append(draws / (time.process_time() - t0))
    return {"samples": len(ds), "shards": len(ds._shards), "rates": rates, "median": statistics.median(rates),
            "rss_after_open_mb": after_open, "rss_after_draws_mb": _rss_mb()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=Path, help="an existing dataset folder (or parent of parts)")
    src.add_argument("--synthetic", type=float, metavar="TOKENS", help="write a synthetic dataset of TOKENS tokens")
    p.add_argument("--shard-tokens", type=int, default=1 << 26, help="with --synthetic: tokens per shard")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--draws", type=int, default=20_000, help="random positions per round")
    p.add_argument("--pair-task", default="nsp", choices=["nsp", "sop", "none"])
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loader_cost_") as tmp:
        data = args.data
        if data is None:
            from bert_ds.data_tools.bench import write_synthetic

            data = Path(tmp) / "data"
            write_synthetic(data, int(args.synthetic), shard_tokens=args.shard_tokens)
        r = measure(data, args.rounds, args.draws, args.pair_task)
    print(f"{data}: {r['samples']:,} samples in {r['shards']:,} shard(s); samples per CPU second "
          f"{', '.join(f'{x:,.0f}' for x in r['rates'])}: median {r['median']:,.0f}; RSS after the open "
          f"{r['rss_after_open_mb']:,.0f} MB, after the draws {r['rss_after_draws_mb']:,.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
