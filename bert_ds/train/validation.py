"""A validation pass on the held-out samples, which a stop signal on any rank abandons."""

from __future__ import annotations

import torch

from bert_ds.config import TrainConfig
from bert_ds.loader.pretraining import PretrainingDataset, to_device, validation_batches
from bert_ds.train.signals import StopRequest
from bert_ds.train.step import AT, STATS, all_reduce, batch_stats, forward, ratio

# Validation batches between two checks that no rank was asked to stop: a signal during a
# pass ends it within this many forward passes (a fraction of a second on the tiny preset).
VAL_STOP_CHECK_EVERY = 4


def validate(model, dataset: PretrainingDataset, cfg: TrainConfig, rank: int, world: int,
             device: torch.device, stop: StopRequest) -> dict[str, float] | None:
    """The held-out metrics, or None when a stop was requested on any rank during the pass
    (the pass is abandoned; every rank returns None at the same batch). ``model``: what
    computes in training (the engine, or :mod:`~bert_ds.train.bf16_copy`'s copy)."""
    model.eval()
    totals = torch.zeros(len(STATS) + 1, dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            batches = validation_batches(dataset, cfg.data.val_samples, cfg.micro_batch_size, rank, world)
            for i, batch in enumerate(batches):
                if i % VAL_STOP_CHECK_EVERY == 0 and stop.agreed(device):
                    return None
                batch = to_device(batch, device, non_blocking=True)
                out = forward(model, batch)
                mlm_loss_sum = out.mlm_loss.detach().double() * out.mlm_count
                totals += torch.cat([batch_stats(out, batch, out.loss), mlm_loss_sum.reshape(1)])
    finally:
        model.train()
    totals[AT["stop"]] = float(stop.requested)  # a signal after the last check: the closing all-reduce tells
    *sums, mlm_loss_sum = all_reduce(totals).tolist()  # after the pass: one read
    s = dict(zip(STATS, sums))
    if s["stop"] > 0:
        stop.acknowledge()
        return None
    return {"loss": ratio(s["loss_sum"], s["micro_batches"]),
            "mlm_loss": ratio(mlm_loss_sum, s["mlm_count"]),
            "mlm_acc": ratio(s["mlm_correct"], s["mlm_count"]),
            "nsp_acc": ratio(s["nsp_correct"], s["nsp_count"])}
