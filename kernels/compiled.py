"""An op's reference under ``torch.compile``: one more candidate of ``kernels=auto``.

Inductor fuses a reference's elementwise work and reductions into generated kernels (for
LayerNorm the fp32 upcast, the residual sum, the statistics and the cast in one), so the
compiled reference is what a hand kernel has to beat before it is worth running.

Design choices, and why:

- **Compiled at the first call**, not at import: ``torch.compile`` pulls in the compiler stack
  and every command would pay for it; only a race, or a model whose plan names the candidate,
  compiles.
- **The token count is dynamic from the first call.** It changes with every batch (and the
  race times one count, training feeds others); a compile specialised to it would compile
  again at the next batch. The ops that reduce over a fixed width (LayerNorm, bias + GELU)
  mark only the token dimension dynamic, so the width stays a constant and Inductor keeps its
  one-pass reduction; attention, whose batch size and longest sequence change too, is
  compiled with every size dynamic.
- **Inside a compiled model it is the reference.** The model's own ``torch.compile`` then
  compiles the reference with the rest of the graph; a compiled region inside a compiled
  region would only add a boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CompiledReference:
    """``reference`` under ``torch.compile``, with its reference's signature.

    ``rows``: the positions of the arguments whose first dimension is the token count (marked
    dynamic before each call); ``dynamic``: ``torch.compile``'s, True to make every size dynamic.
    ``compile_options``: more keyword arguments of ``torch.compile`` (a test's counting backend).
    """

    def __init__(self, reference: Callable[..., Any], rows: tuple[int, ...] = (), dynamic: bool | None = None,
                 **compile_options: Any) -> None:
        self.reference = reference
        self.rows = rows
        self.dynamic = dynamic
        self.compile_options = compile_options
        self._compiled: Callable[..., Any] | None = None
        self.__doc__ = f":func:`{reference.__name__}` under torch.compile."

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():  # inside a compiled model: its compiler takes the reference
            return self.reference(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self.reference, dynamic=self.dynamic, **self.compile_options)
        from torch._dynamo import maybe_mark_dynamic  # loaded by torch.compile above: a lookup

        for position in self.rows:
            if position < len(args) and isinstance(args[position], torch.Tensor):
                # "maybe": a count the compiler must specialise (a batch of one token) is no error
                maybe_mark_dynamic(args[position], 0)
        return self._compiled(*args)
