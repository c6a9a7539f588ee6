"""benchmarks/gpu_checks.sh and its kit, rehearsed on this CPU machine.

A lent GPU comes to a session now and then, for 15 minutes in all and 10 a command: the
checks run as two calls of at most 6 minutes each, and everything they need must already
work. ``gpu_checks.sh --rehearse`` runs every step of both calls here (the same script,
steps, result files and summary, at tiny shapes), ``--plan`` says what each call holds and
budgets, and ``gpu_kit.sh`` builds the wheels the GPU machine lacks; a broken step, flag,
writer or budget fails here.
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
DATA_SCRIPT = REPO / "benchmarks" / "base_data.sh"
RECIPES = REPO / "benchmarks" / "recipes"
CALL_1 = ("kernels_build", "test_cuda_ops", "train_data", "train_base", "two_phase", "train_base512")
CALL_2 = ("modernbert_1024", "modernbert_8192", "train_modernbert", "bench", "kernels_bench", "profile")
NEITHER = ("kernels_inspect", "engine_sweep", "main_job")  # a run without --call runs them
CALL_S = 360  # the device tool's 10 minutes a command, two calls in a 15-minute lease with its start
ENGINE_FILES = ("summary.json", "metrics.jsonl", "kernels.json")
RESULT_FILES = ("steps.txt", "SUMMARY.md", "kernels_bench.json", "bench.json", "bench.md", "profile.json",
                "profile.md", *(f"modernbert_{seq}.{ext}" for seq in (1024, 8192) for ext in ("json", "md")),
                *(f"{run}_{name}" for run in ("train_base", "train_base512", "train_modernbert") for name in
                                (*ENGINE_FILES, "profile.json", "profile.md")),
                *(f"two_phase_{phase}_{name}" for phase in ("phase1", "phase2") for name in ENGINE_FILES),
                *(f"{step}.log" for step in (*CALL_1, *CALL_2, "summary")))


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, **extra}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would run every check")
def test_without_a_gpu_the_script_refuses_in_one_line(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(["bash", str(SCRIPT), "--call", "1", str(out)], capture_output=True, text=True,
                          timeout=120, env=_env())
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


@pytest.mark.parametrize("args, said", [
    (["--rehears"], "unknown option --rehears"),
    (["--call", "3"], "--call takes 1 or 2, not '3'"),
    (["--call", "all"], "--call takes 1 or 2, not 'all'"),
])
def test_an_unknown_option_or_call_is_refused_in_one_line(tmp_path, args, said):
    proc = subprocess.run(["bash", str(SCRIPT), *args, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=60, env=_env())
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"gpu_checks.sh: {said} (usage: gpu_checks.sh [--rehearse] [--call 1|2] [--plan] [OUT_DIR])"]
    assert not (tmp_path / "out").exists()


def test_the_scripts_parse():
    for script in (SCRIPT, KIT_SCRIPT, DATA_SCRIPT):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def _plan() -> list[tuple[str, str, int]]:
    proc = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=30,
                          env=_env(PYTHON="/nonexistent/python"))  # the plan needs no Python
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "call step budget_s"
    return [(call, step, int(budget)) for call, step, budget in (line.split() for line in lines[1:])]


def test_the_plan_is_two_calls_of_six_minutes_and_the_header_says_the_same():
    plan = _plan()
    for call, steps in (("1", CALL_1), ("2", CALL_2)):
        rows = [(step, budget) for c, step, budget in plan if c == call and not step.startswith("(")]
        assert [step for step, _ in rows] == [*steps, "summary"]  # what matters most first; the summary last
        startup = next(budget for c, step, budget in plan if c == call and step == "(start-up)")
        total = startup + sum(budget for _, budget in rows)
        assert total <= CALL_S and (call, "(total)", total) in plan, (call, total)
    assert [(c, step) for c, step, _ in plan if c not in ("1", "2")] == [("-", step) for step in NEITHER]
    header = SCRIPT.read_text().split("\nset -u")[0]
    for _, step, budget in plan:  # each step's row in the header's table, with its budget
        if not step.startswith("("):
            assert re.search(rf"^#   {step} .*\b{budget} s\b", header, re.MULTILINE), (step, budget)


def test_the_two_phase_check_recipes_go_from_seq_128_to_512_at_base_and_tiny_shapes():
    from bert_ds.train.phases import PhasePlan

    for name, preset, micro in (("base_two_phase_check.json", "base", (512, 128)),
                                ("tiny_two_phase_check.json", "tiny", (8, 2))):
        plan = PhasePlan.load(RECIPES / name)
        configs = plan.train_configs({"vocab_size": 30522, "pad_token_id": 0})
        assert plan.model["preset"] == preset and [p.name for p in plan.phases] == ["phase1", "phase2"]
        assert [c.data.max_seq_length for c in configs] == [128, 512]
        assert tuple(c.micro_batch_size for c in configs) == micro and all(c.steps <= 4 for c in configs)
        assert plan.first_dataset() == Path("runs/gpu_checks/data30522")  # base_data.sh's, in the default WORK


@pytest.fixture
def kit(tmp_path_factory) -> Path:
    """The GPU kit built into a temporary folder (from PyPI, as a user's machine would)."""
    folder = tmp_path_factory.mktemp("kit") / "wheels"
    proc = subprocess.run(["bash", str(KIT_SCRIPT), str(folder)], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=_env())
    if proc.returncode != 0 and ("Could not find" in proc.stderr or "connection" in proc.stderr.lower()):
        pytest.skip(f"PyPI unreachable: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("gpu kit: 8 wheels in ") and "of the 64 MiB a call carries" in proc.stdout
    # DeepSpeed and what the GPU machine lacks of its requirements, each small (checked here, in
    # the one test that builds the kit: a second test would build it again on another worker)
    names = {p.name.split("-")[0].lower() for p in folder.glob("*.whl")}
    assert names == {"deepspeed", "hjson", "pydantic", "pydantic_core", "annotated_types", "typing_inspection",
                     "typing_extensions", "liger_kernel"}
    assert all(p.stat().st_size < 8 * 2**20 for p in folder.glob("*.whl"))
    print(proc.stdout.strip())
    return folder


def _steps(out: Path) -> dict[str, list[str]]:
    """steps.txt by step: [rc, seconds, budget, call, why...]."""
    return {fields[0]: fields[1:] for fields in
            (line.split(maxsplit=5) for line in (out / "steps.txt").read_text().splitlines())}


def _call(out: Path, call: str, kit: Path) -> str:
    proc = subprocess.run(["bash", str(SCRIPT), "--rehearse", "--call", call, str(out)], capture_output=True,
                          text=True, timeout=900, cwd=REPO, env=_env(KIT=str(kit)))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "== kit (rehearsal): " in log and "install for Python 3.12" in log
    spent, budget = map(int, re.search(r"(\d+)s of the call's (\d+)s\)$", proc.stdout.strip()).groups())
    assert budget == 3 * CALL_S and spent <= budget  # the rehearsal's budgets: the GPU's, tripled
    return log


@pytest.mark.long
def test_the_rehearsal_runs_both_calls_and_writes_every_result(kit, tmp_path):
    out = tmp_path / "rehearsal"
    _call(out, "1", kit)
    after_one = _steps(out)
    assert [name for name, f in after_one.items() if f[0] == "0"] == [*CALL_1, "summary"]
    assert all(after_one[name][:4] == ["-", "-", after_one[name][2], "2"] and after_one[name][4] == "not in this call"
               for name in CALL_2)
    listed = (out / "SUMMARY.md").read_text()
    assert "- train_modernbert (call 2, budget 255 s): not in this call" in listed
    assert "`bench.json` is missing: bench did not run, not in this call." in listed
    _call(out, "2", kit)  # into the same folder: call 1's lines stay, the summary covers both
    steps = _steps(out)
    assert list(steps) == [*CALL_1, *NEITHER, *CALL_2, "summary"]
    ran = {name: f for name, f in steps.items() if name not in NEITHER}
    assert all(f[0] == "0" and int(f[1]) < int(f[2]) for f in ran.values()), steps
    assert {name: f[3] for name, f in ran.items()} == {**dict.fromkeys(CALL_1, "1"), **dict.fromkeys(CALL_2, "2"),
                                                       "summary": "2"}
    assert steps["main_job"] == ["-", "-", "360", "-", "in neither call (a run without --call runs it)"]
    assert steps["kernels_inspect"] == ["-", "-", "75", "-", "in neither call (a run without --call runs it)"]
    assert steps["engine_sweep"] == ["-", "-", "255", "-", "in neither call (a run without --call runs it)"]
    missing = [name for name in RESULT_FILES if not (out / name).is_file() or (out / name).stat().st_size == 0]
    assert not missing, missing
    for run, seq in (("train_base", 64), ("train_base512", 512), ("two_phase_phase1", 128), ("two_phase_phase2", 512),
                     ("train_modernbert", 64)):
        kernels = json.loads((out / f"{run}_kernels.json").read_text())  # each run's and phase's own record
        assert (kernels["backend"], kernels["seq"], kernels["ops"]) == ("torch", seq, {}), run
    summary = (out / "SUMMARY.md").read_text()
    for section in ("## Steps", "| train_base | 1 | ok |", "| train_modernbert | 2 | ok |", "Not run:",
                    "- main_job (budget 360 s): in neither call (a run without --call runs it)",
                    "## Fused kernels", "## kernels=auto's verdicts at seq 128 and 512",
                    "### seq 512: `train_base512_kernels.json`", "No race: kernels=auto runs torch (no CUDA device",
                    "- seq 512, `two_phase_phase2`: the same as `train_base512`",
                    "## Training throughput", "## ModernBERT against transformers",
                    "| 64 | (a) bert-ds, kernels=auto | ", "| 128 | (c) transformers (SDPA) | ",
                    "| 128 | (f) transformers (flash_attention_2) | not run: ",
                    "- seq 64: first-batch losses within ", "## One step, profiled", "## The engine path a user runs",
                    "### Steps 1-3 profiled", "## Host syncs of the engine's step at seq 128 and 512",
                    "No syncs recorded by line", "## The two-phase plan in one process",
                    "- phase2: 2 steps at seq 512, ", "- ModernBERT-base at seq 64 (`train_modernbert.log`): ",
                    "- engine_sweep (budget 255 s): in neither call (a run without --call runs it)",
                    "## Hand-fused kernels or the layers compiled", "- engine path, micro-batch 512: ",
                    "## The shipped config's step by bucket", "- at seq 512 (`train_base512.log`): ",
                    "| stage of the step |"):
        assert section in summary, section
    assert "could not be summarized" not in summary and "is missing" not in summary
    build = (out / "kernels_build.log").read_text()  # compile_check's report on a kernel source
    for arch, std in (("sm_80", "c\\+\\+17"), ("sm_90", "c\\+\\+20")):
        assert re.search(rf"lamb\.cu\s+{arch} {std}\s+ok\s+2 kernels, max \d+ registers", build), (arch, build)


def test_a_call_keeps_the_other_calls_lines_and_starts_no_step_past_its_budget(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    first = "kernels_build 0 55 255 1\ntrain_data 0 12 75 1\ntrain_modernbert - - 255 2 not in this call\nsummary 1 5 45 1\n"
    (out / "steps.txt").write_text(first)
    # 60 s for the call (the rehearsal triples 20), 45 of them held for the summary: no step fits
    proc = subprocess.run(["bash", str(SCRIPT), "--rehearse", "--call", "2", str(out)], capture_output=True,
                          text=True, timeout=120, env=_env(CALL_BUDGET_S="20", WORK=str(tmp_path / "work")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = _steps(out)
    assert steps["kernels_build"] == ["0", "55", "255", "1"] and steps["train_data"] == ["0", "12", "75", "1"]
    for name in CALL_2:
        rc, seconds, budget, call, why = steps[name]
        assert (rc, seconds, call) == ("-", "-", "2") and why.startswith(f"skipped for budget: its {budget}s did "
                                                                         "not fit in the ")
        assert not (out / f"{name}.log").exists()
    assert steps["summary"][0] == "0" and steps["summary"][3] == "2"  # the summary's budget was held back for it
    assert steps["main_job"][4] == "in neither call (a run without --call runs it)"
    assert not (tmp_path / "work" / "data30522").exists()  # the data its steps needed was not built either
    summary = (out / "SUMMARY.md").read_text()
    assert "| kernels_build | 1 | ok | 55 | 255 |" in summary
    assert re.search(r"^- train_modernbert \(call 2, budget 255 s\): skipped for budget: its 255s did not fit in the "
                     r"-?\d+s the call had left$", summary, re.MULTILINE), summary
    assert re.search(r"^`bench.json` is missing: bench did not run, skipped for budget: ", summary, re.MULTILINE)


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
    (tmp_path / "steps.txt").write_text("train_base512 137 240 240 1\n")
    assert "`train_base512_profile.json` is missing: train_base512 past its budget." in step_buckets(tmp_path)


def _race(runs: str, wall: dict[str, float], device: dict[str, float], excluded: dict[str, str]) -> dict:
    others = {name: ms for name, ms in wall.items() if name != runs}
    up = min(others, key=others.__getitem__) if others else None
    return {"runs": runs, "wall_ms": wall, "device_ms": device, "excluded": excluded, "runner_up": up,
            "margin": others[up] / wall[runs] if up else None}


def test_the_summary_shows_each_runs_verdicts_at_seq_128_and_512(tmp_path):
    from bert_ds.tools.gpu_summary import verdicts

    at128 = {"varlen_attention": _race("fused", {"native": 1.2, "fused": 0.9}, {"native": 0.8, "fused": 0.85},
                                       {"sdpa_cudnn": "raised RuntimeError: no kernel"}),
             "lamb_update": _race("fused", {"fused": 0.2}, {"fused": 0.19}, {})}
    at512 = {"varlen_attention": _race("native", {"native": 2.0, "fused": 2.5}, {"native": 1.9, "fused": 1.7}, {})}
    for name, seq, ops in (("train_base", 128, at128), ("train_base512", 512, at512),
                           ("two_phase_phase1", 128, at128), ("two_phase_phase2", 512, at512)):
        (tmp_path / f"{name}_kernels.json").write_text(json.dumps(
            {"setting": "auto", "backend": "plan", "reason": "", "seq": seq, "shapes": {}, "race_version": 3,
             "ops": ops}))
    lines = verdicts(tmp_path)
    assert lines.index("### seq 128: `train_base_kernels.json`") < lines.index("### seq 512: `train_base512_kernels.json`")
    assert ("| varlen_attention | **fused** | 1.33x over native | native 1.200 (0.800), fused 0.900 (0.850) | "
            "sdpa_cudnn: raised RuntimeError: no kernel |") in lines
    assert "| lamb_update | **fused** | only candidate | fused 0.200 (0.190) |  |" in lines
    assert "| varlen_attention | **native** | 1.25x over fused | native 2.000 (1.900), fused 2.500 (1.700) |  |" in lines
    assert "- seq 128, `two_phase_phase1`: the same as `train_base`" in lines
    assert "- seq 512, `two_phase_phase2`: the same as `train_base512`" in lines
    # phase 2's own race picked otherwise: its table, not the line
    (tmp_path / "two_phase_phase2_kernels.json").write_text(json.dumps(
        {"setting": "auto", "backend": "plan", "reason": "", "seq": 512, "shapes": {}, "race_version": 3,
         "ops": {"varlen_attention": _race("fused", {"native": 2.0, "fused": 1.0}, {"native": 1.9, "fused": 1.0}, {})}}))
    assert "### seq 512: `two_phase_phase2_kernels.json`" in verdicts(tmp_path)
    (tmp_path / "train_base512_kernels.json").write_text(json.dumps(
        {"setting": "auto", "backend": "torch", "reason": "no CUDA device to race on", "seq": 512, "shapes": {},
         "race_version": 3, "ops": {}}))
    (tmp_path / "train_base_kernels.json").unlink()  # an older result, or a failed step: named, not an error
    (tmp_path / "steps.txt").write_text("train_base 1 30 50 1\n")
    lines = verdicts(tmp_path)
    assert "No race: kernels=auto runs torch (no CUDA device to race on)." in lines
    assert "`train_base_kernels.json` is missing: train_base **failed** (exit 1)." in lines


def test_the_summary_lists_the_host_syncs_at_both_sequence_lengths(tmp_path):
    from bert_ds.tools.gpu_summary import host_syncs

    syncs = {"train_base": [{"where": "deepspeed/runtime/engine.py:2251 step", "via": "bert_ds/train/step.py:90 run",
                             "per_step": 2.0},
                            {"where": "bert_ds/train/step.py:130 read", "via": "", "per_step": 1.0}],
             "train_base512": [{"where": "bert_ds/train/step.py:130 read", "via": "", "per_step": 1.0}]}
    for name, found in syncs.items():
        (tmp_path / f"{name}_profile.json").write_text(json.dumps({"summary": {
            "blocking_calls_per_step": {"cudaStreamSynchronize": 3.0}, "host_syncs": found}}))
    lines = host_syncs(tmp_path)
    assert "| host sync at | reached from | seq 128 per step | seq 512 per step |" in lines
    assert "| `deepspeed/runtime/engine.py:2251 step` | `bert_ds/train/step.py:90 run` | 2 | 0 |" in lines
    assert "| `bert_ds/train/step.py:130 read` |  | 1 | 1 |" in lines
    assert "- seq 512: host calls that wait for the device, per step (torch.profiler): cudaStreamSynchronize 3" in lines
    for name in syncs:  # a CPU run: the profiler's count, no recorder
        (tmp_path / f"{name}_profile.json").write_text(json.dumps({"summary": {"blocking_calls_per_step": {}}}))
    lines = host_syncs(tmp_path)
    assert "No syncs recorded by line: the recorder (torch.cuda.set_sync_debug_mode) runs on a GPU." in lines
    assert "- seq 128: host calls that wait for the device, per step (torch.profiler): none" in lines


def test_every_rate_says_its_clock_and_an_older_summarys_is_the_devices(tmp_path):
    from bert_ds.tools.engine_sweep import table
    from bert_ds.tools.gpu_summary import engine_path

    older = {"steps": 20, "tokens": 1000, "tokens_per_s": 650000.0, "mfu": 0.35}
    both = {"steps": 20, "tokens": 1000, "tokens_per_s": 600000.0, "mfu": 0.33, "tokens_per_s_device": 640000.0,
            "mfu_device": 0.352}
    for name, summary in (("older", older), ("both", both)):
        (tmp_path / "sweep" / name).mkdir(parents=True)
        (tmp_path / "sweep" / name / "summary.json").write_text(json.dumps(summary))
    lines = table(tmp_path / "sweep")
    assert lines[4].startswith("| variant | real tokens/s, wall | real tokens/s, device | MFU, wall | MFU, device |")
    assert "| both | 600,000 | 640,000 | 33.0% | 35.2% |  |  |  |  |" in lines
    assert "| older | - | 650,000 | - | 35.0% |  |  |  |  |" in lines
    steps = [{"step": i, "wall_time_s": 0.21, "step_time_s": 0.2} for i in range(1, 10)]
    (tmp_path / "sweep" / "both" / "metrics.jsonl").write_text("\n".join(map(json.dumps, steps)))
    (tmp_path / "sweep" / "older" / "metrics.jsonl").write_text(  # a record of before the wall time
        "\n".join(json.dumps({"step": r["step"], "step_time_s": r["step_time_s"]}) for r in steps))
    lines = table(tmp_path / "sweep")
    assert "| both | 600,000 | 640,000 | 33.0% | 35.2% |  | 210.0 / 200.0 |  |  |" in lines
    assert "| older | - | 650,000 | - | 35.0% |  | - / 200.0 |  |  |" in lines
    (tmp_path / "train_base_summary.json").write_text(json.dumps(both))
    (tmp_path / "train_base512_summary.json").write_text(json.dumps(older))
    lines = engine_path(tmp_path)
    assert ("- 20 steps, 1,000 real tokens: 600,000 real tokens/s (wall), MFU 33.0%; 640,000 real tokens/s "
            "(device), MFU 35.2% (MFU against the datasheet peak)") in lines
    assert "- at seq 512 (`train_base512.log`): 650,000 real tokens/s (device), MFU 35.0%" in lines


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
    assert ("- bench loop, base at seq 128: (d) compiled 360,000 real tokens/s (wall) against (a) fused 300,000: "
            "**(d) compiled**, 1.20x") in lines
    assert ("- bench loop, base at seq 512: not both measured ((a) fused: 200,000, (d) compiled: - real tokens/s, "
            "wall)") in lines
    assert ("- engine path, micro-batch 512: base-mb512 650,000 real tokens/s (device) against compiled 500,000: "
            "**base-mb512**, 1.30x") in lines
    # the sweep without base-mb512 (the shipped config is call 1's train_base), both with wall times
    (tmp_path / "engine_sweep" / "base-mb512" / "summary.json").unlink()
    (tmp_path / "engine_sweep" / "base-mb512").rmdir()
    (tmp_path / "train_base_summary.json").write_text(json.dumps(
        {"tokens_per_s": 600000.0, "tokens_per_s_device": 640000.0}))
    (tmp_path / "engine_sweep" / "compiled" / "summary.json").write_text(json.dumps(
        {"tokens_per_s": 660000.0, "tokens_per_s_device": 630000.0}))
    assert ("- engine path, micro-batch 512: compiled 660,000 real tokens/s (wall) against train_base 600,000: "
            "**compiled**, 1.10x") in fusions(tmp_path)


def test_peak_gpu_memory_reaches_the_summary_and_the_sweep_table(tmp_path):
    from bert_ds.tools.engine_sweep import table
    from bert_ds.train.step import RunState
    from bert_ds.train.summary import Progress

    progress = Progress()
    for gb in (3.5, 7.25, 6.0):  # the largest of the steps' records, not the last
        progress.add_step({"loss": 1.0, "wall_time_s": 1.0, "step_time_s": 0.9, "max_memory_gb": gb}, 100.0, 0.3)
    summary = progress.summary(RunState(step=3, tokens=300), tmp_path / "ckpt", 0.0)
    assert summary["max_memory_gb"] == 7.25
    cpu = Progress()
    cpu.add_step({"loss": 1.0, "wall_time_s": 1.0, "step_time_s": 1.0}, 100.0, None)
    assert cpu.summary(RunState(step=1), tmp_path, 0.0)["max_memory_gb"] is None
    (tmp_path / "sweep" / "base-mb512").mkdir(parents=True)
    (tmp_path / "sweep" / "base-mb512" / "summary.json").write_text(json.dumps(summary))
    lines = table(tmp_path / "sweep")
    heads = [cell.strip() for cell in lines[4].strip("|").split("|")]
    row = next([cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| base-mb512 "))
    assert row[heads.index("peak memory GiB")] == "7.2"


def test_the_summary_shows_modernbert_against_both_transformers_and_what_did_not_run(tmp_path):
    from bert_ds.tools.gpu_summary import modernbert

    ran = {"ms_per_step": 80.0, "real_tokens_per_s": 400000.0, "speedup_vs_transformers": 1.9,
           "speedup_vs_flash_attention_2": None, "mfu_vs_datasheet_bf16": 0.333, "mfu_vs_matmul": 0.42,
           "peak_memory_gib": 30.5, "first_batch_loss": 10.9}
    config = {"seq_len": 1024, "results": {"a": ran, "f": {"not_run": "the flash-attn package is not installed"}},
              "loss_check": {"fp32": 10.9001, "run_precision": 10.9012, "precision": "bf16", "tolerance": 0.045}}
    goal = {"goal": "(a) >= 1.5x the real tokens/s of (f) transformers flash_attention_2 at seq 1024",
            "measured": "not measured: (f) not run: the flash-attn package is not installed", "met": None}
    (tmp_path / "modernbert_1024.json").write_text(json.dumps({"configs": [config], "goals": [goal]}))
    (tmp_path / "steps.txt").write_text("modernbert_8192 124 225 225 2\n")
    lines = modernbert(tmp_path)
    assert "| 1024 | (a) bert-ds, kernels=auto | 80.0 | 400,000 | 1.90x | - | 33.3% | 42.0% | 30.5 GiB | 10.9000 |" in lines
    assert ("| 1024 | (f) transformers (flash_attention_2) | not run: the flash-attn package is not installed "
            "| | | | | | | |") in lines
    assert "- seq 1024: first-batch losses within 0.045 of the reference's 10.9001 (fp32; 10.9012 in bf16)" in lines
    assert f"- {goal['goal']}: measured {goal['measured']}, **not measured**" in lines
    assert "`modernbert_8192.json` is missing: modernbert_8192 past its budget." in lines
