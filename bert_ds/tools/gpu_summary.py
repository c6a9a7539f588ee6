"""One page for a run of ``benchmarks/gpu_checks.sh``: SUMMARY.md in its results folder.

    python -m bert_ds.tools.gpu_summary RESULTS_DIR

Reads what the steps wrote (``steps.txt``, the logs, ``kernels_bench.json``, ``bench.json``,
``modernbert_1024.json``, ``modernbert_8192.json``, ``profile.json``, and of each engine run,
``train_base``, ``train_base512`` and each phase of ``two_phase``, its ``<run>_summary.json``,
``<run>_metrics.jsonl``, ``<run>_kernels.json`` and ``<run>_profile.json``) and writes
``RESULTS_DIR/SUMMARY.md``, also printed:

- the device, driver and versions (torch, CUDA, Python, transformers, tokenizers,
  DeepSpeed: read in this process, which runs on the same Python as the steps), the commit;
- each step's call, status, seconds and budget, and each step that did not run, with why
  (not in that call, skipped for the call's budget, a module missing);
- ``kernels=auto``'s verdicts from the build's race, and the fused ops' tests;
- the verdicts each engine run and phase ran with, at seq 128 and 512 (``<run>_kernels.json``):
  per op the winner, every candidate's wall and device time, the margin; or why no race ran;
- each fused op at BERT-Base shapes: time, rate, share of the measured copy bandwidth or
  matmul peak, and the fastest other implementation;
- BERT-Base at seq 128 and 512: real tokens/s and MFU of bert-ds fused, bert-ds on
  PyTorch's ops and transformers, the goals, and the projected seed run;
- ModernBERT-base at seq 1,024 and 8,192 (``modernbert_1024.json``, ``modernbert_8192.json``):
  bert-ds (``kernels=auto``, PyTorch's ops) against transformers with SDPA and with
  FlashAttention-2 (or why that did not run), the first-batch loss check, the goal;
- one profiled step: wall, GPU-busy and idle time, launches, host syncs, top kernels;
- the engine path a user runs (``train_base``; ModernBERT-base's, ``train_modernbert``): real
  tokens/s, MFU, step time, data wait, and three of its steps profiled the same way
  (``--profile-steps``), engine included;
- the host syncs of the engine's step at seq 128 and 512, by the line that made each;
- the shipped config's step through the engine at seq 128 and 512 (``train_base``,
  ``train_base512``) by bucket: GEMM, attention, normalization, elementwise, reductions,
  copies, idle;
- the two-phase plan run in one process (``two_phase``): each phase's figures;
- the engine path's variants side by side (``engine_sweep/``, :mod:`bert_ds.tools.engine_sweep`),
  the shipped config (``train_base``) first, each step split by stage;
- the hand-fused kernels against the layers compiled (``--compile-layers``), in the bench loop
  and through the engine: which is faster on the device.

Every real tokens/s and MFU says its clock: the host's wall time (the bench loop's, and a
run's ``tokens_per_s``) or the device's (``tokens_per_s_device``, and an older summary's
``tokens_per_s``), both where a run has both (:func:`bert_ds.tools.engine_sweep.rates`).

A file that a step did not write is named as missing, with the step's status where
``steps.txt`` has it (not run and why, failed): nothing here fails because a step did, so
the page is written on every run.
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
from bert_ds.tools.engine_sweep import rate_text, rates, read_run

BENCH_VARIANTS = {"a": "bert-ds fused", "b": "bert-ds, PyTorch ops", "c": "transformers (SDPA)",
                  "d": "bert-ds, layers compiled"}
MODERNBERT_VARIANTS = {"a": "bert-ds, kernels=auto", "b": "bert-ds, PyTorch ops", "c": "transformers (SDPA)",
                       "f": "transformers (flash_attention_2)", "d": "bert-ds, layers compiled"}
MODERNBERT_STEPS = ("modernbert_1024", "modernbert_8192")  # the bench of ModernBERT-base, one step a length
VERDICT = re.compile(r"^\s+(\w+)\s+runs (\w+) \((.*)$")  # the build's line per op: "  op  runs X (...)..."
PYTEST_CLOSING = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")
ENGINE_RUNS = {"train_base": 128, "train_base512": 512}  # the shipped config through the engine, by seq


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


def read_steps(results: Path) -> list[dict[str, str]] | None:
    """steps.txt's lines: ``name rc seconds budget call [why]``, ``rc`` and ``seconds`` "-" for a
    step that did not run (``why`` says why); older files have three or four fields."""
    try:
        text = (results / "steps.txt").read_text()
    except OSError:
        return None
    rows = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) >= 3:
            name, rc, seconds, budget, call, why = fields + [""] * (6 - len(fields))
            rows.append({"name": name, "rc": rc, "seconds": seconds, "budget": budget, "call": call, "why": why})
    return rows


def _missing(name: str, results: Path | None = None, step: str | None = None) -> list[str]:
    """``name`` is missing, and why, where steps.txt says what became of the ``step`` that writes it."""
    found = next((r for r in read_steps(results) or [] if r["name"] == step), None) if results and step else None
    if found is not None and found["rc"] == "-":
        why = f"{step} did not run, {found['why']}"
    elif found is not None and found["rc"] != "0":
        why = f"{step} {_status(found['rc'])}"
    else:
        why = "its step did not write it"
    return [f"`{name}` is missing: {why}.", ""]


def _status(rc: str) -> str:
    return "ok" if rc == "0" else "past its budget" if rc in ("124", "137") else f"**failed** (exit {rc})"


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
    rows = read_steps(results)
    if rows is None:
        return ["## Steps", ""] + _missing("steps.txt")
    lines = ["## Steps", "", "| step | call | status | seconds | budget |", "|---|---|---|---:|---:|"]
    lines += [f"| {r['name']} | {r['call']} | {_status(r['rc'])} | {r['seconds']} | {r['budget']} |"
              for r in rows if r["rc"] != "-"]
    not_run = [r for r in rows if r["rc"] == "-"]
    if not_run:
        lines += ["", "Not run:", ""]
        lines += [f"- {r['name']} ({'' if r['call'] == '-' else 'call ' + r['call'] + ', '}budget {r['budget']} s): "
                  f"{r['why']}" for r in not_run]
    return lines + [""]


def kernels(results: Path) -> list[str]:
    lines = ["## Fused kernels", ""]
    try:
        log = (results / "kernels_build.log").read_text()
    except OSError:
        log = ""
    verdicts = [m.groups() for m in map(VERDICT.match, log.splitlines()) if m]
    if verdicts:
        lines += ["kernels=auto's verdicts at seq 128 (`kernels_build.log`):", "",
                  "| op | runs | the race (per call: forward + backward; LAMB one step) |", "|---|---|---|"]
        lines += [f"| {op} | {runs} | {_unbracket(rest)} |" for op, runs, rest in verdicts]
    else:
        lines.append("No verdicts in `kernels_build.log`: " + (log.strip().splitlines() or ["(empty)"])[-1])
    lines += ["", f"Fused ops against their references (`test_cuda_ops.log`): {test_outcome(results)}"]
    return lines + [""] + kernel_rates(results)


def _unbracket(text: str) -> str:
    """``a (b) c); d`` -> ``a (b) c; d``: the text after "runs X (" without the bracket that closes it."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            return (text[:i] + text[i + 1:]).strip()
    return text.strip()


def test_outcome(results: Path) -> str:
    """pytest's closing line ("202 passed in 20.13s"), or how the run ended without one."""
    try:
        log = (results / "test_cuda_ops.log").read_text().splitlines()
    except OSError:
        return _missing("test_cuda_ops.log", results, "test_cuda_ops")[0].rstrip(".")
    closing = [line.strip("= ") for line in log if PYTEST_CLOSING.search(line)]
    if closing:
        return closing[-1]
    fatal = next((line[line.index("Fatal Python error"):] for line in log if "Fatal Python error" in line), None)
    return f"**crashed**: {fatal}" if fatal else "no pytest summary in the log"


def kernel_rates(results: Path) -> list[str]:
    bench = _json(results / "kernels_bench.json")
    if bench is None:
        return _missing("kernels_bench.json", results, "kernels_bench")
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


def _kernel_records(results: Path) -> dict[str, dict[str, Any]]:
    """Each engine run's and phase's ``<run>_kernels.json``, by run: train_base, train_base512,
    then the phases of two_phase."""
    names = [*ENGINE_RUNS, *sorted(p.name.removesuffix("_kernels.json")
                                   for p in results.glob("two_phase_*_kernels.json"))]
    return {name: record for name in names if (record := _json(results / f"{name}_kernels.json")) is not None}


def verdicts(results: Path) -> list[str]:
    """What each engine run and phase ran at seq 128 and 512: per op the race's winner, every
    candidate's wall and device time and the margin; or why no race ran. A run whose winners
    are those of an earlier one at its sequence length says so in one line."""
    lines = ["## kernels=auto's verdicts at seq 128 and 512, as each run ran (`<run>_kernels.json`)", ""]
    records = _kernel_records(results)
    for name in ENGINE_RUNS:
        if name not in records:
            lines += _missing(f"{name}_kernels.json", results, name)
    if not any(name.startswith("two_phase_") for name in records):
        lines += _missing("two_phase_<phase>_kernels.json", results, "two_phase")
    shown: dict[int, tuple[str, dict[str, Any]]] = {}
    for name, record in sorted(records.items(), key=lambda item: item[1]["seq"]):
        seq = record["seq"]
        first = shown.get(seq)
        if first is not None and _winners(first[1]) == _winners(record):
            lines += [f"- seq {seq}, `{name}`: the same as `{first[0]}`", ""]
            continue
        shown.setdefault(seq, (name, record))
        lines += [f"### seq {seq}: `{name}_kernels.json`", "", *verdict_table(record), ""]
    return lines


def _winners(record: dict[str, Any]) -> tuple:
    return record["backend"], record["reason"], tuple(sorted((op, c["runs"]) for op, c in record["ops"].items()))


def verdict_table(record: dict[str, Any]) -> list[str]:
    """One run's kernels.json as a table, or the line saying what ran without a race."""
    if not record.get("ops"):
        return [f"No race: kernels={record['setting']} runs {record['backend']} ({record['reason'] or 'no reason given'})."]
    lines = ["| op | runs | margin (wall) | per call, wall ms (device ms) | not a candidate |",
             "|---|---|---|---|---|"]
    for op, c in record["ops"].items():
        margin = "only candidate" if c.get("runner_up") is None else f"{c['margin']:.2f}x over {c['runner_up']}"
        timed = ", ".join(f"{name} {ms:.3f} ({c['device_ms'].get(name, float('nan')):.3f})"
                          for name, ms in c["wall_ms"].items())
        left_out = "; ".join(f"{name}: {why[:70]}" for name, why in c.get("excluded", {}).items())
        lines.append(f"| {op} | **{c['runs']}** | {margin} | {timed} | {left_out} |")
    return lines


def throughput(results: Path) -> list[str]:
    bench = _json(results / "bench.json")
    if bench is None:
        return ["## Training throughput", ""] + _missing("bench.json", results, "bench")
    lines = ["## Training throughput (`bench.md`: the bench loop, no DeepSpeed engine; the host's wall time)", "",
             "| model | seq | variant | ms/step, wall | real tokens/s, wall | MFU (datasheet), wall | "
             "MFU (measured matmul), wall |", "|---|---:|---|---:|---:|---:|---:|"]
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
    lines += [""] + _goal_lines(bench.get("goals", []))
    projection = bench.get("projection") or {}
    if projection.get("variants"):
        anchor = projection["anchor"]
        lines += ["", f"Projected seed run ({anchor['tokens'] / 1e9:.1f}B tokens on {anchor['gpus']}x {anchor['gpu']}, "
                      f"anchor {anchor['seconds'] / 3600:.1f} h), at each variant's measured MFU:", ""]
        lines += [f"- ({key}) {BENCH_VARIANTS.get(key, key)}: {v['seconds'] / 3600:.1f} h, "
                  f"{v['speedup']:.2f}x the anchor" for key, v in projection["variants"].items()]
    return lines + [""]


def _goal_lines(goals: list[dict[str, Any]]) -> list[str]:
    verdict = {True: "met", False: "**not met**", None: "**not measured**"}
    return [f"- {g['goal']}: measured {g['measured']}, {verdict[g['met']]}" for g in goals]


def modernbert(results: Path) -> list[str]:
    """ModernBERT-base against transformers at seq 1,024 and 8,192 (one step and file each)."""
    lines = ["## ModernBERT against transformers (`modernbert_*.md`: the bench loop; the host's wall time)", "",
             "| seq | variant | ms/step | real tokens/s | vs (c) | vs (f) | MFU (datasheet) | MFU (measured matmul) "
             "| peak memory | first-batch loss |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes, goals = [], []
    for step in MODERNBERT_STEPS:
        bench = _json(results / f"{step}.json")
        if bench is None:
            notes += _missing(f"{step}.json", results, step)
            continue
        for config in bench["configs"]:
            lines += [_modernbert_row(config["seq_len"], key, r) for key, r in config["results"].items()]
            check = config["loss_check"]
            notes.append(f"- seq {config['seq_len']}: first-batch losses within {check['tolerance']:.3g} of the "
                         f"reference's {check['fp32']:.4f} (fp32; {check['run_precision']:.4f} in "
                         f"{check['precision']})")
        goals += bench.get("goals", [])
    return lines + [""] + notes + [""] + _goal_lines(goals) + [""]


def _modernbert_row(seq: int, key: str, r: dict[str, Any]) -> str:
    name = f"({key}) {MODERNBERT_VARIANTS.get(key, key)}"
    if "not_run" in r:
        return f"| {seq} | {name} | not run: {r['not_run'][:100]} | | | | | | | |"
    speedups = [f"{x:.2f}x" if x is not None else "-" for x in (r.get("speedup_vs_transformers"),
                                                                 r.get("speedup_vs_flash_attention_2"))]
    memory = "-" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.1f} GiB"
    return (f"| {seq} | {name} | {r['ms_per_step']:.1f} | {r['real_tokens_per_s']:,.0f} | {' | '.join(speedups)} | "
            f"{_percent(r.get('mfu_vs_datasheet_bf16'))} | {_percent(r.get('mfu_vs_matmul'))} | {memory} | "
            f"{r['first_batch_loss']:.4f} |")


def profile(results: Path) -> list[str]:
    prof = _json(results / "profile.json")
    if prof is None:
        return ["## One step, profiled", ""] + _missing("profile.json", results, "profile")
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
        return lines + _missing("train_base_summary.json", results, "train_base")
    peak = " (MFU against the datasheet peak)" if summary.get("mfu") is not None else ""
    lines.append(f"- {summary['steps']} steps, {summary['tokens']:,} real tokens: {rate_text(summary)}{peak}"
                 f"{_memory(summary)}")
    at512 = _json(results / "train_base512_summary.json")
    lines.append(f"- at seq 512 (`train_base512.log`): {rate_text(at512)}{_memory(at512)}" if at512 else
                 "- at seq 512: " + _missing("train_base512_summary.json", results, "train_base512")[0])
    modern = _json(results / "train_modernbert_summary.json")
    seq = (_json(results / "train_modernbert_kernels.json") or {}).get("seq", 1024)
    lines.append(f"- ModernBERT-base at seq {seq:,} (`train_modernbert.log`): {rate_text(modern)}{_memory(modern)}"
                 if modern else
                 "- ModernBERT-base: " + _missing("train_modernbert_summary.json", results, "train_modernbert")[0])
    try:
        records = [json.loads(line) for line in (results / "train_base_metrics.jsonl").read_text().splitlines()
                   if line.strip()]
    except (OSError, ValueError):
        records = []
    train = [r for r in records if "step_time_s" in r][len(records) // 3:]  # past the first third: warm
    if train:
        wall = [r["wall_time_s"] for r in train if "wall_time_s" in r]  # not in older records
        step = statistics.median(r["step_time_s"] for r in train)
        wait = statistics.median(r["data_wait_s"] for r in train)
        lines.append(f"- median over steps {train[0]['step']}-{train[-1]['step']}: "
                     f"{f'{1e3 * statistics.median(wall):.1f} ms per step by wall time, ' if wall else ''}"
                     f"{1e3 * step:.1f} ms on the device, {1e3 * wait:.2f} ms of the host's waiting for the loader")
    prof = _json(results / "train_base_profile.json")
    if prof is None:
        return lines + [""] + _missing("train_base_profile.json", results, "train_base")
    return lines + ["", f"### Steps {prof['steps']} profiled (`train_base_profile.md`, `--profile-steps`)", "",
                    *_profiled(prof["summary"])]


def _engine_profiles(results: Path, lines: list[str]) -> dict[str, dict[str, Any]]:
    """train_base's and train_base512's profiled steps by heading ("seq 128"), each missing one
    named in ``lines``."""
    found = {}
    for name, seq in ENGINE_RUNS.items():
        prof = _json(results / f"{name}_profile.json")
        if prof is None:
            lines += _missing(f"{name}_profile.json", results, name)
        else:  # the run's own length where it recorded it (a rehearsal's is shorter)
            found[f"seq {(_json(results / f'{name}_kernels.json') or {}).get('seq', seq)}"] = prof["summary"]
    return found


def host_syncs(results: Path) -> list[str]:
    """The host syncs of the shipped config's profiled steps at seq 128 and 512, side by side:
    each by the line that made it (the recorder runs on a GPU), and the profiler's count of
    the host calls that wait for the device."""
    lines = ["## Host syncs of the engine's step at seq 128 and 512 (`train_base`, `train_base512`)", ""]
    found = _engine_profiles(results, lines)
    if not found:
        return lines
    for heading, summary in found.items():
        waits = ", ".join(f"{k} {v:g}" for k, v in summary.get("blocking_calls_per_step", {}).items()) or "none"
        lines.append(f"- {heading}: host calls that wait for the device, per step (torch.profiler): {waits}")
    lines.append("")
    recorded = {heading: summary["host_syncs"] for heading, summary in found.items() if "host_syncs" in summary}
    if not recorded:
        return lines + ["No syncs recorded by line: the recorder (torch.cuda.set_sync_debug_mode) runs on a GPU.", ""]
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for heading, syncs in recorded.items():
        for r in syncs:
            rows.setdefault((r["where"], r["via"]), {})[heading] = r["per_step"]
    heads = list(recorded)
    lines += ["| host sync at | reached from | " + " | ".join(f"{h} per step" for h in heads) + " |",
              "|---|---|" + "---:|" * len(heads)]
    lines += [f"| `{where}` | {f'`{via}`' if via else ''} | " + " | ".join(f"{cells.get(h, 0):g}" for h in heads) + " |"
              for (where, via), cells in rows.items()]
    if not rows:
        lines.append("| (none) | | " + " | ".join("0" for _ in heads) + " |")
    return lines + [""]


def step_buckets(results: Path) -> list[str]:
    """The shipped config's step through the engine at seq 128 (``train_base``) and 512
    (``train_base512``), its GPU time by bucket: where the non-GEMM time is."""
    lines = ["## The shipped config's step by bucket (`train_base`, `train_base512`)", ""]
    found = _engine_profiles(results, lines)
    if not found:
        return lines
    if not any(summary.get("buckets") for summary in found.values()):
        return lines + ["No GPU kernels in these profiles (a CPU run, or one recorded before the buckets): "
                        "nothing to split.", ""]
    from bert_ds.train.profiling import bucket_lines  # imports torch: only where a profile was written

    steps = ", ".join(f"{heading}: {summary['wall_ms_per_step']:.1f} ms/step" for heading, summary in found.items())
    return lines + [f"GPU kernel time per step by bucket, and the idle time ({steps}):", "",
                    *bucket_lines(found), ""]


def two_phase(results: Path) -> list[str]:
    """Each phase of the two-phase plan run in one process: its steps, sequence length and rates."""
    lines = ["## The two-phase plan in one process (`two_phase.log`)", ""]
    phases = sorted(p.name.removeprefix("two_phase_").removesuffix("_summary.json")
                    for p in results.glob("two_phase_*_summary.json"))
    if not phases:
        return lines + _missing("two_phase_<phase>_summary.json", results, "two_phase")
    for phase in phases:
        summary = _json(results / f"two_phase_{phase}_summary.json") or {}
        seq = (_json(results / f"two_phase_{phase}_kernels.json") or {}).get("seq", "?")
        lines.append(f"- {phase}: {summary.get('steps', '?')} steps at seq {seq}, {rate_text(summary)}; loss "
                     f"{summary.get('loss_first', float('nan')):.3f} -> {summary.get('loss_last', float('nan')):.3f}")
    return lines + ["", "Each phase's verdicts are among those above (`two_phase_<phase>_kernels.json`).", ""]


def sweep(results: Path) -> list[str]:
    folder = results / "engine_sweep"
    if not folder.is_dir():  # in neither call by design: the steps table lists it, and that is all
        step = next((r for r in read_steps(results) or [] if r["name"] == "engine_sweep"), None)
        return [] if step is not None and step["call"] == "-" else _missing("engine_sweep/", results, "engine_sweep")
    from bert_ds.tools.engine_sweep import table

    reference = None
    if not (folder / "base-mb512").is_dir() and (results / "train_base_summary.json").is_file():
        reference = ("train_base (call 1)", read_run(*(results / f"train_base_{name}" for name in
                                                                ("summary.json", "metrics.jsonl", "profile.json"))))
    return [*table(folder, reference), ""]


def fusions(results: Path) -> list[str]:
    """The hand-fused kernels against Inductor's fusion of PyTorch's ops (``--compile-layers``),
    in the bench loop ((a) against (d)) and through the engine (the shipped config, ``base-mb512``
    or ``train_base``, against ``compiled``): which is faster on this device, and by how much."""
    lines = ["## Hand-fused kernels or the layers compiled", ""]
    bench = _json(results / "bench.json") or {}
    for config in bench.get("configs", []):
        a, d = (config["results"].get(key, {}).get("real_tokens_per_s") for key in ("a", "d"))
        lines.append(f"- bench loop, {config['preset']} at seq {config['seq_len']}: "
                     f"{_faster(a, d, '(a) fused', '(d) compiled', 'wall')}")
    fused_name = "base-mb512"
    fused = _json(results / "engine_sweep" / "base-mb512" / "summary.json")
    if fused is None:
        fused_name, fused = "train_base", _json(results / "train_base_summary.json")
    compiled = _json(results / "engine_sweep" / "compiled" / "summary.json")
    clock = "wall" if fused and compiled and all(rates(s)["wall"][0] is not None for s in (fused, compiled)) \
        else "device"
    first, second = ((rates(s)[clock][0] if s else None) for s in (fused, compiled))
    lines.append(f"- engine path, micro-batch 512: {_faster(first, second, fused_name, 'compiled', clock)}")
    return lines + ["", "The faster one is the one to run on this device: the hand-fused path is the default, "
                    "`--compile-layers` the other.", ""]


def _faster(first: float | None, second: float | None, first_name: str, second_name: str, clock: str) -> str:
    if not first or not second:
        return (f"not both measured ({first_name}: {f'{first:,.0f}' if first else '-'}, {second_name}: "
                f"{f'{second:,.0f}' if second else '-'} real tokens/s, {clock})")
    (fast, fast_rate), (slow, slow_rate) = sorted(((first_name, first), (second_name, second)), key=lambda x: -x[1])
    return (f"{fast} {fast_rate:,.0f} real tokens/s ({clock}) against {slow} {slow_rate:,.0f}: **{fast}**, "
            f"{fast_rate / slow_rate:.2f}x")


SECTIONS = (header, steps_table, kernels, verdicts, throughput, modernbert, profile, engine_path, host_syncs, step_buckets,
            two_phase, sweep, fusions)


def write_summary(results: Path) -> str:
    if not results.is_dir():
        raise UserError(f"{results} is not a folder of gpu_checks.sh results")
    lines = []
    for section in SECTIONS:
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
