"""An optimizer step skipped by a device flag (bert_ds.optim.device_skip): with the flag set and
a gradient of NaN and inf, every weight and moment stays bitwise as it was and nothing is read
to the host; with it clear, the step is bitwise the step without a flag."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bert_ds.optim import device_skip
from bert_ds.optim.lamb import Lamb

pytestmark = pytest.mark.lowest  # torch's fused AdamW and its found_inf, foreach ops with tensor factors


def _lamb_plain(params):
    return Lamb([{"params": params[:1], "weight_decay": 0.01}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2)


def _lamb_flat(params):
    lamb = Lamb([{"params": params[:1], "weight_decay": 0.01}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2,
                kernels="torch")
    lamb.bind_flat_tensor(params[0], [(0, 1500, 0), (1500, 400, 1), (1932, 68, 2)], num_params=3)  # and padding
    return lamb


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=True)


OPTIMIZERS = {"lamb, separate tensors": _lamb_plain, "lamb, a bound flat tensor": _lamb_flat, "fused adamw": _adamw}


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(2000, generator=g)), torch.nn.Parameter(torch.randn(37, generator=g))]


def _grads(step: int, poisoned: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(2000, generator=g), torch.randn(37, generator=g)]
    if poisoned:
        grads[0][::5], grads[1][3] = float("nan"), float("inf")
    return grads


def _snapshot(opt, params) -> list[torch.Tensor]:
    state = [v.clone() for p in params for v in opt.state[p].values() if torch.is_tensor(v)]
    return [p.detach().clone() for p in params] + state


class _RefuseScalarReads(TorchDispatchMode):
    """Refuses ``aten._local_scalar_dense``, where every read of a value to the host ends, those
    torch makes itself in C++ too (a 0-d tensor taken as a Scalar argument)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("the step read a tensor to the host")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _no_host_reads():
    """Every way of reading a tensor's value to the host raises while the optimizer steps."""
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def refuse(*args, **kwargs):
        raise AssertionError("the step read a tensor to the host")
    try:
        for name in names:
            setattr(torch.Tensor, name, refuse)
        with _RefuseScalarReads():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _run(make, flags: list[float | None], shape: tuple[int, ...] = ()) -> tuple[list[list[torch.Tensor]], list]:
    """A step per flag (None: no flag given) of shape ``shape``, the flagged steps with poisoned
    gradients; the snapshot before each step, and the end."""
    params = _params()
    opt = make(params)
    flag = torch.zeros(shape, dtype=torch.float32)
    seen = []
    for step, value in enumerate(flags):
        for p, grad in zip(params, _grads(step, poisoned=bool(value))):
            p.grad = grad
        device_skip.skip_next_step_if(opt, None if value is None else flag)
        if value is not None:
            flag.fill_(value)
        seen.append(_snapshot(opt, params))
        with _no_host_reads() if value is not None else contextlib.nullcontext():
            opt.step()
    return seen, _snapshot(opt, params)


@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_flagged_step_changes_nothing_and_reads_nothing(name, shape):
    seen, end = _run(OPTIMIZERS[name], [None, 1.0, 0.0], shape)
    after_skip = seen[2]
    assert all(torch.equal(a, b) for a, b in zip(seen[1], after_skip)), "the skipped step changed a weight or moment"
    assert not all(torch.equal(a, b) for a, b in zip(after_skip, end)), "the step after it did not step"
    assert all(torch.isfinite(t).all() for t in end)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_clear_flag_steps_bitwise_as_no_flag(name):
    _, flagged = _run(OPTIMIZERS[name], [0.0, 0.0, 0.0])
    _, plain = _run(OPTIMIZERS[name], [None, None, None])
    assert all(torch.equal(a, b) for a, b in zip(flagged, plain))


def test_an_optimizer_that_cannot_skip_on_the_device_is_refused():
    params = _params()
    foreach = torch.optim.AdamW(params, foreach=True)
    assert not device_skip.skips_on_device(foreach)
    assert all(device_skip.skips_on_device(make(_params())) for make in OPTIMIZERS.values())
    with pytest.raises(ValueError, match="cannot skip a step on the device"):
        device_skip.skip_next_step_if(foreach, torch.zeros(()))
    with pytest.raises(ValueError, match="one float32 value"):
        device_skip.skip_next_step_if(_adamw(params), torch.zeros(2))
    with pytest.raises(ValueError, match="the skip flag is on meta"):
        device_skip.skip_next_step_if(_adamw(params), torch.zeros((), device="meta"))
