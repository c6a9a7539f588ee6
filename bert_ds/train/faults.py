"""Fault injection for the reliability tests: the one seam through which a test breaks a run.

A real run has no faults (:data:`NO_FAULTS`). The tests ask for them with the command line's
test-hook flags, read once into a :class:`Faults`, which the training step consults at two
named points:

- :meth:`Faults.before_step` (``--debug-hang-at RANK:STEP``): that rank hangs forever as it
  starts that step, standing in for a rank stuck in I/O or a deadlock; its peers must fail
  after ``--collective-timeout`` and name it (R-promises on hung ranks).
- :meth:`Faults.loss` (``--debug-inject-nan-at STEP[,STEP...]``): rank 0's loss is NaN at those
  steps, so the step is skipped everywhere and a streak of them stops the run.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bert_ds.base.errors import ConfigError

if TYPE_CHECKING:  # the training command's parser adds these flags: --help needs no torch
    import torch


@dataclass(frozen=True)
class Faults:
    nan_at: frozenset[int] = frozenset()  # steps whose loss is NaN on rank 0
    hang_at: tuple[int, int] | None = None  # (rank, step) that hangs

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("test hooks (fault injection; not for real runs)")
        g.add_argument("--debug-inject-nan-at", default="", metavar="STEP[,STEP...]",
                       help="make rank 0's loss NaN at these steps")
        g.add_argument("--debug-hang-at", default=None, metavar="RANK:STEP",
                       help="make RANK hang forever when it starts STEP")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Faults:
        try:
            nan_at = frozenset(int(x) for x in args.debug_inject_nan_at.split(",") if x.strip())
            hang_at = tuple(int(x) for x in args.debug_hang_at.split(":")) if args.debug_hang_at else None
        except ValueError:
            raise ConfigError("--debug-inject-nan-at takes STEP[,STEP...] and --debug-hang-at RANK:STEP") from None
        if hang_at is not None and len(hang_at) != 2:
            raise ConfigError(f"--debug-hang-at takes RANK:STEP, got {args.debug_hang_at!r}")
        return cls(nan_at, hang_at)

    def before_step(self, rank: int, step: int) -> None:
        while self.hang_at == (rank, step):
            time.sleep(3600)

    def loss(self, loss: torch.Tensor, rank: int, step: int) -> torch.Tensor:
        return loss * float("nan") if rank == 0 and step in self.nan_at else loss


NO_FAULTS = Faults()
