"""The MLM loss in one op: the summed cross-entropy of the decoder's logits and the count of
rows whose argmax is the label.

The model's MLM decoder gives (M, V') logits for the M masked tokens, V' = the vocabulary padded
to a multiple of 8 with -inf columns (``bert_ds.model.bert.MlmDecoder``). Run as PyTorch ops
under bf16, the loss makes an fp32 copy of them, an fp32 log-softmax and its backward, and a
cast of the gradient back to bf16 (about 6 ms of a 176 ms BERT-Base step on an H100, issue
#31); the accuracy's argmax reads the logits once more.

Design choices, and why:

- **The logits are read once a pass, in their own dtype, with fp32 math**
  (``kernels/csrc/cross_entropy.cu``). The forward keeps an online max and sum of exp per row
  and finds the argmax on the way; it writes per row the loss, the log-sum-exp and whether the
  argmax is the label, and saves nothing else but the logits it was given. The backward reads
  the logits again and writes ``(softmax - onehot(label)) * dloss`` in their dtype. The op is
  memory-bound, and this is the fewest bytes it can move: 6 per bf16 logit, where PyTorch's
  fp32 path moves at least 36 and holds two fp32 copies of the logits for the backward.
- **It returns the sum, not the mean**: ``(loss, correct)``, the loss summed over the rows whose
  label is not :data:`IGNORE_INDEX`, and the count (int64) of those rows whose first maximal
  logit is the label. The model divides by its masked count, a host integer, so no division
  waits for the device and a batch with nothing masked gives 0.
- **Ties go to the first column**, as ``torch.argmax`` does (its documentation: "the indices of
  the first maximal value"), so the count equals ``(logits.argmax(-1) == labels).sum()``. NaN
  logits aside: torch's argmax picks a NaN, the kernel skips it; the loss is NaN either way.
- **-inf columns** (the decoder's padding) are part of the definition: they add nothing to the
  softmax, never win the argmax, and get a gradient of exactly 0.
- **Ignored rows** (label :data:`IGNORE_INDEX`, PyTorch's and Hugging Face's -100) add 0 to the
  loss, are never counted, get a zero gradient, and the kernel does not read them. A label
  outside [0, V') otherwise makes the fused loss NaN where PyTorch raises.

Implementations (one signature: ``(logits (M, V'), labels (M,) int64) -> (loss () fp32, correct () int64)``):

- :func:`mlm_cross_entropy_ref`: the definition in plain PyTorch, fp32: log-sum-exp minus the
  label's logit, masked sum; argmax equal to the label.
- :func:`mlm_cross_entropy_native` (``kernels=torch``): what the model ran before this op,
  ``F.cross_entropy`` on an fp32 copy and ``argmax``, bit for bit.
- :func:`mlm_cross_entropy_fused`: the kernels, through :class:`FusedMlmCrossEntropy`; float32,
  float16 and bfloat16 logits, any width (16-byte vectors where it is a multiple of 16 bytes).
- :data:`mlm_cross_entropy_compiled`: the reference under ``torch.compile``, a candidate of
  ``kernels=auto``, which races the three on the device at the model's shapes.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bert_ds.kernels.compiled import CompiledReference
from bert_ds.kernels.dispatch import Backend, Impl, choose, fused_extension

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
IGNORE_INDEX = -100  # a label with no loss: PyTorch's default, and the model's (bert_ds.model.padding)

LossAndCount = tuple[torch.Tensor, torch.Tensor]


def mlm_cross_entropy_ref(logits: torch.Tensor, labels: torch.Tensor) -> LossAndCount:
    """logits: (M, V) of any float dtype, -inf allowed; labels: (M,) int64, :data:`IGNORE_INDEX`
    where a row has no loss. Returns the summed loss (() fp32) and the right predictions (() int64)."""
    x = logits.float()
    scored = labels != IGNORE_INDEX
    target = torch.where(scored, labels, 0)
    log_likelihood = x.gather(1, target[:, None]).squeeze(1) - torch.logsumexp(x, dim=1)
    loss = -torch.where(scored, log_likelihood, 0.0).sum()
    correct = (scored & (x.argmax(dim=1) == labels)).sum()
    return loss, correct


def mlm_cross_entropy_native(logits: torch.Tensor, labels: torch.Tensor) -> LossAndCount:
    """:func:`mlm_cross_entropy_ref` as the model computed it before this op: PyTorch's
    cross-entropy on an fp32 copy of the logits, and their argmax."""
    loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = (logits.detach().argmax(dim=-1) == labels).sum()  # an ignored label (-100) is never an argmax
    return loss, correct


def mlm_cross_entropy_fused(logits: torch.Tensor, labels: torch.Tensor) -> LossAndCount:
    """:func:`mlm_cross_entropy_ref` on the fused kernels."""
    return FusedMlmCrossEntropy.apply(logits, labels)


mlm_cross_entropy_compiled = CompiledReference(mlm_cross_entropy_ref, rows=(0, 1))  # M, the masked count, varies

IMPLEMENTATIONS: dict[Impl, Callable[..., LossAndCount]] = {
    "native": mlm_cross_entropy_native, "fused": mlm_cross_entropy_fused, "compiled": mlm_cross_entropy_compiled}


def mlm_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, backend: Backend) -> LossAndCount:
    """:func:`mlm_cross_entropy_ref` on the resolved ``backend``."""
    impl = choose("mlm_cross_entropy", backend, lambda name: _unsupported(name, logits, labels))
    return IMPLEMENTATIONS[impl](logits, labels)


def _unsupported(impl: Impl, logits, labels) -> str:
    """Why candidate ``impl`` ("fused" or "compiled") cannot take these inputs ("" if it can)."""
    if impl == "compiled":  # the reference, which takes any input; raced on a CUDA device
        return "" if logits.is_cuda and labels.is_cuda else "its inputs are not all on a CUDA device"
    if logits.dtype not in FUSED_DTYPES:
        return f"{logits.dtype} logits (it takes {', '.join(map(str, FUSED_DTYPES))})"
    if logits.dim() != 2 or labels.dim() != 1 or labels.dtype != torch.int64:
        return (f"logits of shape {tuple(logits.shape)} and {labels.dtype} labels of shape {tuple(labels.shape)} "
                "(it takes (M, V) logits and (M,) int64 labels)")
    if not (logits.is_cuda and labels.is_cuda):
        return "its inputs are not all on a CUDA device"
    return ""


class FusedMlmCrossEntropy(torch.autograd.Function):
    """The summed loss and the count on the fused kernels; the same arguments as :func:`mlm_cross_entropy_ref`."""

    @staticmethod
    def forward(ctx, logits, labels):
        loss, lse, correct = fused_extension().mlm_cross_entropy_fwd(logits, labels, IGNORE_INDEX)
        ctx.save_for_backward(logits, labels, lse)
        count = correct.sum()
        ctx.mark_non_differentiable(count)
        return loss.sum(), count

    @staticmethod
    def backward(ctx, dloss, dcount):
        logits, labels, lse = ctx.saved_tensors
        return fused_extension().mlm_cross_entropy_bwd(dloss, logits, labels, lse, IGNORE_INDEX), None
