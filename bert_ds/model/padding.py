"""Where the real tokens of a right-padded batch go once padding is removed.

The model runs on packed (T, ...) tokens, T = real tokens of the batch, and needs,
besides the padded (B, S) inputs: the flat offsets of the real tokens (to gather
them), ``cu_seqlens`` and the longest sequence (for attention), and the packed rows
of the masked tokens with their labels (the MLM decoder runs on those rows only).
Each of these has a data-dependent size, so computing it on the GPU means asking
the device for a count or a length: a ``.tolist()``, ``.nonzero()`` or a
boolean-mask index that stalls the queue every micro-batch. :func:`unpad` computes
them on the host instead; the loader calls it in its collate (in the worker
processes), so the training forward only gathers with ready-made indices.

:func:`unpad` is the one definition of this layout: the loader, the model's
convenience path (a caller that passes only ``attention_mask``) and every batch
built by hand use it.
"""

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # label of a position that is not predicted (the Hugging Face convention)


@dataclass(frozen=True)
class Unpadded:
    """The packed layout of a (B, S) batch with T real tokens, M of them masked.

    Field names are also the batch keys under which :func:`bert_ds.loader.pretraining.collate`
    delivers them (:meth:`batch_fields`, :meth:`from_batch`).
    """

    token_indices: torch.Tensor  # (T,) int64: flat offsets of the real tokens in the row-major (B*S) grid
    cu_seqlens: torch.Tensor  # (B+1,) int32: sequence b is packed rows cu_seqlens[b]:cu_seqlens[b+1]
    max_seqlen: int  # longest sequence in the batch, a host int: it sizes the attention's work
    masked_positions: torch.Tensor | None = None  # (M,) int64: packed rows (in [0, T)) that are MLM targets
    masked_labels: torch.Tensor | None = None  # (M,) int64: the target token of each of those rows

    def batch_fields(self) -> dict[str, torch.Tensor | int]:
        """The fields as batch entries (the masked ones only when there are labels)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_batch(cls, batch: Mapping[str, torch.Tensor | int]) -> "Unpadded":
        """The layout :meth:`batch_fields` put into ``batch`` (wherever its tensors have moved since)."""
        return cls(**{f.name: batch[f.name] for f in fields(cls) if f.name in batch})


def unpad(attention_mask: torch.Tensor, labels: torch.Tensor | None = None) -> Unpadded:
    """attention_mask: (B, S), 1 for real tokens, padding on the right; labels: (B, S) int64,
    ``IGNORE_INDEX`` where a token is not an MLM target (pad positions included), or None.

    Returns the :class:`Unpadded` layout; masked rows are in packed (row-major) order,
    the order of ``labels[labels != IGNORE_INDEX]``. Raises ``ValueError`` for a
    sequence without tokens or with a real token after padding (either would break
    ``cu_seqlens``).

    Call it on the host: on a device tensor it waits for the device, since the sizes it
    returns are host values.
    """
    is_real = attention_mask.bool()
    seqlens = is_real.sum(dim=1, dtype=torch.int32)  # (B,)
    real_after_pad = (is_real[:, 1:] & ~is_real[:, :-1]).any()
    max_len, min_len, not_right_padded = torch.stack(
        [seqlens.max(), seqlens.min(), real_after_pad.to(torch.int32)]).tolist()
    if min_len == 0:
        raise ValueError("attention_mask has a sequence without any real token")
    if not_right_padded:
        raise ValueError("attention_mask must have its padding on the right (a real token follows a pad)")
    token_indices = torch.nonzero(is_real.flatten()).squeeze(1)  # (T,)
    masked_positions = masked_labels = None
    if labels is not None:
        packed_labels = labels.flatten()[token_indices]  # (T,)
        masked_positions = torch.nonzero(packed_labels != IGNORE_INDEX).squeeze(1)  # (M,)
        masked_labels = packed_labels[masked_positions]  # (M,)
    return Unpadded(
        token_indices=token_indices,
        cu_seqlens=F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0)),
        max_seqlen=max_len,
        masked_positions=masked_positions,
        masked_labels=masked_labels,
    )


def pretraining_inputs(batch: Mapping[str, torch.Tensor | int]) -> dict[str, Any]:
    """A batch of ``bert_ds.loader.pretraining.collate`` as every family's pretraining ``forward``'s
    keyword arguments: the precomputed, sync-free layout (no NSP labels when the data has no pair
    task; a family without segment embeddings ignores the segment ids)."""
    return {"input_ids": batch["input_ids"], "token_type_ids": batch["token_type_ids"],
            "next_sentence_label": batch.get("next_sentence_label"), "unpadded": Unpadded.from_batch(batch)}


def input_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, masked_lm_labels: torch.Tensor | None,
                 unpadded: Unpadded | None, max_positions: int) -> tuple[Unpadded, torch.Tensor]:
    """A model's packed layout of ``input_ids`` (B, S), padded on the right: ``unpadded`` as the
    loader computed it (training), or :func:`unpad` of ``attention_mask`` and
    ``masked_lm_labels`` (the Hugging Face arguments); with each token's position in its
    sequence (T,). Exactly one of the two ways, and sequences within ``max_positions``."""
    if (unpadded is None) == (attention_mask is None):
        raise ValueError("pass exactly one of attention_mask (with masked_lm_labels) and unpadded")
    if unpadded is None:
        unpadded = unpad(attention_mask, masked_lm_labels)
    elif masked_lm_labels is not None:
        raise ValueError("with unpadded, the MLM labels come in unpadded.masked_labels, not masked_lm_labels")
    seq_len = input_ids.shape[1]
    if seq_len > max_positions:
        raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings {max_positions}")
    return unpadded, positions(unpadded.token_indices, seq_len)


def positions(token_indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Each real token's position in its own sequence (T,): with the padding on the right, its
    offset in its row of the (B, ``seq_len``) grid. Every sequence starts at 0, whatever precedes
    it in the packed batch."""
    return token_indices % seq_len


def gather_tokens(x: torch.Tensor, token_indices: torch.Tensor) -> torch.Tensor:
    """x: (B, S, ...) -> (T, ...), the rows at ``Unpadded.token_indices``."""
    return x.flatten(0, 1).index_select(0, token_indices)
