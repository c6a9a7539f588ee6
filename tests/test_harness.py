"""The test harness itself: every process a test starts ends with the test."""

import sys
import time

from tests.conftest import end, spawn, started_by


def test_a_launcher_and_its_ranks_are_ended_together():
    # torchrun starts each rank in a session of its own: killing torchrun's group misses them
    launcher = spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      "--no-python", "sleep", "300"])
    deadline = time.monotonic() + 60
    while len(started_by(launcher)) < 3:  # torchrun and its two ranks
        assert launcher.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    ranks = started_by(launcher)
    end(launcher)
    assert started_by(launcher) == []
    print(f"ended torchrun and its ranks: {ranks}")
