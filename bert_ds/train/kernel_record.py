"""What a run's ops run, kept with the run: ``OUTPUT/kernels.json`` and its start-up lines.

``kernels=auto`` races each op's candidates on the device at the model's shapes and keeps the
verdicts in the user's cache, beside the build (``bert_ds.kernels.choice``); its INFO log lines
reach no training command's output. So each run writes, into its own folder, how its model's
``kernels`` setting resolved (:class:`bert_ds.kernels.choice.Resolution`: the winners, both
clocks' timings, the exclusions; or what runs instead of a race, and why), and prints it once
with its other start-up lines. Each phase of ``bert_ds.train.phases`` is a run with its own
folder and sequence length, so each phase keeps the verdicts it ran with.

Design choices:

- The verdicts are read from the model and the recorded race, never raced again: the model
  resolved its setting when it was built (its ``backend``).
- Rank 0 alone writes and prints; the file is replaced whole (``bert_ds.base.atomic``), so a
  reader (a summary tool, a resumed run's reader) never sees a part.
"""

from __future__ import annotations

import json
from pathlib import Path

from bert_ds.base.atomic import atomic_write
from bert_ds.kernels.choice import Resolution, resolution
from bert_ds.model.build import PretrainingModel
from bert_ds.train.metrics import MetricsLogger

FILE_NAME = "kernels.json"


def record_kernels(log: MetricsLogger, model: PretrainingModel, output: Path, rank: int) -> Resolution | None:
    """On rank 0, ``output/kernels.json`` written and its lines printed through ``log``; the
    resolution recorded (None on the other ranks)."""
    if rank != 0:
        return None
    resolved = resolution(model.config.kernels, model.op_shapes, model.backend)
    atomic_write(output / FILE_NAME, json.dumps(resolved.to_json(), indent=2))
    for line in resolved.lines():
        log.print(line)
    return resolved
