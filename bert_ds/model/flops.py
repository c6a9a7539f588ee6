"""FLOPs accounting shared by every throughput and MFU figure bert-ds prints.

Per real (non-pad) token, forward, for L layers, hidden H, vocabulary V:
- encoder matmuls: ``24 L H^2`` (QKV 6H^2, attention output 2H^2, FFN 16H^2 with FFN = 4H;
  in general ``L (8 H^2 + 4 H F)`` for FFN width F);
- attention scores and values: ``4 L S_eff H`` with S_eff the token's own sequence
  length (unpadded), so a batch contributes ``4 L H sum_i len_i^2``;
- the MLM head on masked tokens only: ``2 H^2 + 2 H V`` per masked token;
- training = 3 x forward. Embedding lookups, the pooler and NSP head are ignored.
"""

from __future__ import annotations

import re

from bert_ds.model.config import ModelConfig

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
# The anchor's GPU by its short name (bert_ds.tools.projection).
DATASHEET_BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0}


def training_flops(cfg: ModelConfig, tokens: int, sum_sq_lengths: int, masked_tokens: int) -> float:
    """FLOPs of one training pass over a batch.

    ``tokens`` real tokens, ``sum_sq_lengths`` the sum over sequences of length^2,
    ``masked_tokens`` MLM targets.
    """
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    matmuls = layers * (8 * h * h + 4 * h * f) * tokens
    attention = 4 * layers * h * sum_sq_lengths
    mlm = (2 * h * h + 2 * h * cfg.vocab_size) * masked_tokens
    return 3.0 * (matmuls + attention + mlm)


def datasheet_peak_tflops(device_name: str) -> float | None:
    """The datasheet bf16 dense peak for a CUDA device name ("NVIDIA H100 80GB HBM3"), or None
    if no pattern of :data:`DATASHEET_PEAKS` names it."""
    return next((peak for pattern, peak in DATASHEET_PEAKS if re.search(pattern, device_name)), None)
