"""``bert_ds.train``, SIGKILLed at one point of one checkpoint save (R3).

    python -m tests.bert_ds.save_crash_worker POINT STEP -- <bert_ds.train arguments>

POINT is one of ``bert_ds.checkpoint.store.SAVE_POINTS``; the process dies there while saving
step STEP, exactly as a ``kill -9`` at that moment would leave it.
"""

import os
import signal
import sys

from bert_ds.checkpoint import store as checkpoint
from bert_ds.train import cli as train


def main() -> int:
    point, step, sep, *train_args = sys.argv[1:]
    if point not in checkpoint.SAVE_POINTS or sep != "--":
        raise SystemExit(f"usage: POINT STEP -- ARGS (POINT: {', '.join(checkpoint.SAVE_POINTS)})")
    target = checkpoint.step_dir_name(int(step))

    def kill_here(reached: str, final) -> None:
        if reached == point and final.name == target:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.fault_hook = kill_here
    return train.main(train_args)


if __name__ == "__main__":
    sys.exit(main())
