"""The model families and what builds each: one place where a config's ``arch`` meets its module.

A family brings its config (:mod:`bert_ds.model.config`) and its pretraining module, which
takes the shared batch layout and returns :class:`bert_ds.model.mlm.PreTrainingOutput`; the
data, the engine, the loss, the kernels' dispatch, the checkpoints and the evaluation know
nothing of which family runs. Adding one is a config class, a module, and a line here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from bert_ds.model.bert import BertForPreTraining
from bert_ds.model.config import AnyModelConfig, ModelConfig, ModernBertConfig
from bert_ds.model.modernbert import ModernBertForPreTraining

PretrainingModel = BertForPreTraining | ModernBertForPreTraining
_MODULES: dict[type, type] = {ModelConfig: BertForPreTraining, ModernBertConfig: ModernBertForPreTraining}


def build_model(config: AnyModelConfig, train_seq_len: int | None = None) -> PretrainingModel:
    """The pretraining model of ``config``'s family, initialised. ``train_seq_len``: the sequence
    length training feeds, at which ``kernels=auto`` races its candidates."""
    return _MODULES[type(config)](config, train_seq_len=train_seq_len)


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
