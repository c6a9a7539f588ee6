"""What every pretraining model family shares after its encoder: the tied, padded MLM decoder,
the masked-LM loss on the masked rows only, and the output a trainer reads.

- **The decoder runs only on masked positions** (15-30% of tokens). With a vocabulary of
  30-50k it is the largest GEMM of a small encoder, and the other rows' logits are never used
  by the loss. Its weight (the tied word embedding) is padded to a multiple of 8 rows for the
  GEMM (BERT's 30,522 -> 30,528): a logit row of 30,522 bf16 values is not 16-byte aligned,
  which leaves tensor-core GEMMs the slow alignment-2 kernels in all three passes. The padded
  rows are zero and their bias -inf, so they add nothing to the softmax, win no argmax and get
  a zero gradient; the parameters keep their shape, so nothing of it reaches a checkpoint.
- **The loss is taken with fp32 math** (``kernels.mlm_cross_entropy``): in bf16 a log-softmax
  over 30k logits loses the small differences the gradient is made of (the logits themselves
  stay bf16). Sum over count equals Hugging Face's mean, but is 0 rather than NaN for a batch
  with nothing masked.
- **Counts are device values made on the device** (:func:`device_count`): the trainer sums
  accuracies without a read of the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bert_ds.kernels.ops import Backend, mlm_cross_entropy


class MlmDecoder(nn.Linear):
    """The tied decoder (weight: the word embedding, (V, H); bias: the head's own), its GEMM
    padded to V' = :func:`padded_vocab_size` columns. A module of its own so that ZeRO-3
    gathers its (tied) weight before the forward, as it does for any ``nn.Linear``. Made on
    "meta" and given the tied tensors by its owner."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, H) -> logits (M, V'), the padding columns -inf (:func:`vocab_columns` views the V real ones)."""
        weight, bias = self.weight, self.bias
        pad = padded_vocab_size(weight.shape[0]) - weight.shape[0]
        if not pad:
            return F.linear(x, weight, bias)
        # Under autocast the fp32 weight is padded, then cast by F.linear: one more pass over
        # V x H (about 50 us at BERT-Base on an H100) than casting first, and nothing for
        # torch.compile to refuse (torch 2.11 cannot trace torch.amp.is_autocast_available).
        return F.linear(x, F.pad(weight, (0, 0, 0, pad)), F.pad(bias, (0, pad), value=float("-inf")))


def padded_vocab_size(vocab_size: int) -> int:
    """The MLM decoder's GEMM width: ``vocab_size`` rounded up to a multiple of 8 (16 bytes of bf16)."""
    return -(-vocab_size // 8) * 8


def vocab_columns(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The ``vocab_size`` real columns of the decoder's padded logits (a view, no copy)."""
    return logits[:, :vocab_size]


@dataclass
class PreTrainingOutput:
    """Losses, logits and the counts a trainer needs for accuracies without another pass.

    ``mlm_logits`` are in packed row-major order, the order of
    ``logits[labels != IGNORE_INDEX]`` on a padded (B, S, V) tensor. The NSP fields are None
    for a model or batch without a sentence-pair task.
    """

    mlm_logits: torch.Tensor  # (M, V): masked positions, or every real token when no labels are given
    nsp_logits: torch.Tensor | None = None  # (B, 2)
    loss: torch.Tensor | None = None  # mlm_loss + nsp_loss (those that were computed)
    mlm_loss: torch.Tensor | None = None  # mean cross-entropy over masked tokens
    nsp_loss: torch.Tensor | None = None  # mean cross-entropy over sequences
    mlm_correct: torch.Tensor | None = None  # () int64: masked tokens predicted right
    mlm_count: torch.Tensor | None = None  # () int64: masked tokens
    nsp_correct: torch.Tensor | None = None  # () int64
    nsp_count: torch.Tensor | None = None  # () int64: sequences


def masked_lm(out: PreTrainingOutput, padded_logits: torch.Tensor, labels: torch.Tensor, backend: Backend) -> None:
    """Fill ``out``'s MLM loss, accuracy count and masked count from the decoder's padded logits
    (M, V') of the M masked rows and their labels (M,)."""
    masked = labels.shape[0]  # a host int: the layout's size, not a device value
    loss_sum, out.mlm_correct = mlm_cross_entropy(padded_logits, labels, backend=backend)
    out.mlm_loss = loss_sum / max(masked, 1)
    out.mlm_count = device_count(masked, labels.device)
    out.loss = out.mlm_loss


def device_count(n: int, device: torch.device) -> torch.Tensor:
    """() int64 on ``device``, filled there: ``torch.tensor(n, device=...)`` would copy it from
    host memory and then wait for everything queued on the device to finish."""
    return torch.full((), n, dtype=torch.int64, device=device)
