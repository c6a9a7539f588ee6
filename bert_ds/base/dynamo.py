"""TorchDynamo imported when something compiles, not when an optimizer is made.

torch marks some of its functions ``torch._disable_dynamo``: every optimizer's
``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict``, so that a compiled
region calling one runs it eagerly. The mark wraps the function in ``torch._dynamo.disable`` at
its first call, and so imports TorchDynamo there: 2-2.5 s of CPU in a process that compiles
nothing. A tiny training run took 7.0 s of CPU with that import and 4.4 s without it (mean of
three each, 2026-11-28): every rank of every run, every evaluation, every test that starts one.

:func:`import_dynamo_when_compiling` gives those functions in advance what the mark caches at
their first call (``fn.__dynamo_disable``): a function that runs them as they are while
TorchDynamo has not been imported, when nothing can be compiling, and that installs torch's own
disable at the first call after it has been (a ``torch.compile`` imports it before it traces
anything). What it relies on is checked on the wrapper's code: ``torch._compile``'s wrapper
reads ``__dynamo_disable`` before it imports (torch 2.11 to 2.13). A torch whose wrapper differs
is left as it is, and only starts slower.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

# torch.optim.Optimizer's methods under torch._disable_dynamo that every optimizer runs
OPTIMIZER_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
CACHE_ATTRIBUTE = "__dynamo_disable"  # where torch._compile's wrapper caches the disabled function


def import_dynamo_when_compiling() -> list[str]:
    """Defer TorchDynamo's import from the first call of the :data:`OPTIMIZER_METHODS` to the first
    compilation. Returns the methods it deferred ([] where torch's wrapper is not the one known)."""
    import torch

    deferred = []
    for name in OPTIMIZER_METHODS:
        wrapper = getattr(torch.optim.Optimizer, name)
        fn = getattr(wrapper, "__wrapped__", None)
        if fn is None or not _caches_its_disable(wrapper) or hasattr(fn, CACHE_ATTRIBUTE):
            continue  # not torch's lazy mark, or already called (TorchDynamo is in)
        setattr(fn, CACHE_ATTRIBUTE, _until_dynamo_is_imported(fn))
        deferred.append(name)
    return deferred


def _caches_its_disable(wrapper: Callable[..., Any]) -> bool:
    """Whether ``wrapper`` is ``torch._compile._disable_dynamo``'s, which caches what it calls in
    ``fn.__dynamo_disable`` and imports TorchDynamo only where it finds nothing there."""
    code = getattr(wrapper, "__code__", None)
    return (code is not None and code.co_filename.endswith("_compile.py") and CACHE_ATTRIBUTE in code.co_names
            and CACHE_ATTRIBUTE in code.co_consts)


def _until_dynamo_is_imported(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:  # never imported: nothing is compiling, nothing to disable
            return fn(*args, **kwargs)
        disabled = dynamo.disable(fn, True, wrapping=False)  # what torch's wrapper would have made
        setattr(fn, CACHE_ATTRIBUTE, disabled)
        return disabled(*args, **kwargs)
    return call
