"""What a measured MFU means for the run bert-ds exists to beat.

The anchor: BERT-Base (Hugging Face BERT under MosaicML Composer) pretrained on 32.8B
tokens in 10 h 38 min on 8x A100, to a final MLM cross-entropy of 1.59 and masked
accuracy of 0.67 (the Composer BERT-Base model card, mosaicml/composer
``docs/source/model_cards/BERT.md``; an older copy of that card said 35.2B tokens).
:func:`project` turns an MFU
(useful FLOP/s over a dense bf16 peak, by the accounting of :mod:`bert_ds.model.flops`) into
the time of that same run on the anchor's hardware, and :func:`anchor_mfu` puts the
anchor itself in the same units, so the two compare directly:

    tokens/s per GPU = MFU x peak / FLOPs per token
    time             = tokens / (GPUs x tokens/s per GPU)

Two assumptions, stated wherever a projection is printed:

- **The MFU carries over to an A100.** MFU measures how well the code keeps the
  tensor cores busy. An A100 has more memory bandwidth per FLOP than an H100/H200
  (2.0 TB/s for 312 TFLOP/s against 3.35-4.8 TB/s for 989), so the memory-bound part of
  a step weighs less there; carrying an MFU measured on Hopper to an A100 errs low.
- **Data parallelism scales perfectly over 8 GPUs.** BERT-Base's gradients are
  ~0.22 GB in bf16; their all-reduce over NVLink (~600 GB/s) takes about a millisecond
  per step and overlaps the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from bert_ds.model.flops import DATASHEET_BF16_TFLOPS


@dataclass(frozen=True)
class Anchor:
    tokens: float
    gpus: int
    gpu: str
    seconds: float
    source: str
    mlm_loss: float  # the quality the run reached: a faster run must reach it too to count
    mlm_accuracy: float

    @property
    def peak_flops(self) -> float:
        """Dense bf16 FLOP/s of one of the anchor's GPUs (datasheet)."""
        return DATASHEET_BF16_TFLOPS[self.gpu] * 1e12

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.seconds / self.gpus


ANCHOR = Anchor(tokens=32.8e9, gpus=8, gpu="A100", seconds=10 * 3600 + 38 * 60,
                source="HF BERT-Base under MosaicML Composer, 32.8B tokens on 8x A100 to MLM loss 1.59, "
                       "masked accuracy 0.67 (Composer BERT-Base model card)",
                mlm_loss=1.59, mlm_accuracy=0.67)


def anchor_mfu(flops_per_token: float, anchor: Anchor = ANCHOR) -> float:
    """The anchor's own MFU under the same accounting (its tokens/s x FLOPs per token / peak)."""
    return anchor.tokens_per_s_per_gpu * flops_per_token / anchor.peak_flops


def project(mfu: float, flops_per_token: float, anchor: Anchor = ANCHOR) -> dict[str, float]:
    """The anchor's run at ``mfu``: tokens/s per GPU, seconds, and the speed-up over the anchor."""
    if mfu <= 0 or flops_per_token <= 0:
        raise ValueError(f"mfu and flops_per_token must be > 0, got {mfu} and {flops_per_token}")
    per_gpu = mfu * anchor.peak_flops / flops_per_token
    seconds = anchor.tokens / (anchor.gpus * per_gpu)
    return {"mfu": mfu, "tokens_per_s_per_gpu": per_gpu, "seconds": seconds, "speedup": anchor.seconds / seconds}


def hours_minutes(seconds: float) -> str:
    """e.g. 38280 -> "10 h 38 min"."""
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"
