"""benchmarks/gpu_checks.sh and its kit, rehearsed on this CPU machine.

A lent GPU comes to one session in twenty, for 30 minutes: everything its run needs must
already work. ``gpu_checks.sh --rehearse`` runs every step here (the same script, steps,
result files and summary, at tiny shapes), and ``gpu_kit.sh`` builds the wheels the GPU
machine lacks; a broken step, flag, writer or budget fails here.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_checks.sh"
KIT_SCRIPT = REPO / "benchmarks" / "gpu_kit.sh"
STEPS = ("kernels_build", "kernels_inspect", "test_cuda_ops", "kernels_bench", "bench", "profile", "main_job",
         "train_base", "train_base512", "engine_sweep", "summary")
RESULT_FILES = ("steps.txt", "SUMMARY.md", "kernels_bench.json", "bench.json", "bench.md", "profile.json",
                "profile.md", "train_base_summary.json", "train_base_metrics.jsonl", "train_base_profile.json",
                "train_base_profile.md", "train_base512_summary.json", "train_base512_profile.json",
                "engine_sweep/engine_sweep.md", "engine_sweep/compiled/rank0.json",
                "engine_sweep/compiled/summary.json",
                *(f"{step}.log" for step in STEPS))


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, **extra}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would run every check")
def test_without_a_gpu_the_script_refuses_in_one_line(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"gpu_checks.sh: no CUDA device is visible to {sys.executable}"]
    assert not out.exists()


def _without_python(**extra: str) -> dict[str, str]:
    return {k: v for k, v in _env(**extra).items() if k != "PYTHON"}


def test_without_python_set_the_projects_environment_is_used(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    proc = subprocess.run(["bash", str(SCRIPT), "--rehearse", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120, env=_without_python(VENV=str(venv), ONLY="none"))
    assert proc.returncode == 0, proc.stderr
    assert f"== python: {venv}/bin/python" in proc.stdout.splitlines()


def test_a_python_without_torch_stops_at_once_saying_what_to_do(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "python3").write_text("#!/bin/sh\necho 'No module named torch' >&2; exit 1\n")
    (shims / "python3").chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), "--rehearse", str(out)], capture_output=True, text=True, timeout=60,
                          env=_without_python(VENV=str(tmp_path / "no-venv"), PATH=f"{shims}:/usr/bin:/bin"))
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [
        f"gpu_checks.sh: torch does not import in python3; run ./run.sh setup (it makes {tmp_path}/no-venv), "
        "or set PYTHON to a Python with torch"]


def test_an_unknown_option_is_refused_in_one_line(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--rehears", str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=_env())
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "gpu_checks.sh: unknown option --rehears (usage: gpu_checks.sh [--rehearse] [OUT_DIR])"]


def test_the_scripts_parse():
    for script in (SCRIPT, KIT_SCRIPT):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


@pytest.fixture
def kit(tmp_path_factory) -> Path:
    """The GPU kit built into a temporary folder (from PyPI, as a user's machine would)."""
    folder = tmp_path_factory.mktemp("kit") / "wheels"
    proc = subprocess.run(["bash", str(KIT_SCRIPT), str(folder)], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=_env())
    if proc.returncode != 0 and ("Could not find" in proc.stderr or "connection" in proc.stderr.lower()):
        pytest.skip(f"PyPI unreachable: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("gpu kit: 7 wheels in ") and "of the 64 MiB a call carries" in proc.stdout
    # DeepSpeed and what the GPU machine lacks of its requirements, each small (checked here, in
    # the one test that builds the kit: a second test would build it again on another worker)
    names = {p.name.split("-")[0].lower() for p in folder.glob("*.whl")}
    assert names == {"deepspeed", "hjson", "pydantic", "pydantic_core", "annotated_types", "typing_inspection",
                     "typing_extensions"}
    assert all(p.stat().st_size < 8 * 2**20 for p in folder.glob("*.whl"))
    print(proc.stdout.strip())
    return folder


@pytest.mark.long
def test_the_rehearsal_runs_every_step_and_writes_every_result(kit, tmp_path):
    out = tmp_path / "rehearsal"
    proc = subprocess.run(["bash", str(SCRIPT), "--rehearse", str(out)], capture_output=True, text=True,
                          timeout=1200, cwd=REPO, env=_env(KIT=str(kit)))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "== kit (rehearsal): " in log and "install for Python 3.12" in log
    steps = {name: (int(rc), int(seconds), int(budget)) for name, rc, seconds, budget in
             (line.split() for line in (out / "steps.txt").read_text().splitlines())}
    assert list(steps) == list(STEPS)
    assert all(rc == 0 and seconds < budget for rc, seconds, budget in steps.values()), steps
    missing = [name for name in RESULT_FILES if not (out / name).is_file() or (out / name).stat().st_size == 0]
    assert not missing, missing
    for name in ("kernels_bench.json", "bench.json", "profile.json", "train_base_summary.json",
                 "train_base_profile.json"):
        json.loads((out / name).read_text())
    summary = (out / "SUMMARY.md").read_text()
    for section in ("## Steps", "## Fused kernels", "## Training throughput", "## One step, profiled",
                    "## The engine path a user runs", "### Steps 1-3 profiled",
                    "## The engine path, variant by variant", "### compiled: a profiled step by stage",
                    "## Hand-fused kernels or the layers compiled", "- engine path, micro-batch 512: ",
                    "## The shipped config's step by bucket", "- at seq 512 (`train_base512.log`): ",
                    "| stage of the step |"):
        assert section in summary
    assert "could not be summarized" not in summary and "is missing" not in summary
    build = (out / "kernels_build.log").read_text()  # compile_check's report on a kernel source
    for arch, std in (("sm_80", "c\\+\\+17"), ("sm_90", "c\\+\\+20")):
        assert re.search(rf"lamb\.cu\s+{arch} {std}\s+ok\s+2 kernels, max \d+ registers", build), (arch, build)
    assert "| train_base | ok |" in summary


def test_the_summary_splits_the_step_by_bucket_at_both_sequence_lengths(tmp_path):
    from bert_ds.tools.gpu_summary import step_buckets
    from bert_ds.train.profiling import buckets

    for name, gemm_us, idle_us in (("train_base", 6000.0, 1000.0), ("train_base512", 9000.0, 500.0)):
        rows = buckets({"nvjet_sm90_tst_NNT": gemm_us, "attention_bwd_kernel": 2000.0}, idle_us, steps=2,
                       wall_us=gemm_us + 2000.0 + idle_us)
        (tmp_path / f"{name}_profile.json").write_text(json.dumps({"summary": {
            "wall_ms_per_step": (gemm_us + 2000.0 + idle_us) / 2e3, "buckets": rows}}))
    lines = step_buckets(tmp_path)
    assert "| bucket | seq 128 ms/step | seq 128 share | seq 512 ms/step | seq 512 share |" in lines
    assert "| GEMM | 3.00 | 66.7% | 4.50 | 78.3% |" in lines and "| idle | 0.50 | 11.1% | 0.25 | 4.3% |" in lines
    (tmp_path / "train_base512_profile.json").unlink()
    assert "`train_base512_profile.json` is missing: its step did not write it." in step_buckets(tmp_path)


def test_the_summary_says_which_fusion_is_faster(tmp_path):
    from bert_ds.tools.gpu_summary import fusions

    (tmp_path / "bench.json").write_text(json.dumps({"configs": [
        {"preset": "base", "seq_len": 128, "results": {"a": {"real_tokens_per_s": 300000.0},
                                                       "d": {"real_tokens_per_s": 360000.0}}},
        {"preset": "base", "seq_len": 512, "results": {"a": {"real_tokens_per_s": 200000.0}}}]}))
    for name, rate in (("base-mb512", 650000.0), ("compiled", 500000.0)):
        (tmp_path / "engine_sweep" / name).mkdir(parents=True)
        (tmp_path / "engine_sweep" / name / "summary.json").write_text(json.dumps({"tokens_per_s": rate}))
    lines = fusions(tmp_path)
    assert ("- bench loop, base at seq 128: (d) compiled 360,000 real tokens/s against (a) fused 300,000: "
            "**(d) compiled**, 1.20x") in lines
    assert "- bench loop, base at seq 512: not both measured ((a) fused: 200000.0, (d) compiled: - real tokens/s)" in lines
    assert ("- engine path, micro-batch 512: base-mb512 650,000 real tokens/s against compiled 500,000: "
            "**base-mb512**, 1.30x") in lines


def test_a_run_split_over_calls_keeps_the_other_steps_lines(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "steps.txt").write_text("kernels_build 0 55 240\nsummary 1 5 60\n")
    proc = subprocess.run(["bash", str(SCRIPT), "--rehearse", str(out)], capture_output=True, text=True,
                          timeout=120, env=_env(ONLY="summary"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split() for line in (out / "steps.txt").read_text().splitlines()]
    assert [line[:2] for line in lines] == [["kernels_build", "0"], ["summary", "0"]]


def test_peak_gpu_memory_reaches_the_summary_and_the_sweep_table(tmp_path):
    from bert_ds.tools.engine_sweep import table
    from bert_ds.train.step import RunState
    from bert_ds.train.summary import Progress

    progress = Progress()
    for gb in (3.5, 7.25, 6.0):  # the largest of the steps' records, not the last
        progress.add_step({"loss": 1.0, "tokens_per_s": 100.0, "mfu": 0.3, "max_memory_gb": gb})
    summary = progress.summary(RunState(step=3, tokens=300), tmp_path / "ckpt", 0.0)
    assert summary["max_memory_gb"] == 7.25
    cpu = Progress()
    cpu.add_step({"loss": 1.0, "tokens_per_s": 100.0})
    assert cpu.summary(RunState(step=1), tmp_path, 0.0)["max_memory_gb"] is None
    (tmp_path / "sweep" / "base-mb512").mkdir(parents=True)
    (tmp_path / "sweep" / "base-mb512" / "summary.json").write_text(json.dumps(summary))
    assert "| base-mb512 | 100 | 30.0% | 7.2 |  |  |  |" in table(tmp_path / "sweep")
