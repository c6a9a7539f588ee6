"""Fused kernels for BERT and their plain-PyTorch references.

Each op lives in ``kernels/<op>.py`` as ``<op>_ref()`` (the reference, plain
PyTorch) and ``<op>(..., backend=...)`` (the public op, which runs the reference
or the fused CUDA kernel). The backend is resolved once with
:func:`resolve_backend` from a ``kernels: auto | cuda | torch`` setting.
"""

from kernels.attention import varlen_attention, varlen_attention_ref
from kernels.bias_gelu import bias_gelu, bias_gelu_ref
from kernels.dispatch import Backend, KernelUnavailable, UnknownKernelBackend, resolve_backend
from kernels.layer_norm import layer_norm, layer_norm_ref

__all__ = [
    "Backend",
    "KernelUnavailable",
    "UnknownKernelBackend",
    "bias_gelu",
    "bias_gelu_ref",
    "layer_norm",
    "layer_norm_ref",
    "resolve_backend",
    "varlen_attention",
    "varlen_attention_ref",
]
