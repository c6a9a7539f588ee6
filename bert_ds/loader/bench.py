"""``python -m bert_ds.loader.bench``: opening a dataset and drawing from it, beside the goals.

``--scale TOKENS [TOKENS ...]`` writes a synthetic dataset of each size
(:func:`bert_ds.data_tools.bench.write_synthetic`: sentences U[8,48] tokens, documents
U[5,60] sentences) into a temporary folder (``--keep DIR`` keeps it there, in
``DIR/tokens-N`` per size, and reuses it on the next run) and measures each in turn; with
several sizes it then prints how the drawing process's memory grows per further billion
tokens (goal: at most +50 MB). ``--data DIR`` measures an existing dataset instead. Sequence length 128,
NSP and masking. Every measurement runs in a fresh spawned process that imports torch
and the loader before its timer starts, one at a time:

1. Cold open: ``PretrainingDataset(...)`` with nothing cached (the sample map and the
   sentence index are built and written); its time and the peak RSS of the opening
   process (torch included, ~300 MB). Goal at 1B tokens: <= 8 s and <= 1.0 GB.
2. Two cold opens at once (two processes started together on an empty cache): the slower
   one's open time over figure 1's (goal <= 1.3x); the number of map builds is printed
   (one: the second process waits for the first and maps its file).
3. Cached open, then loader samples/s in one process (``dataset[i]`` for consecutive
   positions for ``--loader-seconds``; goal >= 20,000 per core), then micro-batches of 32
   through :class:`PretrainingLoader` for ``--draw-seconds``; the process's RSS after
   that (goal at 1B tokens: <= 600 MB, and at most +50 MB per further billion tokens),
   and its private (anonymous) part; the peak RSS of the cached open is printed below the
   table. The rest is file-backed: shared libraries, page cache shared by every process
   that maps them. The sample map, the sentence index and the token ids are read with
   ``pread`` (``FileArray``): no page of the dataset is mapped into the process, so the
   figure does not grow with the corpus.
4. Bytes per sample of the sample map on disk.

The load average before and after is printed: the figures depend on what else runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import UserError, guarded

MB = 1e6
SEQ = 128
MICRO_BATCH = 32
_SUFFIX = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


# -- measurements, each in its own spawned process -------------------------------------------------

def _status_rss() -> dict[str, float]:
    """This process's memory from /proc/self/status, in bytes: VmRSS, VmHWM (peak), RssAnon, RssFile."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = float(value.split()[0]) * 1024
    return out


def _open(path: str):
    from bert_ds.config import DataConfig
    from bert_ds.loader.pretraining import PretrainingDataset

    return PretrainingDataset(path, DataConfig(train=path, max_seq_length=SEQ), seed=0)


def _count_builds():
    """A list that gains an entry each time this process builds a sample map."""
    import logging

    builds: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: builds.append(record.getMessage())
    logger = logging.getLogger("bert_ds.loader.sample_map")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return builds


def _cold_child(conn, path: str, together) -> None:
    import torch  # noqa: F401 -- imported before the timer: a fixed cost, not the open's

    import bert_ds.loader.pretraining  # noqa: F401

    builds = _count_builds()
    before = _status_rss()["VmRSS"]
    if together is not None:
        together.wait()  # every opener has its imports done: the opens start at once
    t0 = time.perf_counter()
    ds = _open(path)
    seconds = time.perf_counter() - t0
    conn.send({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "rss_before_open": before, "builds": len(builds), "samples": len(ds)})


def _cached_child(conn, path: str, loader_seconds: float, draw_seconds: float) -> None:
    import torch  # noqa: F401

    from bert_ds.config import BatchPlan
    from bert_ds.loader.pretraining import PretrainingLoader

    builds = _count_builds()
    t0 = time.perf_counter()
    ds = _open(path)
    seconds = time.perf_counter() - t0
    after_open = _status_rss()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < loader_seconds:
        for i in range(n, n + 64):
            ds[i]
        n += 64
    loader = PretrainingLoader(ds, BatchPlan.resolve(MICRO_BATCH, MICRO_BATCH, 1), rank=0)
    drawn, t1 = 0, time.perf_counter()
    while time.perf_counter() - t1 < draw_seconds:
        loader.next_step()
        drawn += MICRO_BATCH
    conn.send({"seconds": seconds, "builds": len(builds), "rss_after_open": after_open,
               "rss_after_draws": _status_rss(), "samples_per_s": n / elapsed, "sample_seconds": elapsed,
               "drawn": drawn,
               "draw_seconds": time.perf_counter() - t1, "map_file": str(ds._map.path), "map_header": ds._map.offset,
               "samples": len(ds)})


_CTX = multiprocessing.get_context("spawn")


def _spawn(target, *args):
    ctx = _CTX
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(send, *args))
    proc.start()
    send.close()
    return proc, recv


def _result(proc, recv) -> dict:
    try:
        result = recv.recv()
    except EOFError:
        result = None
    proc.join()
    if result is None:
        raise RuntimeError(f"loader bench: a measuring process died (exit status {proc.exitcode})")
    return result


def _drop_cache(path: Path) -> None:
    """Remove the dataset's cached sample maps and sentence index: the next open is cold."""
    for pattern in ("samples-*", "sentences-*", "documents-*"):
        for f in (path / ".cache").glob(pattern):
            f.unlink()


# -- the run ---------------------------------------------------------------------------------------

@contextmanager
def _dataset(data: str | None, scale: int | None, keep: str | None, log):
    if data is not None:
        yield Path(data), None
        return
    folder = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="loader_bench_"))
    try:
        totals = _synthetic(folder, scale, log)
        yield folder, totals
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def _synthetic(folder: Path, scale: int, log) -> dict:
    from bert_ds.data_tools.bench import write_synthetic
    from bert_ds.data_tools.manifest import Manifest

    if (folder / "manifest.json").is_file():
        manifest = Manifest.load(folder)
        if manifest.build.get("synthetic", "").startswith(f"{scale} tokens"):
            log(f"bench: reusing the synthetic dataset in {folder}")
            return dict(manifest.totals, write_seconds=None)
    if folder.exists() and any(folder.iterdir()):
        raise UserError(f"--keep {folder}: exists and holds something else than this scale's synthetic dataset")
    log(f"bench: writing {scale:,} synthetic tokens to {folder}")
    t0 = time.perf_counter()
    totals = write_synthetic(folder, scale)
    return dict(totals, write_seconds=time.perf_counter() - t0)


def run(data: str | None, scale: int | None, keep: str | None, loader_seconds: float, draw_seconds: float,
        log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """Every measurement; the dict that --json writes."""
    load_before = os.getloadavg()
    with _dataset(data, scale, keep, log) as (path, totals):
        from bert_ds.data_tools.manifest import Manifest

        totals = totals or dict(Manifest.load(path).totals)
        log("bench: 1. cold open")
        _drop_cache(path)
        one = _result(*_spawn(_cold_child, str(path), None))
        if one["builds"] != 1:
            raise UserError(f"{path}: the cold open found a cached sample map (a read-only folder keeps it in "
                            "the user cache); measure a writable copy")
        log("bench: 2. two cold opens at once")
        _drop_cache(path)
        together = _CTX.Barrier(2)
        pair = [_spawn(_cold_child, str(path), together) for _ in range(2)]
        two = [_result(*p) for p in pair]
        log(f"bench: 3. cached open, {loader_seconds:g} s of samples, {draw_seconds:g} s of batches")
        cached = _result(*_spawn(_cached_child, str(path), loader_seconds, draw_seconds))
        map_bytes = Path(cached["map_file"]).stat().st_size
    return {"dataset": str(path) if data else f"synthetic, {scale:,} tokens", "totals": totals,
            "cpus": len(os.sched_getaffinity(0)), "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "cold": one, "two_cold": two, "cached": cached, "map_bytes": map_bytes}


def figures(r: dict) -> list[tuple[str, str, str, bool | None]]:
    """(name, measured, goal, met) rows; met is None where the goal is stated for another scale."""
    billions = r["totals"]["tokens"] / 1e9
    at_scale = abs(billions - 1) < 0.05
    cold, cached = r["cold"], r["cached"]
    ratio = max(t["seconds"] for t in r["two_cold"]) / cold["seconds"]
    rss, anon = cached["rss_after_draws"]["VmRSS"], cached["rss_after_draws"]["RssAnon"]
    rss_goal = 600 * MB + 50 * MB * max(0.0, billions - 1)
    per_sample = (r["map_bytes"] - cached["map_header"]) / cached["samples"]
    scaled = (lambda met: met) if at_scale else (lambda met: None)
    return [
        ("cold open time", f"{cold['seconds']:.3f} s", "<= 8 s at 1B tokens", scaled(cold["seconds"] <= 8)),
        ("cold open peak RSS", f"{cold['peak_rss'] / MB:,.0f} MB", "<= 1,000 MB at 1B tokens",
         scaled(cold["peak_rss"] <= 1000 * MB)),
        ("two cold opens at once / one", f"{ratio:.2f}x", "<= 1.3x", ratio <= 1.3),
        ("cached open time", f"{cached['seconds']:.3f} s", "", None),
        ("RSS after cached open + draws", f"{rss / MB:,.0f} MB", f"<= {rss_goal / MB:,.0f} MB",
         rss <= rss_goal if billions >= 0.95 else None),
        ("its private (anonymous) part", f"{anon / MB:,.0f} MB", f"<= {rss_goal / MB:,.0f} MB",
         anon <= rss_goal if billions >= 0.95 else None),
        ("loader samples/s per core", f"{cached['samples_per_s']:,.0f}", ">= 20,000",
         cached["samples_per_s"] >= 20_000),
        ("sample map bytes per sample", f"{per_sample:.1f}", "<= 12", per_sample <= 12),
    ]


def format_report(r: dict, figs) -> str:
    t, cold, cached = r["totals"], r["cold"], r["cached"]
    after = cached["rss_after_draws"]
    lines = [
        f"dataset: {r['dataset']}: {t['tokens']:,} tokens, {t['sentences']:,} sentences, {t['docs']:,} documents; "
        f"{cached['samples']:,} samples at seq {SEQ}; {r['cpus']} CPU(s); load average "
        f"{r['load_average_before'][0]:.2f} before, {r['load_average_after'][0]:.2f} after",
        "",
        f"{'figure':<34}{'measured':>12}  {'goal':<30}met",
    ]
    for i, (name, shown, goal, met) in enumerate(figs, 1):
        verdict = "-" if met is None else ("yes" if met else "NO")
        lines.append(f"{f'{i}. {name}':<34}{shown:>12}  {goal:<30}{verdict}")
    lines += [
        "",
        f"cold open: {cold['builds']} build(s); RSS {cold['rss_before_open'] / MB:,.0f} MB before the open "
        f"(torch and the loader imported)",
        f"two cold opens: {' and '.join(format(x['seconds'], '.2f') + ' s' for x in r['two_cold'])}; "
        f"{sum(x['builds'] for x in r['two_cold'])} build(s) between them",
        f"cached open: {cached['builds']} build(s); {cached['drawn']:,} samples in batches of {MICRO_BATCH} over "
        f"{cached['draw_seconds']:.1f} s; RSS {after['VmRSS'] / MB:,.0f} MB = anonymous "
        f"{after['RssAnon'] / MB:,.0f} MB + file-backed (shared page cache) {after['RssFile'] / MB:,.0f} MB; "
        f"after the open {cached['rss_after_open']['VmRSS'] / MB:,.0f} MB (peak until then "
        f"{cached['rss_after_open']['VmHWM'] / MB:,.0f} MB)",
        f"sample map: {r['map_bytes']:,} bytes on disk",
        "-: goal stated for 1B tokens, not this scale, or no goal",
    ]
    return "\n".join(lines)


def _tokens(text: str) -> int:
    """'1e9', '1000000000', '1B', '200M', '50k' -> a token count."""
    t = text.strip().lower()
    mult = _SUFFIX.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 1e9, 1B, 200M)") from None
    if value < 1000:
        raise argparse.ArgumentTypeError(f"--scale {text}: at least 1000 tokens")
    return int(value)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bert_ds.loader.bench", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--scale", type=_tokens, nargs="+", metavar="TOKENS",
                     help="write a synthetic dataset of TOKENS tokens (several: one each, and the growth between)")
    src.add_argument("--data", metavar="DIR", help="measure an existing dataset (its map and index cache is cleared)")
    p.add_argument("--keep", metavar="DIR", help="with --scale: keep the datasets in DIR/tokens-N (reused)")
    p.add_argument("--loader-seconds", type=_seconds, default=5.0, metavar="S", help="samples/s measured for S s")
    p.add_argument("--draw-seconds", type=_seconds, default=10.0, metavar="S", help="batches drawn for S s")
    p.add_argument("--json", metavar="FILE", help="also write every measurement to FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return guarded(lambda: _bench(args), interrupted="no report written")


def _bench(args: argparse.Namespace) -> None:
    if args.keep and args.data:
        raise UserError("--keep goes with --scale (a dataset given with --data is never removed)")
    runs = []
    for scale in args.scale or [None]:
        keep = str(Path(args.keep) / f"tokens-{scale}") if args.keep else None
        r = run(args.data, scale, keep, args.loader_seconds, args.draw_seconds)
        figs = figures(r)
        r["figures"] = [{"name": n, "measured": m, "goal": g, "met": ok} for n, m, g, ok in figs]
        print(format_report(r, figs) + "\n", flush=True)
        runs.append(r)
    result = {"runs": runs, "growth": growth(runs) if len(runs) > 1 else None}
    if result["growth"]:
        print(format_growth(result["growth"]))
    if args.json:
        atomic_write(args.json, json.dumps(result, indent=2) + "\n")


def growth(runs: list[dict]) -> dict:
    """How the drawing process's memory grows from the smallest to the largest dataset, per
    further billion tokens."""
    small, large = min(runs, key=lambda r: r["totals"]["tokens"]), max(runs, key=lambda r: r["totals"]["tokens"])
    billions = (large["totals"]["tokens"] - small["totals"]["tokens"]) / 1e9
    rss = {k: (large["cached"]["rss_after_draws"][k] - small["cached"]["rss_after_draws"][k]) / max(billions, 1e-9)
           for k in ("VmRSS", "RssAnon", "RssFile")}
    return {"from_tokens": small["totals"]["tokens"], "to_tokens": large["totals"]["tokens"],
            "per_billion": rss, "goal_per_billion": 50 * MB, "met": rss["VmRSS"] <= 50 * MB}


def format_growth(g: dict) -> str:
    per = g["per_billion"]
    return (f"growth from {g['from_tokens']:,} to {g['to_tokens']:,} tokens, per further billion tokens: RSS after "
            f"the cached open and the draws {per['VmRSS'] / MB:+,.1f} MB (private {per['RssAnon'] / MB:+,.1f} MB, "
            f"file-backed {per['RssFile'] / MB:+,.1f} MB); goal <= +50 MB: {'yes' if g['met'] else 'NO'}")


if __name__ == "__main__":
    sys.exit(main())
