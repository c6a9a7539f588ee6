"""The one place that loads the fused CUDA extension, or says why it cannot.

Attempts, cheapest first, stopping at the first that works:
  1. already loaded in this process (``functools.cache``);
  2. a prebuilt module installed with the package;
  3. a JIT build of ``kernels/csrc`` (``torch.utils.cpp_extension``, cached on disk);
  4. none: ``(None, reason)``, so that ``kernels=cuda`` fails with the reason and
     ``kernels=auto`` can log it.

This version ships no ``.cu`` sources, so steps 2 and 3 do not exist yet and the
loader always ends at step 4. The contract the extension will meet: one function
per op, named like the public op (``layer_norm``, ``bias_gelu``,
``varlen_attention``), taking the arguments of its ``<op>_ref`` and supporting
autograd.
"""

import functools
from types import ModuleType

import torch


@functools.cache
def load_extension() -> tuple[ModuleType | None, str]:
    """Returns ``(module, "")`` when the fused kernels can run, else ``(None, why not)``."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    # The prebuilt import and the JIT build of kernels/csrc slot in here, in that order.
    return None, "the fused CUDA extension is not built in this version"
