"""One page for a run of ``benchmarks/gpu_checks.sh``: SUMMARY.md in its results folder.

    python -m bert_ds.tools.gpu_summary RESULTS_DIR

Reads what the steps wrote (``steps.txt``, the logs, ``kernels_bench.json``, ``bench.json``,
``profile.json``, ``train_base_summary.json``, ``train_base_metrics.jsonl``,
``train_base_profile.json`` and ``train_base512_profile.json``) and writes
``RESULTS_DIR/SUMMARY.md``, also printed:

- the device, driver and versions (torch, CUDA, Python, transformers, tokenizers,
  DeepSpeed: read in this process, which runs on the same Python as the steps), the commit;
- each step's status, seconds and budget;
- ``kernels=auto``'s verdicts per op (fused or native, and both times) and the fused ops'
  tests;
- each fused op at BERT-Base shapes: time, rate, share of the measured copy bandwidth or
  matmul peak, and the fastest other implementation;
- BERT-Base at seq 128 and 512: real tokens/s and MFU of bert-ds fused, bert-ds on
  PyTorch's ops and transformers, the goals, and the projected seed run;
- one profiled step: wall, GPU-busy and idle time, launches, host syncs, top kernels;
- the engine path a user runs (``train_base``): real tokens/s, MFU, step time, data wait,
  and three of its steps profiled the same way (``--profile-steps``), engine included;
- the shipped config's step through the engine at seq 128 and 512 (``train_base``,
  ``train_base512``) by bucket: GEMM, attention, normalization, elementwise, reductions,
  copies, idle;
- the engine path's variants side by side (``engine_sweep/``, :mod:`bert_ds.tools.engine_sweep`):
  micro-batch sizes, ``overlap_comm``, PyTorch's ops, the layers compiled, each step split by stage;
- the hand-fused kernels against the layers compiled (``--compile-layers``), in the bench loop
  and through the engine: which is faster on the device.

A file that a failed step did not write is named as missing: nothing here fails because
a step did, so the page is written on every run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from bert_ds.base.errors import UserError, guarded

BENCH_VARIANTS = {"a": "bert-ds fused", "b": "bert-ds, PyTorch ops", "c": "transformers (SDPA)",
                  "d": "bert-ds, layers compiled"}
VERDICT = re.compile(r"^\s+(\w+)\s+runs (\w+) \((.*?)\)(.*)$")
PYTEST_CLOSING = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")


def _json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _missing(name: str) -> list[str]:
    return [f"`{name}` is missing: its step did not write it.", ""]


def header(results: Path) -> list[str]:
    env = next((j["environment"] for j in (_json(results / "bench.json"), _json(results / "kernels_bench.json"))
                if j), {})
    commit = env.get("git_commit")
    return [f"# {results.name}: benchmarks/gpu_checks.sh", "",
            f"- device: {env.get('device', '?')}, driver {env.get('driver') or '-'}, "
            f"compute capability {env.get('capability') or '-'}",
            f"- software: Python {platform.python_version()}, torch {_version('torch')} "
            f"(CUDA {env.get('cuda') or '-'}), transformers {_version('transformers')}, "
            f"tokenizers {_version('tokenizers')}, DeepSpeed {_version('deepspeed')}",
            f"- commit: {(commit or '?')[:12]}{' (dirty)' if env.get('git_dirty') else ''}", ""]


def steps_table(results: Path) -> list[str]:
    lines = ["## Steps", "", "| step | status | seconds | budget |", "|---|---|---:|---:|"]
    try:
        rows = [line.split() for line in (results / "steps.txt").read_text().splitlines() if line.strip()]
    except OSError:
        return lines[:2] + _missing("steps.txt")
    for name, rc, seconds, *budget in rows:
        status = "ok" if rc == "0" else "past its budget" if rc in ("124", "137") else f"**failed** (exit {rc})"
        lines.append(f"| {name} | {status} | {seconds} | {budget[0] if budget else ''} |")
    return lines + [""]


def kernels(results: Path) -> list[str]:
    lines = ["## Fused kernels", ""]
    try:
        log = (results / "kernels_build.log").read_text()
    except OSError:
        log = ""
    verdicts = [m.groups() for m in map(VERDICT.match, log.splitlines()) if m]
    if verdicts:
        lines += ["kernels=auto's verdicts (`kernels_build.log`):", "", "| op | runs | times (per call: forward + backward; LAMB one step) |",
                  "|---|---|---|"]
        lines += [f"| {op} | {runs} | {times}{rest.strip(' ;')and '; ' + rest.strip(' ;')} |"
                  for op, runs, times, rest in verdicts]
    else:
        lines.append("No verdicts in `kernels_build.log`: " + (log.strip().splitlines() or ["(empty)"])[-1])
    lines += ["", f"Fused ops against their references (`test_cuda_ops.log`): {test_outcome(results)}"]
    return lines + [""] + kernel_rates(results)


def test_outcome(results: Path) -> str:
    """pytest's closing line ("202 passed in 20.13s"), or how the run ended without one."""
    try:
        log = (results / "test_cuda_ops.log").read_text().splitlines()
    except OSError:
        return "`test_cuda_ops.log` is missing"
    closing = [line.strip("= ") for line in log if PYTEST_CLOSING.search(line)]
    if closing:
        return closing[-1]
    fatal = next((line[line.index("Fatal Python error"):] for line in log if "Fatal Python error" in line), None)
    return f"**crashed**: {fatal}" if fatal else "no pytest summary in the log"


def kernel_rates(results: Path) -> list[str]:
    bench = _json(results / "kernels_bench.json")
    if bench is None:
        return _missing("kernels_bench.json")
    rows = bench["rows"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["model"], r["shape"], r["pass"]), []).append(r)
    probed = bench["device_probes"]
    lines = [f"Each op at its shapes (`kernels_bench.json`; measured copy {probed['copy_gb_per_s']:.3g} GB/s, "
             f"matmul {probed['matmul_tflops']:.3g} TFLOP/s):", "",
             "| op | model | shape | pass | fused ms | fused rate | % of roofline | fastest other |",
             "|---|---|---|---|---:|---:|---:|---|"]
    for (op, model, shape, pass_), group in groups.items():
        fused = next((r for r in group if r["impl"] == "fused"), None)
        others = [r for r in group if r["impl"] != "fused" and r["ms"] is not None]
        best = min(others, key=lambda r: r["ms"], default=None)
        other = f"{best['impl']} {best['ms']:.3f} ms" if best else "-"
        if fused is None or fused["ms"] is None:
            why = fused["note"][:80] if fused else "not run"
            lines.append(f"| {op} | {model} | {shape} | {pass_} | - | refused: {why} | | {other} |")
            continue
        lines.append(f"| {op} | {model} | {shape} | {pass_} | {fused['ms']:.3f} | {fused['rate']:.1f} "
                     f"{fused['unit']} | {100 * fused['fraction_of_peak']:.0f}% | {other} |")
    return lines + [""]


def throughput(results: Path) -> list[str]:
    bench = _json(results / "bench.json")
    if bench is None:
        return ["## Training throughput", ""] + _missing("bench.json")
    lines = ["## Training throughput (`bench.md`: the bench loop, no DeepSpeed engine)", "",
             "| model | seq | variant | ms/step | real tokens/s | MFU (datasheet) | MFU (measured matmul) |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for config in bench["configs"]:
        for key, r in config["results"].items():
            name = BENCH_VARIANTS.get(key, key)
            if "not_run" in r:
                lines.append(f"| {config['preset']} | {config['seq_len']} | ({key}) {name} | not run: "
                             f"{r['not_run'][:80]} | | | |")
                continue
            lines.append(f"| {config['preset']} | {config['seq_len']} | ({key}) {name} | {r['ms_per_step']:.1f} | "
                         f"{r['real_tokens_per_s']:,.0f} | {_percent(r.get('mfu_vs_datasheet_bf16'))} | "
                         f"{_percent(r.get('mfu_vs_matmul'))} |")
    lines += [""] + [f"- {g['goal']}: measured {g['measured']}, {'met' if g['met'] else '**not met**'}"
                     for g in bench.get("goals", [])]
    projection = bench.get("projection") or {}
    if projection.get("variants"):
        anchor = projection["anchor"]
        lines += ["", f"Projected seed run ({anchor['tokens'] / 1e9:.1f}B tokens on {anchor['gpus']}x {anchor['gpu']}, "
                      f"anchor {anchor['seconds'] / 3600:.1f} h), at each variant's measured MFU:", ""]
        lines += [f"- ({key}) {BENCH_VARIANTS.get(key, key)}: {v['seconds'] / 3600:.1f} h, "
                  f"{v['speedup']:.2f}x the anchor" for key, v in projection["variants"].items()]
    return lines + [""]


def profile(results: Path) -> list[str]:
    prof = _json(results / "profile.json")
    if prof is None:
        return ["## One step, profiled", ""] + _missing("profile.json")
    return [f"## One step, profiled (`profile.md`: {prof['preset']}, seq {prof['seq_len']}, batch "
            f"{prof['batch_size']}, variant ({prof['variant']}) {prof['kernels']})", "",
            *_profiled(prof["summary"])]


def _profiled(summary: dict[str, Any]) -> list[str]:
    from bert_ds.train.profiling import summary_lines  # imports torch: only where a profile was written

    return summary_lines(summary, top=10) + [""]


def _memory(summary: dict[str, Any]) -> str:
    gb = summary.get("max_memory_gb")
    return "" if gb is None else f", peak GPU memory {gb:.1f} GiB"


def engine_path(results: Path) -> list[str]:
    summary = _json(results / "train_base_summary.json")
    lines = ["## The engine path a user runs (`train_base.log`)", ""]
    if summary is None:
        return lines + _missing("train_base_summary.json")
    lines.append(f"- {summary['steps']} steps, {summary['tokens']:,} real tokens: {summary['tokens_per_s']:,.0f} "
                 f"real tokens/s, MFU {_percent(summary.get('mfu'))} of the datasheet peak{_memory(summary)}")
    at512 = _json(results / "train_base512_summary.json")
    lines.append(f"- at seq 512 (`train_base512.log`): {at512['tokens_per_s']:,.0f} real "
                 f"tokens/s, MFU {_percent(at512.get('mfu'))}{_memory(at512)}" if at512 else
                 "- at seq 512: `train_base512_summary.json` is missing: its step did not write it")
    try:
        records = [json.loads(line) for line in (results / "train_base_metrics.jsonl").read_text().splitlines()
                   if line.strip()]
    except (OSError, ValueError):
        records = []
    train = [r for r in records if "step_time_s" in r][len(records) // 3:]  # past the first third: warm
    if train:
        step = statistics.median(r["step_time_s"] for r in train)
        wait = statistics.median(r["data_wait_s"] for r in train)
        lines.append(f"- median over steps {train[0]['step']}-{train[-1]['step']}: {1e3 * step:.1f} ms per step, "
                     f"of which {1e3 * wait:.2f} ms waiting for the loader")
    prof = _json(results / "train_base_profile.json")
    if prof is None:
        return lines + [""] + _missing("train_base_profile.json")
    return lines + ["", f"### Steps {prof['steps']} profiled (`train_base_profile.md`, `--profile-steps`)", "",
                    *_profiled(prof["summary"])]


def step_buckets(results: Path) -> list[str]:
    """The shipped config's step through the engine at seq 128 (``train_base``) and 512
    (``train_base512``), its GPU time by bucket: where the non-GEMM time is."""
    lines = ["## The shipped config's step by bucket (`train_base`, `train_base512`)", ""]
    profiles = {f"seq {seq}": _json(results / f"{name}_profile.json")
                for seq, name in ((128, "train_base"), (512, "train_base512"))}
    found = {heading: prof["summary"] for heading, prof in profiles.items() if prof is not None}
    for heading, prof in profiles.items():
        if prof is None:
            lines += _missing(f"{'train_base' if heading == 'seq 128' else 'train_base512'}_profile.json")
    if not found:
        return lines
    if not any(summary.get("buckets") for summary in found.values()):
        return lines + ["No GPU kernels in these profiles (a CPU run, or one recorded before the buckets): "
                        "nothing to split.", ""]
    from bert_ds.train.profiling import bucket_lines  # imports torch: only where a profile was written

    steps = ", ".join(f"{heading}: {summary['wall_ms_per_step']:.1f} ms/step" for heading, summary in found.items())
    return lines + [f"GPU kernel time per step by bucket, and the idle time ({steps}):", "",
                    *bucket_lines(found), ""]


def sweep(results: Path) -> list[str]:
    folder = results / "engine_sweep"
    if not folder.is_dir():
        return _missing("engine_sweep/")
    from bert_ds.tools.engine_sweep import table
    return ["", *table(folder)]


def fusions(results: Path) -> list[str]:
    """The hand-fused kernels against Inductor's fusion of PyTorch's ops (``--compile-layers``),
    in the bench loop ((a) against (d)) and through the engine (``base-mb512`` against
    ``compiled``): which is faster on this device, and by how much."""
    lines = ["## Hand-fused kernels or the layers compiled", ""]
    bench = _json(results / "bench.json") or {}
    for config in bench.get("configs", []):
        a, d = (config["results"].get(key, {}).get("real_tokens_per_s") for key in ("a", "d"))
        lines.append(f"- bench loop, {config['preset']} at seq {config['seq_len']}: {_faster(a, d, '(a) fused', '(d) compiled')}")
    runs = {name: _json(results / "engine_sweep" / name / "summary.json") for name in ("base-mb512", "compiled")}
    fused, compiled = ((run or {}).get("tokens_per_s") for run in runs.values())
    lines.append(f"- engine path, micro-batch 512: {_faster(fused, compiled, 'base-mb512', 'compiled')}")
    return lines + ["", "The faster one is the one to run on this device: the hand-fused path is the default, "
                    "`--compile-layers` the other.", ""]


def _faster(first: float | None, second: float | None, first_name: str, second_name: str) -> str:
    if not first or not second:
        return f"not both measured ({first_name}: {first or '-'}, {second_name}: {second or '-'} real tokens/s)"
    (fast, fast_rate), (slow, slow_rate) = sorted(((first_name, first), (second_name, second)), key=lambda x: -x[1])
    return f"{fast} {fast_rate:,.0f} real tokens/s against {slow} {slow_rate:,.0f}: **{fast}**, {fast_rate / slow_rate:.2f}x"


def write_summary(results: Path) -> str:
    if not results.is_dir():
        raise UserError(f"{results} is not a folder of gpu_checks.sh results")
    lines = []
    for section in (header, steps_table, kernels, throughput, profile, engine_path, step_buckets, sweep, fusions):
        try:
            lines += section(results)
        except (KeyError, TypeError, ValueError, IndexError) as error:  # a file of another shape: say so, go on
            lines += [f"({section.__name__}: could not be summarized: {type(error).__name__}: {error})", ""]
    text = "\n".join(lines).rstrip() + "\n"
    (results / "SUMMARY.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.tools.gpu_summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="the folder gpu_checks.sh wrote")
    args = parser.parse_args(argv)
    return guarded(lambda: print(write_summary(args.results), end=""))


if __name__ == "__main__":
    sys.exit(main())
