"""LAMB over flat parameter groups, as DeepSpeed ZeRO-1 lays them out on one rank, without DeepSpeed.

:class:`FlatLamb` moves each param group's parameters into one flat fp32 tensor (the
parameters become views of it, so the model and its state dict are unchanged), gathers
their gradients into the flat tensor's gradient before each step, and steps
:class:`~bert_ds.optim.lamb.Lamb` bound to the flat tensors: one trust ratio per parameter,
and the update of :func:`bert_ds.kernels.lamb.lamb_update`, fused on a GPU where the
``kernels`` setting allows it, as in a training run through the engine. A loop that steps a
model without DeepSpeed (``bert_ds.tools.bench``) thereby runs the optimizer training runs,
at the cost of one copy of the gradients per step.

Build it after the model is on its device and in its dtype: moving the model later would
replace the views.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from bert_ds.optim.lamb import Lamb


class FlatLamb(Lamb):
    """:class:`Lamb` on one flat tensor per param group; ``param_groups`` as :class:`Lamb` takes them."""

    def __init__(self, param_groups: Iterable[dict], **lamb_kwargs) -> None:
        flat_groups, self._members = [], []
        for group in param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in params]).requires_grad_()
            segments, offset = [], 0
            with torch.no_grad():
                for index, p in enumerate(params):
                    p.data = flat.detach()[offset:offset + p.numel()].view_as(p)
                    segments.append((offset, p.numel(), index))
                    offset += p.numel()
            flat_groups.append({**group, "params": [flat]})
            self._members.append((flat, params, segments))
        super().__init__(flat_groups, **lamb_kwargs)
        for flat, params, segments in self._members:
            self.bind_flat_tensor(flat, segments, len(params))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("FlatLamb takes no closure: run the backward before step()")
        for flat, params, _ in self._members:
            # a parameter without a gradient takes zeros, as in ZeRO's flat gradient partition
            flat.grad = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
                                   for p in params])
        return super().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for flat, params, _ in self._members:
            for p in params:
                p.grad = None
            flat.grad = None


__all__ = ["FlatLamb"]
