"""Skipping an optimizer step on the device: a flag the optimizer reads there, never the host.

The training step finds a non-finite loss or gradient on the device (a fused norm, summed in
the all-reduce of its statistics). Reading that finding to the host, to decide whether to call
``step()``, would wait for everything queued before it: on a GPU, the whole backward. So the
step hands the finding to the optimizer as a flag, a one-element float32 tensor on the
parameters' device, and the optimizer's ``step()`` leaves every parameter and moment bitwise as
it was where the flag is non-zero:

- bert-ds's :class:`~bert_ds.optim.lamb.Lamb` and :class:`~bert_ds.optim.stable_adamw.StableAdamW`
  (:class:`~bert_ds.optim.fragments.FragmentOptimizer`) read it in LAMB's kernels, or zero their
  PyTorch ops' factors with it (:class:`bert_ds.kernels.lamb.SkipFactors`). Their per-parameter
  step count, a host number for the bias corrections, moves on regardless: the corrections of
  later steps are then those of one step more, which after the first few hundred steps is a
  change in the seventh digit or below.
- PyTorch's fused Adam and AdamW take it as ``found_inf``, the attribute ``GradScaler`` sets,
  and take back their step counts too.

The LR schedule, which lives on the host, moves on as well, as under PyTorch's ``GradScaler``.
"""

from __future__ import annotations

import torch

from bert_ds.optim.fragments import FragmentOptimizer


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`skip_next_step_if` works for ``optimizer``: bert-ds's Lamb and StableAdamW,
    and PyTorch's Adam and AdamW built with ``fused=True``."""
    if isinstance(optimizer, FragmentOptimizer):
        return True
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def skip_next_step_if(optimizer: torch.optim.Optimizer, flag: torch.Tensor | None) -> None:
    """From now on, ``optimizer.step()`` changes nothing where ``flag`` (a one-element float32
    tensor on the parameters' device, 0 or 1) is 1; None: steps as usual. The flag is read on the
    device at each step, so the caller may write it before every step or hand a new one. Lamb and
    StableAdamW skip on any non-zero value; torch's fused Adam/AdamW skip on exactly 1 and take the flag off
    their step counts, so other values would step them (and miscount)."""
    if not skips_on_device(optimizer):
        raise ValueError(f"{type(optimizer).__name__} cannot skip a step on the device (bert-ds's Lamb and "
                         "StableAdamW and torch's fused Adam/AdamW can)")
    if flag is not None and (flag.dtype != torch.float32 or flag.numel() != 1):
        raise ValueError(f"the skip flag must be one float32 value, got {flag.dtype} of {flag.numel()}")
    if flag is not None:
        elsewhere = {p.device for group in optimizer.param_groups for p in group["params"]} - {flag.device}
        if elsewhere:
            raise ValueError(f"the skip flag is on {flag.device}, parameters on {', '.join(map(str, elsewhere))}")
    if isinstance(optimizer, FragmentOptimizer):
        optimizer.skip_if = flag
    else:  # torch's fused Adam/AdamW read it (GradScaler's protocol), 0-d as the step counts they take it off
        optimizer.found_inf = None if flag is None else flag.reshape(())


__all__ = ["skip_next_step_if", "skips_on_device"]
