"""A training step's accounting, in process: skipped steps, the bad streak that stops a run
(exit 3), the stop vote, the checkpoint schedule, and the test hooks' seam. No engine, no
process group: the decisions are made from the step's all-reduced statistics alone.
(The same decisions on a real engine, as processes: test_reliability.py's R7 tests.)"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from bert_ds.base.errors import (EXIT_BAD_STEPS, EXIT_OK, EXIT_RANK_FAILURE, EXIT_USER_ERROR, BadStepsError,
                                 ConfigError, RankFailure, guarded)
from bert_ds.train.checkpointer import Checkpointer
from bert_ds.train.faults import NO_FAULTS, Faults
from bert_ds.train.step import STATS, RunState, account, check_bad_streak

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)


def sums(*, tokens=640.0, loss=8.0, nonfinite_loss=0.0, nonfinite_grad=0.0, stop=0.0) -> dict[str, float]:
    """A step's all-reduced statistics: two micro-batches of 320 real tokens."""
    s = dict.fromkeys(STATS, 0.0)
    s.update(loss_sum=2 * loss, micro_batches=2.0, tokens=tokens, mlm_count=90.0, mlm_correct=9.0,
             nonfinite_loss=nonfinite_loss, nonfinite_grad=nonfinite_grad, stop=stop)
    return s


NAN = dict(loss=math.nan, nonfinite_loss=1.0)


def test_a_good_step_counts_its_tokens_and_ends_a_bad_streak():
    state = RunState(step=7, tokens=1000, skipped_steps=2, bad_streak=2)
    out = account(state, sums(tokens=640.0), engine_skipped=False, fp16=False)
    assert (out.step, out.bad, out.stop_votes, out.loss) == (8, False, 0, 8.0)
    assert (state.step, state.tokens, state.skipped_steps, state.bad_streak) == (8, 1640, 2, 0)


@pytest.mark.parametrize("nonfinite", [NAN, dict(nonfinite_grad=1.0)], ids=["loss", "gradient"])
def test_a_non_finite_step_is_skipped_and_bad(nonfinite):
    state = RunState(step=3, tokens=100)
    out = account(state, sums(**nonfinite), engine_skipped=True, fp16=False)
    assert out.bad and (state.step, state.skipped_steps, state.bad_streak) == (4, 1, 1)
    assert state.tokens == 740  # the samples were consumed: a resume must not train on them again


def test_an_fp16_overflow_is_skipped_but_not_bad():
    """The loss scaler's overflows while it finds its scale are routine, not a bad streak."""
    state = RunState(bad_streak=0)
    out = account(state, sums(), engine_skipped=True, fp16=True)
    assert not out.bad and (state.skipped_steps, state.bad_streak) == (1, 0)
    bf16 = RunState()
    assert account(bf16, sums(), engine_skipped=True, fp16=False).bad and bf16.bad_streak == 1


def test_a_non_finite_step_the_engine_applied_stops_the_run():
    state = RunState(step=5)
    with pytest.raises(BadStepsError, match="step 6 had a non-finite loss but DeepSpeed applied the update"):
        account(state, sums(**NAN), engine_skipped=False, fp16=False)
    assert state.step == 5  # not counted


def _run_steps(nan_at: set[int], max_bad_steps: int, steps: int = 10) -> tuple[RunState, list[int], BadStepsError | None]:
    """Account ``steps`` steps, NaN at ``nan_at``, the way the loop does; the error that stopped it."""
    state, skipped = RunState(), []
    for step in range(1, steps + 1):
        account(state, sums(**NAN) if step in nan_at else sums(), engine_skipped=step in nan_at, fp16=False)
        skipped.append(state.skipped_steps)
        try:
            check_bad_streak(state, max_bad_steps, newest=lambda: Path("/run/checkpoints/step_00000003"))
        except BadStepsError as e:
            return state, skipped, e
    return state, skipped, None


def test_a_bad_streak_stops_the_run_with_exit_3(capsys):
    """R7's case: one bad step, a good one, then three bad with --max-bad-steps 3."""
    state, skipped, error = _run_steps({2, 4, 5, 6}, max_bad_steps=3)
    assert state.step == 6 and skipped == [0, 1, 1, 2, 3, 4]
    assert error is not None and error.exit_status == EXIT_BAD_STEPS == 3
    assert str(error).startswith("3 non-finite steps in a row (4-6, --max-bad-steps 3)")
    assert str(error).endswith("newest checkpoint: /run/checkpoints/step_00000003")

    def body():
        raise error

    assert guarded(body) == EXIT_BAD_STEPS
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {error}"]


def test_single_bad_steps_or_max_bad_steps_0_never_stop():
    assert _run_steps({2, 4, 6, 8}, max_bad_steps=2)[2] is None  # never two in a row
    state, skipped, error = _run_steps(set(range(1, 11)), max_bad_steps=0)
    assert error is None and state.bad_streak == 10 and skipped[-1] == 10


def test_a_stop_vote_on_any_rank_stops_every_rank_after_the_step():
    state = RunState()
    assert account(state, sums(stop=0.0), engine_skipped=False, fp16=False).stop_votes == 0
    out = account(state, sums(stop=2.0), engine_skipped=False, fp16=False)
    assert out.stop_votes == 2 and state.step == 2  # the step itself counts: it is checkpointed


class _Recorder(Checkpointer):
    """A Checkpointer that records the steps it would commit instead of writing them."""

    def __init__(self, save_every: int, saved_at: int | None = None):
        self.root, self.save_every, self.saved_at, self.committed = Path("/run/checkpoints"), save_every, saved_at, []

    def _commit(self, state: RunState) -> Path:
        self.committed.append(state.step)
        self.saved_at = state.step
        return self.root / f"step_{state.step}"


def test_checkpoints_on_schedule_but_never_after_a_bad_step():
    ckpt = _Recorder(save_every=2)
    for step, bad in [(1, False), (2, False), (3, False), (4, True), (5, False), (6, False)]:
        ckpt.save(RunState(step=step, bad_streak=int(bad)))
    assert ckpt.committed == [2, 6]  # step 4 was bad: the newest checkpoint stays a good one
    assert ckpt.save(RunState(step=6), last=True) == Path("/run/checkpoints/step_00000006")  # already saved
    assert ckpt.save(RunState(step=7), last=True) == Path("/run/checkpoints/step_7") and ckpt.committed == [2, 6, 7]


def test_the_final_checkpoint_of_a_resumed_run_that_trained_nothing_is_the_resumed_one():
    ckpt = _Recorder(save_every=0, saved_at=12)
    assert ckpt.save(RunState(step=12), last=True) == Path("/run/checkpoints/step_00000012")
    assert ckpt.save(RunState(step=12)) is None and ckpt.committed == []


def _faults(nan: str = "", hang: str | None = None) -> Faults:
    return Faults.from_args(argparse.Namespace(debug_inject_nan_at=nan, debug_hang_at=hang))


def test_faults_make_rank_0s_loss_nan_at_the_named_steps_only():
    faults = _faults("2, 5")
    loss = torch.tensor(3.0)
    assert math.isnan(faults.loss(loss, rank=0, step=5)) and faults.loss(loss, rank=0, step=3) is loss
    assert faults.loss(loss, rank=1, step=5) is loss
    assert _faults() == NO_FAULTS and _faults(hang="1:3").hang_at == (1, 3)
    NO_FAULTS.before_step(rank=0, step=1)  # returns: no hang asked for


@pytest.mark.parametrize("nan,hang", [("x", None), ("", "3"), ("", "1:2:3")])
def test_a_malformed_fault_flag_is_a_config_error(nan, hang):
    with pytest.raises(ConfigError, match="--debug"):
        _faults(nan, hang)


def test_every_failure_has_its_exit_status_and_one_line(capsys):
    cleaned = []
    for error, status in [(ConfigError("bad\nvalue"), EXIT_USER_ERROR), (RankFailure("rank 1 hung"), EXIT_RANK_FAILURE),
                          (BadStepsError("3 in a row"), EXIT_BAD_STEPS)]:
        def body(error=error):
            raise error

        assert guarded(body, cleanup=lambda status=status: cleaned.append(status)) == status
    assert guarded(lambda: None, cleanup=lambda: cleaned.append(EXIT_OK)) == EXIT_OK
    assert cleaned == [EXIT_USER_ERROR, EXIT_RANK_FAILURE, EXIT_BAD_STEPS, EXIT_OK]
    assert capsys.readouterr().err.splitlines() == ["error: bad value", "error: rank 1 hung", "error: 3 in a row"]
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback, and cleanup still runs
        guarded(lambda: 1 / 0, cleanup=lambda: cleaned.append("bug"))
    assert cleaned[-1] == "bug"
    assert guarded(lambda: 1) == 1  # a command that returns its own status (verify: 1 on damage) keeps it


# --------------------------------------------------------------------------- throughput by two clocks


def test_a_host_bound_run_reports_its_wall_rate_with_the_device_rate_beside_it(tmp_path):
    """Steps launched a second apart (the host's period) whose device work takes half a second:
    tokens/s and MFU by the wall clock are what the run takes, half the device clock's; each
    step's wall time runs to the next launch, the last one's to its read."""
    from bert_ds.config import BatchPlan
    from bert_ds.model.families import model_preset
    from bert_ds.train.loop import _StepLog
    from bert_ds.train.metrics import MetricsLogger
    from bert_ds.train.step import StepResult
    from bert_ds.train.summary import Progress

    progress = Progress()
    log = _StepLog(MetricsLogger(tmp_path, enabled=False, total_steps=4), progress, _cfg_with(model_preset("tiny", 2048)),
                   BatchPlan.resolve(16, 8, 1), 0, 1, torch.device("cpu"), None)
    log.peak = 1e-6  # TFLOP/s: a stand-in for a GPU's datasheet peak, so that MFU is reported
    written = []
    log.log.log_step = written.append
    state = RunState()
    times = [(0.0, 1.2, 1.0), (1.0, 2.3, 2.0), (2.0, 3.2, 3.0), (3.0, 4.5, None)]  # launch, read, next launch
    for launched_at, read_at, next_launch in times:
        outcome = account(state, sums(tokens=640.0), engine_skipped=False, fp16=False)
        log.write(StepResult(outcome, 1e-3, 1.0, 1.0, 0, 16, 0.5, 0.0, launched_at, read_at), state, next_launch)
    assert [r["wall_time_s"] for r in written] == [1.0, 1.0, 1.0, 1.5]
    assert [r["tokens_per_s"] for r in written] == [640.0, 640.0, 640.0, 640.0 / 1.5]
    assert all(r["tokens_per_s_device"] == 1280.0 and r["mfu_device"] == 2 * r["mfu"] for r in written[:3])
    summary = progress.summary(state, tmp_path, 0.0)  # the first step left out: 3 steps, 3.5 s, 1.5 s on the device
    assert summary["measured_steps"] == 3
    assert summary["tokens_per_s"] == pytest.approx(3 * 640 / 3.5)
    assert summary["tokens_per_s_device"] == pytest.approx(3 * 640 / 1.5)
    assert summary["mfu"] / summary["mfu_device"] == pytest.approx(1.5 / 3.5)


def _cfg_with(model):
    from bert_ds.config import DataConfig, TrainConfig

    return TrainConfig(model=model, data=DataConfig(train=["unused"]))
