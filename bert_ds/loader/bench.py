"""``python -m bert_ds.loader.bench``: opening a dataset and drawing from it, beside the goals, and
how fast one loader process feeds a GPU with a model family's own samples.

``--preset NAME`` (default ``base``) picks the model family whose data is drawn, as the trainer
draws it for that preset (its record's ``data_defaults``): BERT's sentence pairs with
NSP and 15% masking in micro-batches of 32 samples; ModernBERT's whole documents (``[CLS] document
[SEP]``, a longer one cut into consecutive pieces) with no pair task and 30% masking, in token-budget
micro-batches of up to 32 x the sequence length tokens. ``--seq-len N [N ...]`` sets the lengths
measured (default: BERT 128; ModernBERT 1,024 and 8,192, those the preset's positions allow); the
measurements 1-4 below run at the first.

``--scale TOKENS [TOKENS ...]`` writes a synthetic dataset of each size
(:func:`bert_ds.data_tools.bench.write_synthetic`: sentences U[8,48] tokens, documents
U[5,60] sentences, at most 2,880 tokens; for a family of the documents layout U[5,600] sentences,
about 8,500 tokens on average, so that pieces of 8,192 tokens are often full) into a temporary
folder (``--keep DIR`` keeps it there, in ``DIR/tokens-N`` per size, ``tokens-N-long-documents``
for the long ones, and reuses it on the next run) and measures each in
turn; with several sizes it then prints how the drawing process's memory grows per further billion
tokens (goal: at most +50 MB). ``--data DIR`` measures an existing dataset instead. Every
measurement runs in a fresh spawned process that imports torch and the loader before its timer
starts, one at a time:

1. Cold open: the dataset opened as the trainer opens it (``open_pretraining_data``) with nothing
   cached (the sample map, and for sentences the sentence index, are built and written); its time
   and the peak RSS of the opening process (torch included, ~300 MB). Goal at 1B tokens: <= 8 s
   and <= 1.0 GB.
2. Two cold opens at once (two processes started together on an empty cache): the slower
   one's open time over figure 1's (goal <= 1.3x); the number of map builds is printed
   (one: the second process waits for the first and maps its file).
3. Cached open, then loader samples/s in one process (``dataset[i]`` for consecutive
   positions for ``--loader-seconds``; goal for BERT's samples at seq 128: >= 20,000 per core),
   then micro-batches through :class:`PretrainingLoader` for ``--draw-seconds``; the process's
   RSS after that (goal at 1B tokens: <= 600 MB, and at most +50 MB per further billion tokens),
   and its private (anonymous) part; the peak RSS of the cached open is printed below the
   table. The rest is file-backed: shared libraries, page cache shared by every process
   that maps them. The sample map, the sentence index and the token ids are read with
   ``pread`` (``FileArray``): no page of the dataset is mapped into the process, so the
   figure does not grow with the corpus.
4. Bytes per sample of the sample map on disk.
5. Per sequence length, in the same process after measurement 3 (each further length's map built
   before its timer starts): the real (non-pad) tokens per second that this one process draws
   through :class:`PretrainingLoader` for ``--draw-seconds``, whole micro-batches collated, beside
   what one GPU consumes at the goal MFU (:data:`bert_ds.model.flops.GOAL_MFU`, 50%): an H100's
   datasheet bf16 peak over the training FLOPs per token of the preset's model at full-length
   sequences of that length with the family's mask rate (:func:`bert_ds.model.flops.training_flops`,
   local layers counted by their window), and so the loader processes one GPU needs (rounded up).
   The model takes the dataset's vocabulary, as a training run does. The share of drawn samples
   that fill the length is printed beside it: a dataset whose documents are shorter than the length
   draws none, and its figures are those of shorter samples (the report says so).

The load average before and after is printed: the figures depend on what else runs.
"""

from __future__ import annotations

import argparse
import json
import math
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
from bert_ds.model.families import AnyModelConfig, family_of, family_of_preset, model_preset
from bert_ds.model.flops import DATASHEET_BF16_TFLOPS, GOAL_MFU, training_flops

MB = 1e6
GOALS_SEQ = 128  # the sequence length of BERT's samples that the samples/s goal is stated at
MICRO_BATCH = 32  # samples per micro-batch; under a token budget, MICRO_BATCH x the length in tokens
DEFAULT_PRESET = "base"  # BERT-Base: the sentence pairs this bench measured before it knew families
GPU = "H100"  # whose datasheet bf16 peak sizes one GPU's demand
_SUFFIX = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def _data_settings(preset: str) -> dict:
    """What this bench takes of ``preset``'s model family (its record): ``data``, the DataConfig
    fields the trainer gives the family (pair_task, layout, token_budget, mask_rate);
    ``seq_lens``, the lengths measured without --seq-len (its recipe's, as the training bench
    takes them on a GPU: BERT's 128 and 512, ModernBERT's 1,024 and 8,192).

    A ConfigError for a preset no family has."""
    family = family_of_preset(preset)
    return {"arch": family.arch, "data": dict(family.data_defaults),
            "seq_lens": [int(x) for x in family.bench.seq_lens["cuda"].split(",")]}


# -- measurements, each in its own spawned process -------------------------------------------------

def _status_rss() -> dict[str, float]:
    """This process's memory from /proc/self/status, in bytes: VmRSS, VmHWM (peak), RssAnon, RssFile."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = float(value.split()[0]) * 1024
    return out


def _open(path: str, data: dict, seq_len: int):
    """The training stream as the trainer opens it for a family's ``data`` settings at ``seq_len``."""
    from bert_ds.config import DataConfig
    from bert_ds.loader.pretraining import open_pretraining_data

    stream, _ = open_pretraining_data(DataConfig(train=path, max_seq_length=seq_len, **data), seed=0)
    return stream


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


def _cold_child(conn, path: str, data: dict, seq_len: int, together) -> None:
    import torch  # noqa: F401 -- imported before the timer: a fixed cost, not the open's

    import bert_ds.loader.pretraining  # noqa: F401

    builds = _count_builds()
    before = _status_rss()["VmRSS"]
    if together is not None:
        together.wait()  # every opener has its imports done: the opens start at once
    t0 = time.perf_counter()
    ds = _open(path, data, seq_len)
    seconds = time.perf_counter() - t0
    conn.send({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "rss_before_open": before, "builds": len(builds), "samples": len(ds)})


def _draw(ds, seq_len: int, seconds: float) -> dict:
    """Micro-batches of ``ds`` through the trainer's loader (in this process) for ``seconds``; what
    they held, the real (non-pad) tokens apart from the padded slots."""
    from bert_ds.config import BatchPlan
    from bert_ds.loader.pretraining import PretrainingLoader
    from bert_ds.model.padding import IGNORE_INDEX

    loader = PretrainingLoader(ds, BatchPlan.resolve(MICRO_BATCH, MICRO_BATCH, 1), rank=0)
    n = {"micro_batches": 0, "samples": 0, "real_tokens": 0, "padded_slots": 0, "masked_tokens": 0,
         "full_length": 0, "longest": 0}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for batch in loader.next_step():
            lengths = batch["attention_mask"].sum(dim=1)
            n["micro_batches"] += 1
            n["samples"] += len(lengths)
            n["real_tokens"] += int(lengths.sum())
            n["padded_slots"] += batch["attention_mask"].numel()
            n["masked_tokens"] += int((batch["labels"] != IGNORE_INDEX).sum())
            n["full_length"] += int((lengths == seq_len).sum())
            n["longest"] = max(n["longest"], int(lengths.max()))
    elapsed = time.perf_counter() - t0
    return {"seq_len": seq_len, **n, "seconds": elapsed, "real_tokens_per_s": n["real_tokens"] / elapsed}


def _cached_child(conn, path: str, data: dict, seq_lens: list[int], loader_seconds: float,
                  draw_seconds: float) -> None:
    import torch  # noqa: F401

    import bert_ds.loader.pretraining  # noqa: F401

    builds = _count_builds()
    t0 = time.perf_counter()
    ds = _open(path, data, seq_lens[0])
    seconds = time.perf_counter() - t0
    after_open = _status_rss()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < loader_seconds:
        for i in range(n, n + 64):
            ds[i]
        n += 64
    draws = [_draw(ds, seq_lens[0], draw_seconds)]
    result = {"seconds": seconds, "builds": len(builds), "rss_after_open": after_open,
              "rss_after_draws": _status_rss(), "samples_per_s": n / elapsed, "sample_seconds": elapsed,
              "drawn": draws[0]["samples"], "draw_seconds": draws[0]["seconds"], "map_file": str(ds._map.path),
              "map_header": ds._map.offset, "samples": len(ds)}
    for seq_len in seq_lens[1:]:  # its map is built here, before its draws are timed
        draws.append(_draw(_open(path, data, seq_len), seq_len, draw_seconds))
    conn.send({**result, "draws": draws})


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
    """Remove the dataset's cached maps (sentences: samples-*; documents: pieces-*) and sentence
    index (sentences-*, documents-*): the next open is cold."""
    for pattern in ("samples-*", "pieces-*", "sentences-*", "documents-*"):
        for f in (path / ".cache").glob(pattern):
            f.unlink()


# -- what one GPU consumes -------------------------------------------------------------------------

def goal_gpu() -> dict:
    """The GPU whose demand is printed: :data:`GPU`, its datasheet bf16 peak and the project's goal
    MFU (:data:`bert_ds.model.flops.GOAL_MFU`)."""
    return {"name": GPU, "bf16_peak_tflops": DATASHEET_BF16_TFLOPS[GPU], "mfu_goal": GOAL_MFU}


def gpu_demand(model: AnyModelConfig, seq_len: int, mask_rate: float, local_window: int, gpu: dict) -> dict:
    """The real tokens per second one ``gpu`` (:func:`goal_gpu`) trains on at its goal MFU:
    goal x datasheet peak / the training FLOPs per token of ``model`` on full-length sequences of
    ``seq_len`` tokens, ``mask_rate`` of them masked; ``local_window``: the local layers' (0: none)."""
    pairs = 0
    if local_window:
        import torch

        from bert_ds.kernels.local_attention import local_pairs

        pairs = int(local_pairs(torch.tensor([seq_len]), local_window).sum())
    per_token = training_flops(model, seq_len, seq_len * seq_len, mask_rate * seq_len, pairs) / seq_len
    return {"flops_per_token": per_token,
            "tokens_per_s": gpu["mfu_goal"] * gpu["bf16_peak_tflops"] * 1e12 / per_token}


def per_length(draws: list[dict], model: AnyModelConfig, mask_rate: float, local_window: int,
               gpu: dict) -> list[dict]:
    """Measurement 5's rows: each length's draws beside one GPU's demand (:func:`gpu_demand`) and the
    loader processes that demand needs, rounded up."""
    rows = []
    for draw in draws:
        demand = gpu_demand(model, draw["seq_len"], mask_rate, local_window, gpu)
        rows.append({**draw, "gpu_flops_per_token": demand["flops_per_token"],
                     "gpu_tokens_per_s": demand["tokens_per_s"],
                     "loader_processes_per_gpu": math.ceil(demand["tokens_per_s"] / draw["real_tokens_per_s"])})
    return rows


# -- the run ---------------------------------------------------------------------------------------

@contextmanager
def _dataset(data: str | None, scale: int | None, keep: str | None, layout: str, log):
    """The dataset measured: ``data``, or a synthetic one of ``scale`` tokens whose documents suit
    ``layout`` (whole-document pieces of 8,192 tokens need documents that long)."""
    from bert_ds.data_tools.bench import LONG_DOCUMENT, SYNTHETIC_DOCUMENT

    if data is not None:
        yield Path(data), None
        return
    folder = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="loader_bench_"))
    try:
        totals = _synthetic(folder, scale, LONG_DOCUMENT if layout == "documents" else SYNTHETIC_DOCUMENT, log)
        yield folder, totals
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def _synthetic(folder: Path, scale: int, document: tuple[int, int], log) -> dict:
    from bert_ds.data_tools.bench import synthetic_description, write_synthetic
    from bert_ds.data_tools.manifest import Manifest

    if (folder / "manifest.json").is_file():
        manifest = Manifest.load(folder)
        if manifest.build.get("synthetic") == synthetic_description(scale, document=document):
            log(f"bench: reusing the synthetic dataset in {folder}")
            return dict(manifest.totals, write_seconds=None)
    if folder.exists() and any(folder.iterdir()):
        raise UserError(f"--keep {folder}: exists and holds something else than this scale's synthetic dataset "
                        "of this layout's documents")
    log(f"bench: writing {scale:,} synthetic tokens to {folder}")
    t0 = time.perf_counter()
    totals = write_synthetic(folder, scale, document=document)
    return dict(totals, write_seconds=time.perf_counter() - t0)


def run(data: str | None, scale: int | None, keep: str | None, loader_seconds: float, draw_seconds: float,
        preset: str, seq_lens: list[int], log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """Every measurement of ``preset``'s family's data, 1-4 at ``seq_lens[0]``, 5 at each of
    ``seq_lens``; the dict that --json writes."""
    family = _data_settings(preset)
    settings = family["data"]
    load_before = os.getloadavg()
    with _dataset(data, scale, keep, settings["layout"], log) as (path, totals):
        from bert_ds.data_tools.manifest import Manifest

        manifest = Manifest.load(path)
        totals = totals or dict(manifest.totals)
        seq = seq_lens[0]
        log(f"bench: 1. cold open at seq {seq}")
        _drop_cache(path)
        one = _result(*_spawn(_cold_child, str(path), settings, seq, None))
        if one["builds"] != 1:
            raise UserError(f"{path}: the cold open found a cached sample map (a read-only folder keeps it in "
                            "the user cache); measure a writable copy")
        log("bench: 2. two cold opens at once")
        _drop_cache(path)
        together = _CTX.Barrier(2)
        pair = [_spawn(_cold_child, str(path), settings, seq, together) for _ in range(2)]
        two = [_result(*p) for p in pair]
        log(f"bench: 3. cached open, {loader_seconds:g} s of samples, {draw_seconds:g} s of batches per length "
            f"({', '.join(map(str, seq_lens))})")
        cached = _result(*_spawn(_cached_child, str(path), settings, seq_lens, loader_seconds, draw_seconds))
        map_bytes = Path(cached["map_file"]).stat().st_size
    model = model_preset(preset, manifest.vocab_size)
    window = family_of(model).local_window(model)
    gpu = goal_gpu()
    lengths = per_length(cached.pop("draws"), model, settings["mask_rate"], window, gpu)
    return {"dataset": str(path) if data else f"synthetic, {scale:,} tokens", "totals": totals,
            "preset": preset, "arch": family["arch"], "data_settings": settings, "seq_lens": seq_lens,
            "vocab_size": manifest.vocab_size, "local_window": window, "micro_batch": MICRO_BATCH,
            "cpus": len(os.sched_getaffinity(0)), "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "cold": one, "two_cold": two, "cached": cached, "map_bytes": map_bytes, "gpu": gpu,
            "per_length": lengths}


def figures(r: dict) -> list[tuple[str, str, str, bool | None]]:
    """(name, measured, goal, met) rows; met is None where the goal is stated for another scale,
    or for other samples."""
    billions = r["totals"]["tokens"] / 1e9
    at_scale = abs(billions - 1) < 0.05
    bert_samples = r["data_settings"] == _data_settings(DEFAULT_PRESET)["data"] and r["seq_lens"][0] == GOALS_SEQ
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
        ("loader samples/s per core", f"{cached['samples_per_s']:,.0f}", f">= 20,000 (BERT, seq {GOALS_SEQ})",
         cached["samples_per_s"] >= 20_000 if bert_samples else None),
        ("sample map bytes per sample", f"{per_sample:.1f}", "<= 12", per_sample <= 12),
    ]


def _describe_batches(r: dict, seq_len: int) -> str:
    if r["data_settings"]["token_budget"]:
        return f"token-budget micro-batches of up to {r['micro_batch']} x {seq_len:,} tokens"
    return f"micro-batches of {r['micro_batch']} samples"


def format_report(r: dict, figs) -> str:
    t, cold, cached, d = r["totals"], r["cold"], r["cached"], r["data_settings"]
    after = cached["rss_after_draws"]
    seq = r["seq_lens"][0]
    lines = [
        f"dataset: {r['dataset']}: {t['tokens']:,} tokens, {t['sentences']:,} sentences, {t['docs']:,} documents; "
        f"{cached['samples']:,} samples at seq {seq}; {r['cpus']} CPU(s); load average "
        f"{r['load_average_before'][0]:.2f} before, {r['load_average_after'][0]:.2f} after",
        f"preset {r['preset']} ({r['arch']}): layout {d['layout']}, pair task {d['pair_task']}, "
        f"{d['mask_rate']:.0%} masked, {_describe_batches(r, seq)}",
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
        f"cached open: {cached['builds']} build(s); {cached['drawn']:,} samples in {_describe_batches(r, seq)} over "
        f"{cached['draw_seconds']:.1f} s; RSS {after['VmRSS'] / MB:,.0f} MB = anonymous "
        f"{after['RssAnon'] / MB:,.0f} MB + file-backed (shared page cache) {after['RssFile'] / MB:,.0f} MB; "
        f"after the open {cached['rss_after_open']['VmRSS'] / MB:,.0f} MB (peak until then "
        f"{cached['rss_after_open']['VmHWM'] / MB:,.0f} MB)",
        f"sample map: {r['map_bytes']:,} bytes on disk",
        f"-: goal stated for 1B tokens, not this scale, or for BERT's samples at seq {GOALS_SEQ}, or no goal",
        "",
        *format_lengths(r),
    ]
    return "\n".join(lines)


def format_lengths(r: dict) -> list[str]:
    """Measurement 5: per sequence length, one loader process's real tokens/s beside one GPU's demand."""
    g = r["gpu"]
    lines = [
        f"per sequence length: real (non-pad) tokens/s drawn by one loader process against what one {g['name']} "
        f"trains on at {g['mfu_goal']:.0%} MFU ({g['bf16_peak_tflops']:,.0f} TFLOP/s bf16 datasheet; {r['preset']}, vocabulary "
        f"{r['vocab_size']:,}, full-length sequences, {r['data_settings']['mask_rate']:.0%} masked)",
        f"{'length':<10}{'drawn tok/s':>14}{'full-length':>13}{'GFLOP/token':>13}{'GPU tok/s':>14}{'loaders/GPU':>13}",
    ]
    for row in r["per_length"]:
        seq = f"seq {row['seq_len']:,}"
        lines.append(f"{seq:<10}{row['real_tokens_per_s']:>14,.0f}{row['full_length'] / row['samples']:>13.1%}"
                     f"{row['gpu_flops_per_token'] / 1e9:>13.4f}{row['gpu_tokens_per_s']:>14,.0f}"
                     f"{row['loader_processes_per_gpu']:>13,}")
    for row in r["per_length"]:
        lines.append(f"seq {row['seq_len']:,}: {row['real_tokens']:,} real tokens of {row['padded_slots']:,} padded "
                     f"slots in {row['micro_batches']:,} micro-batches ({row['samples']:,} samples, longest "
                     f"{row['longest']:,} tokens, {row['masked_tokens'] / row['real_tokens']:.1%} masked) over "
                     f"{row['seconds']:.1f} s")
    short = [row["seq_len"] for row in r["per_length"] if row["full_length"] == 0]
    if short:
        lines.append(f"no drawn sample filled seq {', '.join(f'{n:,}' for n in short)}: the documents are shorter, "
                     "and the tokens/s drawn are those of shorter samples (the GPU's demand is for full ones)")
    return lines


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


def _seq_lens(given: list[str] | None, defaults: list[int], positions: int) -> list[int]:
    """--seq-len's lengths, each in [8, ``positions``] (the loader's shortest sample, the model's
    longest); without it, those of the family's ``defaults`` the model's positions allow."""
    if given is None:
        return [n for n in defaults if n <= positions] or [positions]
    lengths = []
    for text in given:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n <= 0:
            raise UserError(f"--seq-len takes positive integers, got {text!r}")
        if not 8 <= n <= positions:
            raise UserError(f"--seq-len {n}: must be in [8, {positions}] (8: the loader's shortest sample; "
                            f"{positions}: the preset's positions)")
        lengths.append(n)
    return lengths


def _vocab_size(data: str | None) -> int:
    """The vocabulary of the data measured: --data's, else the synthetic datasets'."""
    if data is None:
        from bert_ds.data_tools.bench import BERT_VOCAB_SIZE

        return BERT_VOCAB_SIZE
    from bert_ds.data_tools.manifest import Manifest

    return Manifest.load(Path(data)).vocab_size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bert_ds.loader.bench", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--scale", type=_tokens, nargs="+", metavar="TOKENS",
                     help="write a synthetic dataset of TOKENS tokens (several: one each, and the growth between)")
    src.add_argument("--data", metavar="DIR", help="measure an existing dataset (its map and index cache is cleared)")
    p.add_argument("--keep", metavar="DIR", help="with --scale: keep the datasets in DIR/tokens-N (reused)")
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help="model preset whose family's data is drawn (its layout, pair task, masking, batches) and "
                        "whose FLOPs size the GPU's demand (default: %(default)s)")
    p.add_argument("--seq-len", nargs="+", metavar="N",
                   help="sequence lengths measured; 1-4 at the first (default: BERT 128; ModernBERT 1024 8192)")
    p.add_argument("--loader-seconds", type=_seconds, default=5.0, metavar="S", help="samples/s measured for S s")
    p.add_argument("--draw-seconds", type=_seconds, default=10.0, metavar="S",
                   help="batches drawn for S s, at each length")
    p.add_argument("--json", metavar="FILE", help="also write every measurement to FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return guarded(lambda: _bench(args), interrupted="no report written")


def _bench(args: argparse.Namespace) -> None:
    if args.keep and args.data:
        raise UserError("--keep goes with --scale (a dataset given with --data is never removed)")
    family = _data_settings(args.preset)
    positions = model_preset(args.preset, _vocab_size(args.data)).max_position_embeddings
    seq_lens = _seq_lens(args.seq_len, family["seq_lens"], positions)
    runs = []
    for scale in args.scale or [None]:
        # one folder per size and document shape: the documents layout's are long (see _dataset)
        long = "-long-documents" if family["data"]["layout"] == "documents" else ""
        keep = str(Path(args.keep) / f"tokens-{scale}{long}") if args.keep else None
        r = run(args.data, scale, keep, args.loader_seconds, args.draw_seconds, args.preset, seq_lens)
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
