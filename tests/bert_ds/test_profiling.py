"""bert_ds.train.profiling: --profile-steps' range, and the profiler over a run's steps."""

import json

import pytest
import torch

from bert_ds.base.errors import ConfigError
from bert_ds.train.profiling import StepProfiler, StepRange, busy_us


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


def _work(n: int = 64) -> None:
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
    assert any(op["name"] == "aten::matmul" for op in record["summary"]["top_host_ops"])
    assert "## Training steps 2-3 profiled: rank 0, cpu" in written[2].read_text()
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
