"""The run's checkpoints: where they go, how many stay, when one is due, and what goes in.

Built once per run with everything it owns; the loop only says ``save(state)`` after each
step and ``save(state, last=True)`` at the end. The commit protocol itself (temporary folder,
fsync, rename, the ``latest`` pointer) is :mod:`bert_ds.checkpoint.store`'s.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from bert_ds.base.errors import BadStepsError
from bert_ds.checkpoint import store as checkpoint
from bert_ds.config import TrainConfig
from bert_ds.data_tools.partition import dataset_folders
from bert_ds.loader.pretraining import PretrainingLoader
from bert_ds.train.step import RunState


class Checkpointer:
    def __init__(self, root: Path, *, engine, loader: PretrainingLoader, tokenizer_dir: Path, keep_last: int,
                 save_every: int, recipe: TrainConfig, rank: int, saved_at: int | None = None):
        self.root = root
        self.engine, self.loader, self.tokenizer_dir = engine, loader, tokenizer_dir
        self.keep_last, self.save_every = keep_last, save_every  # save_every 0: only the final save
        self.rank = rank
        self._model_config, self._train_config = recipe.model.to_dict(), recipe.to_dict()  # written with each
        self.saved_at = saved_at  # the step of the newest checkpoint of this run, if any
        self.last_save_s = 0.0  # how long the latest save took

    @classmethod
    def for_run(cls, cfg: TrainConfig, engine, loader: PretrainingLoader, rank: int,
                saved_at: int | None) -> Checkpointer:
        return cls(checkpoint.run_checkpoints(cfg.output), engine=engine, loader=loader,
                   # every dataset of a run shares one tokenizer: the first folder's (a parent's first part's)
                   tokenizer_dir=dataset_folders(cfg.data.train[0])[0],
                   keep_last=cfg.keep_last, save_every=cfg.save_every, recipe=cfg, rank=rank, saved_at=saved_at)

    def save(self, state: RunState, *, last: bool = False) -> Path | None:
        """Commit a checkpoint of ``state.step`` if one is due (collective: every rank calls it
        alike); return its folder, or None when none was due.

        On schedule, every ``save_every`` steps, but not after a step whose update was skipped:
        the newest checkpoint stays a good one while a bad streak lasts. ``last``: the run's
        final checkpoint, due unless this step's is committed already (its folder is returned)."""
        if last and self.saved_at == state.step:
            return self.root / checkpoint.step_dir_name(state.step)
        return self._commit(state) if last or (self.due(state.step) and state.bad_streak == 0) else None

    def due(self, step: int) -> bool:
        """Whether ``step`` is on the save schedule (its save may still not be made: a bad step)."""
        return bool(self.save_every) and step % self.save_every == 0

    def newest(self) -> Path | None:
        """The newest committed checkpoint (of this run or an earlier one), if any."""
        return checkpoint.find_latest(self.root)

    def _commit(self, state: RunState) -> Path:
        t = time.perf_counter()
        state.loader = self.loader.state_dict()
        snapshot = checkpoint.optimizer_snapshot(self.engine)
        try:
            path = checkpoint.save(self.engine, self.root, state.step, rank=self.rank,
                                   model_config=self._model_config, train_config=self._train_config,
                                   train_state=dataclasses.asdict(state), tokenizer_dir=self.tokenizer_dir,
                                   keep_last=self.keep_last, optimizer=snapshot)
        except checkpoint.NonFiniteWeightsError as e:  # nothing was saved: the run cannot go on
            raise BadStepsError(str(e)) from e
        self.last_save_s = time.perf_counter() - t
        self.saved_at = state.step
        return path
