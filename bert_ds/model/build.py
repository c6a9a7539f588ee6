"""Building a model of any family: :func:`build_model` (initialised) and :func:`meta_model`
(names and shapes only, on the meta device). The family's record says which module it is
(:mod:`bert_ds.model.families`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from bert_ds.model.families import AnyModelConfig, family_of

# What build_model returns: a family's pretraining module, which takes the shared batch layout and
# returns bert_ds.model.mlm.PreTrainingOutput; code outside the family folders knows no more of it.
PretrainingModel = nn.Module


def build_model(config: AnyModelConfig, train_seq_len: int | None = None) -> PretrainingModel:
    """The pretraining model of ``config``'s family, initialised. ``train_seq_len``: the sequence
    length training feeds, at which ``kernels=auto`` races its candidates."""
    return family_of(config).build(config, train_seq_len)


# The in-place fills a model's initialisation runs, which a meta tensor has no values for:
# torch.nn.init's (modules' reset_parameters) and the tensor methods (_init_weights).
_FILLS = frozenset({
    nn.init.normal_, nn.init.trunc_normal_, nn.init.uniform_, nn.init.constant_, nn.init.ones_, nn.init.zeros_,
    nn.init.kaiming_uniform_, nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_})


class _SkipMetaFills(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FILLS:
            tensor = args[0] if args else kwargs["tensor"]  # torch.nn.init passes it by name
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def meta_model(config: AnyModelConfig) -> PretrainingModel:
    """The pretraining model of ``config`` on the meta device, for its names and shapes: nothing
    allocated, no initialisation run. (``normal_`` on a meta tensor imports torch._dynamo
    the first time, about 2 s of a process that only exports or counts parameters.)"""
    with torch.device("meta"), _SkipMetaFills():
        return build_model(config)
