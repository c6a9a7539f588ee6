"""FLOPs accounting shared by every throughput and MFU figure bert-ds prints.

Per real (non-pad) token, forward, for L layers, hidden H, vocabulary V:
- encoder matmuls: ``L (8 H^2 + m H F)`` for FFN width F: QKV 6H^2 and the attention output
  2H^2, then BERT's FFN ``4 H F`` (= 16H^2 at F = 4H: ``24 L H^2`` in all) or a GeGLU's ``6 H F``
  (its input projection makes 2F: input and gate);
- attention scores and values: ``4 H`` per (query, key) pair a layer computes: ``4 L H sum_i
  len_i^2`` for global layers over unpadded sequences; a local layer of window +-w computes
  only the pairs within its window, ``len (2w + 1) - w (w + 1)`` per sequence longer than
  ``w + 1`` (:func:`bert_ds.kernels.local_attention.local_pairs`), and these are counted as done;
- the MLM head on masked tokens only: ``2 H^2 + 2 H V`` per masked token;
- training = 3 x forward. Embedding lookups, the pooler and NSP head are ignored.
"""

from __future__ import annotations

import re

from bert_ds.model.families import AnyModelConfig, family_of

# Dense bf16 peak of the device's datasheet, TFLOP/s, for MFU against a public figure, by the
# name CUDA reports, most specific first: the H100 and H200 come as SXM boards (989), as PCIe
# cards (H100 PCIe: 756) and as NVL cards (835), whose names differ only in a suffix. A device
# no pattern names gets no datasheet MFU (its MFU against a measured matmul still prints).
DATASHEET_PEAKS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 756.0),
    (r"H[12]00 NVL", 835.0),
    (r"GH200", 989.0),
    (r"H100", 989.0),
    (r"H200", 989.0),
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"\bL4\b", 121.0),
)
# The MFU bert-ds aims at on a GPU (against the datasheet bf16 peak): the training bench's goal for
# BERT-Base at seq 128 (bert_ds.tools.bench), and what one GPU's data demand is sized at
# (bert_ds.loader.bench).
GOAL_MFU = 0.50
# The anchor's GPU by its short name (bert_ds.tools.projection).
DATASHEET_BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0}


def training_flops(cfg: AnyModelConfig, tokens: int, sum_sq_lengths: int, masked_tokens: int,
                   local_pairs: int = 0) -> float:
    """FLOPs of one training pass over a batch.

    ``tokens`` real tokens, ``sum_sq_lengths`` the sum over sequences of length^2 (the global
    layers' pairs), ``masked_tokens`` MLM targets, ``local_pairs`` the local layers' pairs
    (:func:`bert_ds.kernels.local_attention.local_pairs` summed over the sequences; 0 for a model
    without local layers).
    """
    family = family_of(cfg)
    h, layers, global_layers = cfg.hidden_size, cfg.num_layers, family.global_layers(cfg)
    matmuls = layers * (8 * h * h + family.ffn_flops(cfg)) * tokens
    attention = 4 * h * (global_layers * sum_sq_lengths + (layers - global_layers) * local_pairs)
    mlm = (2 * h * h + 2 * h * cfg.vocab_size) * masked_tokens
    return 3.0 * (matmuls + attention + mlm)


def datasheet_peak_tflops(device_name: str) -> float | None:
    """The datasheet bf16 dense peak for a CUDA device name ("NVIDIA H100 80GB HBM3"), or None
    if no pattern of :data:`DATASHEET_PEAKS` names it."""
    return next((peak for pattern, peak in DATASHEET_PEAKS if re.search(pattern, device_name)), None)
