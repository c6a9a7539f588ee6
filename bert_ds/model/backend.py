"""The kernels a model runs, resolved once at its construction: what every family's pretraining
module shares of it."""

from __future__ import annotations

from typing import Any

from bert_ds.kernels.ops import Backend, OpShapes, resolve_backend
from bert_ds.model.config import GELU_APPROXIMATE


def model_backend(config: Any, train_seq_len: int | None, activation: str, dropout: float,
                  **family_shapes: Any) -> tuple[OpShapes, Backend]:
    """The shapes ``kernels=auto`` races its candidates at (and the optimizer's) and the backend
    ``config.kernels`` resolves to there. ``train_seq_len``: the sequence length training feeds
    (default: ``max_position_embeddings``); ``activation``: the config's GELU form; ``dropout``:
    the dropout the fused residual ops apply; ``family_shapes``: what else of
    :class:`~bert_ds.kernels.ops.OpShapes` the family's layers differ in (a window, GeGLU, ...)."""
    shapes = OpShapes(hidden=config.hidden_size, intermediate=config.intermediate_size, num_heads=config.num_heads,
                      max_seqlen=train_seq_len or config.max_position_embeddings,
                      approximate=GELU_APPROXIMATE[activation], hidden_dropout=dropout, vocab=config.vocab_size,
                      **family_shapes)
    return shapes, resolve_backend(config.kernels, shapes)
