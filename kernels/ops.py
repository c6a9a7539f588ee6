"""The public face of the kernels: the ops, their references and native paths, and the
resolution of a ``kernels`` setting, from the modules that define them.

What the model, the optimizer and user code import (``from bert_ds.kernels.ops import
layer_norm, resolve_backend``). Importing it imports torch and ``choice``, which hands the
self-check's verdicts to the dispatch; the package's ``__init__`` imports none of it, so that
the commands under ``bert_ds.kernels`` answer ``--help`` without torch.
"""

from bert_ds.kernels.attention import (
    varlen_attention, varlen_attention_native, varlen_attention_packed, varlen_attention_ref,
)
from bert_ds.kernels.bias_gelu import bias_gelu, bias_gelu_native, bias_gelu_ref
from bert_ds.kernels.choice import UnknownKernelBackend, check_setting, resolve_backend
from bert_ds.kernels.cross_entropy import mlm_cross_entropy, mlm_cross_entropy_native, mlm_cross_entropy_ref
from bert_ds.kernels.dispatch import Backend, KernelSetting, KernelUnavailable, OpPlan
from bert_ds.kernels.dropout_layer_norm import (
    dropout_add_layer_norm, dropout_add_layer_norm_native, dropout_add_layer_norm_ref,
)
from bert_ds.kernels.geglu import geglu, geglu_native, geglu_ref
from bert_ds.kernels.layer_norm import layer_norm, layer_norm_native, layer_norm_ref
from bert_ds.kernels.local_attention import local_attention, local_attention_native, local_attention_ref
from bert_ds.kernels.rotary_attention import rotary_attention, rotary_attention_fused, rotary_attention_ref
from bert_ds.kernels.speed import OpShapes

__all__ = [
    "Backend",
    "KernelSetting",
    "KernelUnavailable",
    "OpPlan",
    "OpShapes",
    "UnknownKernelBackend",
    "bias_gelu",
    "bias_gelu_native",
    "bias_gelu_ref",
    "check_setting",
    "dropout_add_layer_norm",
    "dropout_add_layer_norm_native",
    "dropout_add_layer_norm_ref",
    "geglu",
    "geglu_native",
    "geglu_ref",
    "layer_norm",
    "layer_norm_native",
    "layer_norm_ref",
    "local_attention",
    "local_attention_native",
    "local_attention_ref",
    "mlm_cross_entropy",
    "mlm_cross_entropy_native",
    "mlm_cross_entropy_ref",
    "resolve_backend",
    "rotary_attention",
    "rotary_attention_fused",
    "rotary_attention_ref",
    "varlen_attention",
    "varlen_attention_native",
    "varlen_attention_packed",
    "varlen_attention_ref",
]
