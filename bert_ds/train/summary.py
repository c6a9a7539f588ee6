"""The closing summary of a run: ``OUTPUT/summary.json`` and the block printed by rank 0."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bert_ds.train.step import RunState


@dataclass
class Progress:
    """What the summary reports, gathered step by step; bad steps are left out."""

    losses: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)  # real tokens per step, all ranks
    wall_s: list[float] = field(default_factory=list)  # the host's time each step adds to the run (loop._StepLog)
    device_s: list[float] = field(default_factory=list)  # the device's span of each step
    peak_s: list[float] = field(default_factory=list)  # on GPUs: each step's work in seconds at the datasheet peak
    max_memory_gb: float | None = None  # on GPUs: torch.cuda.max_memory_allocated, the largest so far
    val: dict[str, float] = field(default_factory=dict)  # the latest validation pass
    stopped_by: str | None = None  # the stop signal's name when a signal stopped the run

    def add_step(self, record: dict[str, Any], tokens: float, peak_s: float | None) -> None:
        self.losses.append(record["loss"])
        self.tokens.append(tokens)
        self.wall_s.append(record["wall_time_s"])
        self.device_s.append(record["step_time_s"])
        if peak_s is not None:
            self.peak_s.append(peak_s)
        if "max_memory_gb" in record:
            self.max_memory_gb = max(self.max_memory_gb or 0.0, record["max_memory_gb"])

    def summary(self, state: RunState, checkpoint: Path, save_s: float) -> dict[str, Any]:
        """Rates over the measured steps (the first ones, which include start-up, left out):
        their tokens over their time, by the host's wall clock (what the run takes for them) and
        by the device's (``*_device``)."""
        k = max(1, min(10, len(self.losses) // 5))
        skip = k if len(self.losses) > k else 0
        tokens, wall, device, peak = (sum(xs[skip:]) for xs in (self.tokens, self.wall_s, self.device_s, self.peak_s))
        return {
            "steps": state.step, "tokens": state.tokens,
            "tokens_per_s": tokens / wall if wall else float("nan"),
            "tokens_per_s_device": tokens / device if device else float("nan"),
            "mfu": peak / wall if self.peak_s and wall else None,
            "mfu_device": peak / device if self.peak_s and device else None,
            "measured_steps": max(0, len(self.losses) - skip),
            "max_memory_gb": self.max_memory_gb,
            "loss_first": sum(self.losses[:k]) / k if self.losses else float("nan"),
            "loss_last": sum(self.losses[-k:]) / k if self.losses else float("nan"),
            "val": self.val, "checkpoint": str(checkpoint), "skipped_steps": state.skipped_steps,
            "stopped_by": self.stopped_by, "last_save_s": save_s,
        }


def print_summary(s: dict[str, Any]) -> None:
    val = s["val"]
    lines = [
        f"steps            {s['steps']}",
        f"real tokens      {s['tokens']:,}",
        f"real tokens/s    {s['tokens_per_s']:,.0f} by wall time ({s['tokens_per_s_device']:,.0f} by the device's "
        f"clock; warm-up steps excluded)",
        f"loss             {s['loss_first']:.3f} -> {s['loss_last']:.3f}",
    ]
    if s["mfu"] is not None:
        lines.append(f"MFU              {s['mfu']:.1%} by wall time ({s['mfu_device']:.1%} by the device's clock) of "
                     "the datasheet dense bf16 peak (bert_ds/model/flops.py accounting)")
    if s.get("max_memory_gb") is not None:
        lines.append(f"peak GPU memory  {s['max_memory_gb']:.1f} GiB on rank 0 (torch.cuda.max_memory_allocated)")
    if val:
        nsp = f", NSP acc {val['nsp_acc']:.3f}" if val["nsp_acc"] == val["nsp_acc"] else ""  # NaN: no pair task
        lines.append(f"held-out         MLM acc {val['mlm_acc']:.3f}{nsp}, MLM loss {val['mlm_loss']:.3f}")
    if s["skipped_steps"]:
        lines.append(f"skipped steps    {s['skipped_steps']} (non-finite or fp16 overflow)")
    if s["stopped_by"]:
        lines.append(f"stopped by       {s['stopped_by']} (rerun the same command to resume)")
    lines.append(f"checkpoint       {s['checkpoint']}")
    print("\n".join(["== training summary =="] + lines), flush=True)
