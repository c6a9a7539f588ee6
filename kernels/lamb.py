"""LAMB's elementwise update of one flat fp32 tensor cut into chunks, around its trust ratio.

The optimizer (:mod:`bert_ds.optim.lamb`) steps DeepSpeed ZeRO's flat partitions: one tensor
per param group holding fragments of many parameters, each needing its own trust ratio. It
cuts the tensor into :class:`Chunks` that each lie inside one fragment, and this op does the
rest, given a callback that maps per-chunk squared norms to per-chunk multipliers (the
optimizer sums them into parameters, all-reduces, and takes lr * ||w|| / ||u||):

    m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2                    (in place)
    u = step_size * m / (sqrt(v) + eps_hat) + weight_decay * w
    squares[c] = (sum of w^2, sum of u^2) over chunk c;  scale = scales(squares)
    w = w - scale[c] * u                                                        (in place)

with the bias corrections folded into ``step_size`` and ``eps_hat`` (:meth:`LambScalars.at_step`).
A float instead of a callback is one multiplier for every element, with no norms (LAMB's
plain-Adam groups). ``skip``: a one-element float32 tensor on the tensor's device, or None;
where it is non-zero nothing changes (w, m and v stay bitwise as they were, whatever the
gradient holds), and the fast paths never read it to the host: a training step skips a
non-finite step that way without waiting for the device (:mod:`bert_ds.optim.device_skip`).
The callback is called either way, so that every rank makes the same collectives.

Implementations:

- :func:`lamb_update_ref`: the definition, the formulas above in plain PyTorch, norms in fp64.
- :func:`lamb_update_native`: PyTorch ops on the flat tensor (the optimizer's path on a CPU
  and wherever the fused kernel does not run; the golden run pins its exact results).
- :func:`lamb_update_fused`: ``kernels/csrc/lamb.cu``, two passes (6 + 4 over the tensor,
  where the native path makes about 31), fp32 CUDA tensors only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bert_ds.kernels.dispatch import Backend, Impl, choose, fused_extension

CHUNK = 1024  # elements per chunk at most: a fp32 sum of 1,024 squares is exact to ~1e-7, and one CUDA block's work

ChunkScales = Callable[[torch.Tensor], torch.Tensor]  # (K, 2) fp32 squares -> (K,) fp32 multipliers


@dataclass(frozen=True)
class Chunks:
    """A flat tensor of ``numel`` elements cut into K chunks: chunk c is elements
    ``[offsets[c], offsets[c] + lengths[c])``; the chunks tile the tensor in order."""

    offsets: torch.Tensor  # (K,) int64, on the tensor's device
    lengths: torch.Tensor  # (K,) int64, each in [1, CHUNK]
    numel: int

    @classmethod
    def tile(cls, piece_lengths: Sequence[int], device: torch.device | str = "cpu") -> tuple[Chunks, torch.Tensor]:
        """Pieces of these lengths, back to back, each cut into chunks of at most :data:`CHUNK`.

        Returns the chunks and, per chunk, the index of its piece ((K,) int64 on ``device``).
        """
        lengths = torch.tensor(list(piece_lengths), dtype=torch.int64)
        if lengths.numel() == 0 or bool((lengths <= 0).any()):
            raise ValueError(f"pieces must be a non-empty list of positive lengths, got {list(piece_lengths)}")
        per_piece = (lengths + CHUNK - 1) // CHUNK
        piece_of_chunk = torch.repeat_interleave(torch.arange(lengths.numel()), per_piece)
        chunk_lengths = torch.full((int(per_piece.sum()),), CHUNK, dtype=torch.int64)
        chunk_lengths[torch.cumsum(per_piece, 0) - 1] = lengths - CHUNK * (per_piece - 1)
        offsets = torch.cumsum(chunk_lengths, 0) - chunk_lengths
        chunks = cls(offsets.to(device), chunk_lengths.to(device), int(lengths.sum()))
        return chunks, piece_of_chunk.to(device)

    def expand(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """(K,) -> (numel,): each element gets its chunk's value."""
        return torch.repeat_interleave(per_chunk, self.lengths, output_size=self.numel)

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """(numel,) -> (K,): the sum over each chunk, in x's dtype."""
        # unsafe: the lengths tile the tensor by construction (tile()); the safe form reads them
        # back to check, a host sync per call on a GPU.
        return torch.segment_reduce(x, "sum", lengths=self.lengths, unsafe=True)


@dataclass(frozen=True)
class LambScalars:
    """The step's scalars: betas, and the bias corrections of step t folded into two numbers."""

    beta1: float
    beta2: float
    step_size: float  # sqrt(1 - b2^t) / (1 - b1^t)
    eps_hat: float  # eps * sqrt(1 - b2^t)
    weight_decay: float

    @classmethod
    def at_step(cls, betas: tuple[float, float], eps: float, weight_decay: float, step: int) -> LambScalars:
        """(m / c1) / (sqrt(v / c2) + eps) = m (sqrt(c2) / c1) / (sqrt(v) + eps sqrt(c2)), c the
        bias corrections of ``step`` (1-based): the corrections ride on two scalars instead of
        two more passes over the moments."""
        beta1, beta2 = betas
        sqrt_c2 = math.sqrt(1 - beta2 ** step)
        return cls(beta1, beta2, sqrt_c2 / (1 - beta1 ** step), eps * sqrt_c2, weight_decay)


@dataclass(frozen=True)
class SkipFactors:
    """The moments' and the update's factors under a device skip flag, for the PyTorch-op paths:
    without a flag (or with it clear) the floats of the plain step, so the figures are bitwise
    the same; with it set, factors that keep m, v and w as they are, once the gradient is zeroed
    (:meth:`grad`; a multiply would keep its NaNs). Made on the device: nothing is read."""

    skipped: torch.Tensor | None  # 0-d bool, or None without a flag
    beta1_weight: float | torch.Tensor  # m = lerp(m, g, beta1_weight)
    beta2_keep: float | torch.Tensor  # v = beta2_keep v + (1 - b2) g^2
    apply: float | torch.Tensor  # the update's multiplier times this

    @classmethod
    def of(cls, skip: torch.Tensor | None, beta1: float, beta2: float) -> SkipFactors:
        if skip is None:
            return cls(None, 1 - beta1, beta2, 1.0)
        skipped = skip.reshape(()) != 0
        return cls(skipped, torch.where(skipped, 0.0, 1 - beta1), torch.where(skipped, 1.0, beta2),
                   torch.where(skipped, 0.0, 1.0))

    def grad(self, g: torch.Tensor) -> torch.Tensor:
        return g if self.skipped is None else torch.where(self.skipped, 0.0, g)


FUSED_DTYPES = (torch.float32,)


def _direction(param, exp_avg, exp_avg_sq, s: LambScalars) -> torch.Tensor:
    return s.step_size * exp_avg / (exp_avg_sq.sqrt() + s.eps_hat) + s.weight_decay * param


@torch.no_grad()
def lamb_update_ref(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    chunks: Chunks, s: LambScalars, scales: ChunkScales | float, skip: torch.Tensor | None = None) -> None:
    """The definition (module docstring), in place on 1-D tensors of ``chunks.numel`` elements.
    The definition reads ``skip`` on the host."""
    if skip is not None and bool(skip.reshape(()) != 0):
        if callable(scales):
            scales(torch.zeros(chunks.lengths.numel(), 2, dtype=torch.float32, device=param.device))
        return
    exp_avg.mul_(s.beta1).add_(grad, alpha=1 - s.beta1)
    exp_avg_sq.mul_(s.beta2).add_(grad * grad, alpha=1 - s.beta2)
    update = _direction(param, exp_avg, exp_avg_sq, s)
    if callable(scales):
        chunk_of = chunks.expand(torch.arange(chunks.lengths.numel(), device=param.device))
        squares = torch.stack([param.double() ** 2, update.double() ** 2], dim=1)  # (numel, 2)
        per_chunk = torch.zeros(chunks.lengths.numel(), 2, dtype=torch.float64, device=param.device)
        scale = chunks.expand(scales(per_chunk.index_add_(0, chunk_of, squares).float()))
    else:
        scale = scales
    param.sub_(scale * update)


@torch.no_grad()
def lamb_update_native(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       chunks: Chunks, s: LambScalars, scales: ChunkScales | float,
                       skip: torch.Tensor | None = None) -> None:
    """:func:`lamb_update_ref` in PyTorch ops that spare passes: lerp for the first moment,
    fused multiply-adds, chunk sums by segment reduction, norms in fp32 per chunk.

    With ``skip``, on the device: the gradient zeroed where it is set (one more pass; a multiply
    would keep its NaNs), and the moments' blend weights and the update's multiplier zeroed with
    it, so m, v and w stay as they were; where it is clear, the figures are bitwise those
    without it (the same float weights, as tensors)."""
    f = SkipFactors.of(skip, s.beta1, s.beta2)
    grad, beta1_weight, beta2_keep, apply = f.grad(grad), f.beta1_weight, f.beta2_keep, f.apply
    exp_avg.lerp_(grad, beta1_weight)  # m + (1 - b1)(g - m): one pass instead of two
    exp_avg_sq.mul_(beta2_keep).addcmul_(grad, grad, value=1 - s.beta2)
    denom = exp_avg_sq.sqrt().add_(s.eps_hat)
    if s.weight_decay != 0:
        update = param.mul(s.weight_decay).addcdiv_(exp_avg, denom, value=s.step_size)
    else:
        update = exp_avg.div(denom).mul_(s.step_size)
    if callable(scales):
        squares = torch.stack([chunks.sums(param.square()), chunks.sums(update.square())], dim=1)  # (K, 2)
        update.mul_(chunks.expand(scales(squares) * apply))
    else:
        update.mul_(scales * apply)
    param.sub_(update)


@torch.no_grad()
def lamb_update_fused(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      chunks: Chunks, s: LambScalars, scales: ChunkScales | float,
                      skip: torch.Tensor | None = None) -> None:
    """:func:`lamb_update_ref` on the fused kernels: two launches and the callback between them;
    both kernels read ``skip`` themselves."""
    extension = fused_extension()
    scalars = (s.beta1, s.beta2, s.step_size, s.eps_hat, s.weight_decay)
    adapt = callable(scales)
    squares = extension.lamb_moments(grad, exp_avg, exp_avg_sq, param, chunks.offsets, chunks.lengths, *scalars,
                                     adapt, skip)
    per_chunk = scales(squares).float() if adapt else None
    extension.lamb_apply(param, exp_avg, exp_avg_sq, chunks.offsets, chunks.lengths, per_chunk,
                         0.0 if adapt else float(scales), *scalars, skip)


IMPLEMENTATIONS: dict[Impl, Callable[..., None]] = {"native": lamb_update_native, "fused": lamb_update_fused}


def lamb_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                chunks: Chunks, s: LambScalars, scales: ChunkScales | float, *, backend: Backend,
                skip: torch.Tensor | None = None) -> None:
    """:func:`lamb_update_ref` on the resolved ``backend``."""
    impl = choose("lamb_update", backend, lambda name: _unsupported(param, grad, exp_avg, exp_avg_sq))
    IMPLEMENTATIONS[impl](param, grad, exp_avg, exp_avg_sq, chunks, s, scales, skip)


def _unsupported(*tensors: torch.Tensor) -> str:
    """Why the fused kernel cannot take these tensors ("" if it can)."""
    if any(t.dtype not in FUSED_DTYPES for t in tensors):
        return f"{', '.join(sorted({str(t.dtype) for t in tensors}))} state (it takes torch.float32)"
    if not all(t.is_cuda for t in tensors):
        return "its inputs are not all on a CUDA device"
    if not all(t.dim() == 1 and t.is_contiguous() for t in tensors):
        return "its tensors are not all flat and contiguous"
    return ""
