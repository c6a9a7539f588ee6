"""bert_ds.train.profiling: --profile-steps' range, and the profiler over a run's steps."""

import json

import pytest
import torch

from bert_ds.base.errors import ConfigError
from bert_ds.train.profiling import OUTSIDE, StepProfiler, StepRange, busy_us, overlap_us, stage, stage_split


@pytest.mark.parametrize("text,expected", [("11-13", (11, 13)), ("7", (7, 7)), (" 2 - 4 ", (2, 4))])
def test_a_step_range_parses(text, expected):
    steps = StepRange.parse(text)
    assert (steps.first, steps.last) == expected and str(steps) == f"{expected[0]}-{expected[1]}"


@pytest.mark.parametrize("text", ["", "a-b", "0-3", "5-2", "1-2-3", "-3"])
def test_a_bad_step_range_is_a_config_error(text):
    with pytest.raises(ConfigError, match="--profile-steps"):
        StepRange.parse(text)


def test_busy_time_is_the_union_of_intervals():
    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert busy_us([]) == 0


def test_each_stage_is_charged_the_gpu_idle_time_inside_it():
    # forward runs twice; the GPU's kernels overlap each other and the stages' edges
    stages = [("forward", 0, 100), ("backward", 100, 300), ("forward", 300, 400)]
    kernels = [(50, 150), (120, 180), (350, 500)]  # union: [50, 180) and [350, 500): 280 us busy
    rows = {r["stage"]: r for r in stage_split(stages, kernels, steps=2, wall_us=600)}
    us_per_step = {name: tuple(round(r[key] * 2e3, 6) for key in
                               ("host_ms_per_step", "gpu_busy_ms_per_step", "gpu_idle_ms_per_step"))
                   for name, r in rows.items()}
    assert us_per_step == {"forward": (200, 100, 100), "backward": (200, 80, 120), OUTSIDE: (200, 100, 100)}
    assert list(rows)[0] == "backward"  # the most GPU idle time first
    # without GPU kernels (a CPU run) there is host time only
    cpu = stage_split(stages, [], steps=1, wall_us=400)
    assert [r["gpu_idle_ms_per_step"] for r in cpu] == [None, None, None]
    assert stage_split([], kernels, steps=1, wall_us=600) == []


@pytest.mark.parametrize("start,stop,expected", [(0, 10, 0), (0, 60, 10), (55, 58, 3), (60, 130, 50),
                                                  (0, 1000, 110), (200, 300, 0)])
def test_overlap_with_a_union_of_intervals(start, stop, expected):
    assert overlap_us(start, stop, [(50, 100), (120, 150), (170, 200)]) == expected


def _work(n: int = 64) -> None:
    with stage("forward"):
        x = torch.randn(n, n)
        (x @ x).relu_().sum()


def _run(profiler: StepProfiler, steps: range) -> list:
    written = []
    for step in steps:
        profiler.before(step)
        _work()
        written.append(profiler.after(step))
    return written


def test_the_range_is_profiled_once_and_written_on_its_last_step(tmp_path):
    profiler = StepProfiler(StepRange(2, 3), tmp_path, torch.device("cpu"), rank=0)
    written = _run(profiler, range(1, 6))
    assert written == [None, None, tmp_path / "profile" / "rank0.md", None, None]
    assert profiler.close() is None
    record = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    assert record["steps"] == "2-3" and record["summary"]["steps"] == 2
    # a stage's range is no caller: the ops inside it are the top-level host ops
    assert any(op["name"] == "aten::matmul" for op in record["summary"]["top_host_ops"])
    assert not any(op["name"].startswith("step.") for op in record["summary"]["top_host_ops"])
    forward = next(r for r in record["summary"]["stages"] if r["stage"] == "forward")
    assert forward["host_ms_per_step"] > 0 and forward["gpu_idle_ms_per_step"] is None
    markdown = written[2].read_text()
    assert "## Training steps 2-3 profiled: rank 0, cpu" in markdown and "| forward | " in markdown
    assert (tmp_path / "profile" / "rank0.trace.json.gz").stat().st_size > 0


def test_a_run_that_ends_inside_the_range_writes_the_steps_it_ran(tmp_path):
    profiler = StepProfiler(StepRange(2, 9), tmp_path, torch.device("cpu"), rank=1)
    assert _run(profiler, range(1, 4)) == [None, None, None]
    assert profiler.close() == tmp_path / "profile" / "rank1.md"
    assert json.loads((tmp_path / "profile" / "rank1.json").read_text())["steps"] == "2-3"


def test_a_resumed_run_past_the_range_or_a_failed_one_writes_nothing(tmp_path):
    late = StepProfiler(StepRange(2, 3), tmp_path, torch.device("cpu"), rank=0)
    assert _run(late, range(4, 6)) == [None, None] and late.close() is None
    failed = StepProfiler(StepRange(1, 3), tmp_path, torch.device("cpu"), rank=0)
    failed.before(1)
    failed.discard()
    assert failed.close() is None
    assert not (tmp_path / "profile").exists()
