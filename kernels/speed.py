"""Which implementation of each op ``kernels=auto`` runs on a device: the fastest correct one.

Candidates per op (:data:`IMPLEMENTATIONS`, native first):

- ``native``: the PyTorch-native op (``<op>_native``), always;
- ``fused``: our fused kernel, where the extension loads and the op passed its self-check;
- ``compiled`` (LayerNorm, dropout + LayerNorm, bias + GELU, GeGLU, attention, the MLM loss): the op's
  reference under ``torch.compile`` (``kernels/compiled.py``); not LAMB's update, whose callback
  between its passes and in-place updates would split the compiled graph;
- ``apex`` (LayerNorm only): apex's fused LayerNorm, where apex is installed and it passes
  the same self-check;
- attention only: ``varlen_attn`` (torch's varlen FlashAttention-2 where this torch has it and
  it takes the inputs), ``sdpa_flash`` (on a nested batch), ``sdpa_efficient`` and
  ``sdpa_cudnn`` (on a padded batch), with the padding and its removal inside what is timed
  (``kernels/attention.py``).

Every candidate but the native op is first held to the self-check's rule at the race's own
inputs (:func:`bert_ds.kernels.selfcheck.compare`: output and every gradient against the
reference); one that is wrong there, or raises (a backend that refuses the shapes, a
``torch.compile`` that fails), is excluded with the reason (``dropout_add_layer_norm`` is checked
with dropout off: each candidate draws its mask from its own generator, and the self-check holds
the fused kernel's mask to the reference; the MLM loss's count of right predictions must equal
the reference's). Each correct candidate is then timed forward + backward on seeded inputs at
the model's shapes, its dropout and the training's sequence length (:class:`OpShapes`), on as
many tokens as a training micro-batch holds (32,768 by
default, a BERT-Base micro-batch of 256 x 128), so that launch costs do not decide (attention as
the model runs it: on one (T, 3, nh, hd) Q/K/V projection, which the fused kernel reads in place
and the others take as three views, ``attention.packed_form``, their copies timed; in a rotary
model, :attr:`OpShapes.rotary`, the fused kernel rotates q and k as it loads them and the others
are timed with the rotation in PyTorch they run after, ``rotary_attention.rotary_form``). Each is
timed as runs of back-to-back calls by two clocks (:func:`best_seconds_per_call`): the host's
wall clock around the run, which counts what the training step pays (Python, autograd and
launch costs as well as the device's work; on a GPU it starts after a synchronisation and
stops after the run's end is synchronised), and beside it the device's own time (CUDA events
around the same run; on a CPU the wall time). The verdict follows the wall time: an op cheap
on the device but costly to launch (torch's ``varlen_attn`` spends about 460 us of host time
per call, our fused attention about 130, on an H100) must not win a race and lose the step.
:class:`Choice` keeps both figures and says by how much the winner's wall time beat the
runner-up's. A tie goes to ``native``: another candidate is used only when it is faster than
every other, so ``kernels=auto`` is never slower than the native path.

The race runs once per device and shapes, and is recorded beside the self-check verdicts
under its shapes (``kernels/choice.py``): a tiny model's verdict never decides for a
BERT-Base, nor phase 1's (seq 128) for phase 2 (seq 512). It takes some tens of milliseconds
per candidate, plus the compile of each ``compiled`` candidate the first time a process
races (not measured on a GPU), and happens when the model is built, before any training
step, so no run's figures include it. The device and the clock are parameters, so that the
choice is tested on a CPU with stand-ins.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from bert_ds.kernels import attention, lamb, probes, rotary_attention, selfcheck
from bert_ds.kernels.bias_gelu import IMPLEMENTATIONS as BIAS_GELU
from bert_ds.kernels.bias_gelu import bias_gelu_ref
from bert_ds.kernels.cross_entropy import IMPLEMENTATIONS as MLM_CROSS_ENTROPY
from bert_ds.kernels.cross_entropy import mlm_cross_entropy_ref
from bert_ds.kernels.dispatch import OPS
from bert_ds.kernels.local_attention import IMPLEMENTATIONS as LOCAL_ATTENTION
from bert_ds.kernels.local_attention import local_attention_ref
from bert_ds.kernels.dropout_layer_norm import IMPLEMENTATIONS as DROPOUT_ADD_LAYER_NORM
from bert_ds.kernels.dropout_layer_norm import dropout_add_layer_norm_ref
from bert_ds.kernels.geglu import IMPLEMENTATIONS as GEGLU
from bert_ds.kernels.geglu import geglu_ref
from bert_ds.kernels.layer_norm import IMPLEMENTATIONS as LAYER_NORM
from bert_ds.kernels.layer_norm import layer_norm_ref

# Per op, its implementations by name (dispatch.Impl), native first, all with its reference's signature.
IMPLEMENTATIONS = {"layer_norm": LAYER_NORM, "dropout_add_layer_norm": DROPOUT_ADD_LAYER_NORM, "bias_gelu": BIAS_GELU,
                   "varlen_attention": attention.IMPLEMENTATIONS, "mlm_cross_entropy": MLM_CROSS_ENTROPY,
                   "lamb_update": lamb.IMPLEMENTATIONS, "local_attention": LOCAL_ATTENTION, "geglu": GEGLU}
LAYER_NORM_EPS = 1e-12  # BERT's
CALLS_PER_SAMPLE = 10  # calls per timed sample, so that one sample is well above the clock's resolution
SAMPLES = 5
RACE_TOKENS = 32768  # a BERT-Base micro-batch of the recipe (256 x 128)
MASKED_SHARE = 0.15  # BERT's masking rate (DataConfig.mask_rate): the MLM decoder's rows per token


class Timing(NamedTuple):
    """Seconds per call of one candidate, by the two clocks of the race."""

    wall: float  # the host's clock around back-to-back calls: what the step pays, launch costs included
    device: float  # the device's own time for the same calls (CUDA events); on a CPU the wall time


Timer = Callable[[Callable[[], Any], torch.device], Timing]  # (run once, device) -> its timing per run
# What the race times, by version; a record of another version is raced again (kernels/choice.py).
# 4: the local attention on one Q/K/V projection too, and a rotary model's attention with the
# rotation each candidate runs with (3: the local one on q and k apart, none rotated);
# 3: the verdict by the host's wall time, the device's time beside it (2: by CUDA events alone);
# 2: attention on one Q/K/V projection, as the model runs it (1: on three separate tensors).
RACE_VERSION = 4


@dataclass(frozen=True)
class OpShapes:
    """The shapes and dtype the race times each op at: the model's (a BERT-Base by default)."""

    hidden: int = 768
    intermediate: int = 3072
    num_heads: int = 12
    max_seqlen: int = 128  # the training's sequence length (phase 1 of BERT's recipe by default)
    approximate: str = "none"  # the model's GELU: "none" (erf) or "tanh"
    dtype: str = "bfloat16"  # the training dtype of the bf16 DeepSpeed configs
    tokens: int = RACE_TOKENS  # at least this many tokens per call, as a training micro-batch
    hidden_dropout: float = 0.1  # the model's (BERT's): dropout_add_layer_norm is timed with the training's mask
    vocab: int = 30522  # the model's vocabulary: mlm_cross_entropy is timed at its decoder's padded width
    window: int = 0  # the local layers' window, tokens on each side; 0: the model has none (local_attention not raced)
    geglu: bool = False  # the MLP is GeGLU on a (T, 2 x intermediate) projection (ModernBERT); False: geglu not raced
    # the model's LayerNorms: BERT's post-LN, with a bias and the residual added in; False: ModernBERT's
    # pre-LN, neither bias nor residual (layer_norm is timed as the model calls it)
    layer_norm_bias: bool = True
    # q and k are rotated (RoPE: ModernBERT): each attention candidate is timed with the rotation it
    # runs with (rotary_attention.rotary_form); False: BERT's, none
    rotary: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "num_heads", "max_seqlen", "tokens", "vocab"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"OpShapes.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"OpShapes.window must be an integer >= 0, got {self.window!r}")
        for name in ("geglu", "layer_norm_bias", "rotary"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"OpShapes.{name} must be True or False, got {getattr(self, name)!r}")
        if self.hidden % self.num_heads:
            raise ValueError(f"OpShapes.num_heads ({self.num_heads}) must divide hidden ({self.hidden})")
        if self.approximate not in ("none", "tanh") or not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"OpShapes: approximate must be 'none' or 'tanh' and dtype a torch dtype name, "
                             f"got {self.approximate!r}, {self.dtype!r}")
        if not isinstance(self.hidden_dropout, (int, float)) or not 0.0 <= self.hidden_dropout < 1.0:
            raise ValueError(f"OpShapes.hidden_dropout must be in [0, 1), got {self.hidden_dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def has(self, op: str) -> bool:
        """Whether a model of these shapes runs ``op``, and so races it: the local attention only with
        local layers (a window), GeGLU only in a GeGLU MLP; BERT has neither."""
        if op == "local_attention":
            return self.window > 0
        if op == "geglu":
            return self.geglu
        return True

    @property
    def masked_rows(self) -> int:
        """The MLM loss's rows: the masked share of :attr:`tokens`."""
        return max(1, int(self.tokens * MASKED_SHARE))

    @property
    def decoder_width(self) -> int:
        """The MLM logits' width: :attr:`vocab` padded to a multiple of 8 (16 bytes of bf16), -inf
        past the vocabulary, as the model's decoder pads it (``bert_ds.model.bert.padded_vocab_size``)."""
        return -(-self.vocab // 8) * 8

    def lengths(self) -> list[int]:
        """The pretraining loader's shape: nine sequences in ten full length, the tenth half as
        long, until :attr:`tokens` are reached."""
        lengths: list[int] = []
        while sum(lengths) < self.tokens:
            lengths.append(self.max_seqlen if len(lengths) % 10 != 9 else max(1, self.max_seqlen // 2))
        return lengths

    @property
    def key(self) -> str:
        """Names these shapes in the record: a verdict holds for the shapes it was raced at."""
        return (f"{self.dtype} hidden {self.hidden} ffn {self.intermediate} heads {self.num_heads} "
                f"seq {self.max_seqlen} tokens {self.tokens} gelu {self.approximate} dropout {self.hidden_dropout:g} "
                f"vocab {self.vocab}" + (f" window {self.window}" if self.window else "")
                + (" geglu" if self.geglu else "") + ("" if self.layer_norm_bias else " layernorm plain")
                + (" rotary" if self.rotary else ""))

    def describe(self) -> str:
        lengths = self.lengths()
        return (f"{self.dtype}, {sum(lengths)} tokens in {len(lengths)} sequences of <= {self.max_seqlen}, "
                f"hidden {self.hidden}, intermediate {self.intermediate}, {self.num_heads} heads of {self.head_dim}, "
                f"{self.masked_rows} masked rows of {self.decoder_width} logits")


@dataclass
class Choice:
    """The race's verdict for one op: the candidate fastest by the host's wall clock."""

    runs: str  # the winner, one of the op's IMPLEMENTATIONS
    # Per timed candidate, ms per call (forward + backward; for LAMB's update one step): by the
    # host's wall clock, which decides, and by the device's own (on a CPU the same)
    wall_ms: dict[str, float]
    device_ms: dict[str, float]
    excluded: dict[str, str]  # per candidate not timed (not one here, wrong, or raised), why

    @property
    def runner_up(self) -> str | None:
        """The fastest of the others timed, by wall time (None when the winner ran alone)."""
        others = {name: ms for name, ms in self.wall_ms.items() if name != self.runs}
        return min(others, key=others.__getitem__) if others else None

    @property
    def margin(self) -> float | None:
        """How many times less wall time the winner took than the runner-up (1.0: a tie, which native wins)."""
        if self.runner_up is None:
            return None
        return self.wall_ms[self.runner_up] / self.wall_ms[self.runs] if self.wall_ms[self.runs] > 0 else math.inf

    def describe(self) -> str:
        if self.runner_up is None:
            lead = "the only candidate timed"
        elif self.margin > 1.0:
            lead = f"{self.margin:.2f}x faster than {self.runner_up}"
        else:
            lead = f"as fast as {self.runner_up}"
        timed = ", ".join(f"{name} {ms:.3f} ms ({self.device_ms[name]:.3f})" for name, ms in self.wall_ms.items())
        left_out = "".join(f"; {name} not a candidate: {why}" for name, why in self.excluded.items())
        return f"runs {self.runs} ({lead}; wall (device) per call: {timed}){left_out}"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "runner_up": self.runner_up, "margin": self.margin}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Choice:
        return cls(str(data["runs"]), {k: float(v) for k, v in data["wall_ms"].items()},
                   {k: float(v) for k, v in data["device_ms"].items()}, {k: str(v) for k, v in data["excluded"].items()})


def best_seconds_per_call(run: Callable[[], Any], device: torch.device) -> Timing:
    """The default clock: after one untimed call, a few samples of several back-to-back calls,
    each timed by the host's wall clock and by the device's; the best sample of each, per call.

    The wall clock counts what the training step pays for the calls: Python, autograd and the
    launches as well as the device's work. On a GPU it starts once the device is idle (nothing
    queued before counts) and stops once the end of the run is synchronised (the device's work
    that the launches left queued counts); CUDA events around the same calls give the device's
    time. Elsewhere the device's time is the wall time.
    """
    run()
    wall = device_s = math.inf
    for _ in range(SAMPLES):
        sample = _sample(run, device)
        wall, device_s = min(wall, sample.wall), min(device_s, sample.device)
    return Timing(wall / CALLS_PER_SAMPLE, device_s / CALLS_PER_SAMPLE)


def _sample(run: Callable[[], Any], device: torch.device) -> Timing:
    """Seconds of :data:`CALLS_PER_SAMPLE` back-to-back calls, by both clocks."""
    probes.synchronize(device)
    if device.type != "cuda":
        began = time.perf_counter()
        for _ in range(CALLS_PER_SAMPLE):
            run()
        wall = time.perf_counter() - began
        return Timing(wall, wall)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    start.record()
    for _ in range(CALLS_PER_SAMPLE):
        run()
    end.record()
    end.synchronize()
    return Timing(time.perf_counter() - began, start.elapsed_time(end) / 1e3)


def candidates(fused_problems: Mapping[str, str], apex_problem: str,
               ) -> tuple[dict[str, dict[str, Callable[..., torch.Tensor]]], dict[str, dict[str, str]]]:
    """Per op, the implementations to race (native first) and those left out before the race, with why.

    ``fused_problems``: per op, why its fused kernel cannot run ("" if it can);
    ``apex_problem``: why apex's LayerNorm cannot ("" if it can). The other candidates say
    for themselves at the race whether they can (they raise where they cannot).
    """
    timed: dict[str, dict[str, Callable[..., torch.Tensor]]] = {}
    excluded: dict[str, dict[str, str]] = {}
    for op in OPS:
        problems = {"fused": fused_problems.get(op, "not checked")} if "fused" in IMPLEMENTATIONS[op] else {}
        if op == "layer_norm":
            problems["apex"] = apex_problem
        timed[op] = {"native": IMPLEMENTATIONS[op]["native"]}
        timed[op].update((name, fn) for name, fn in IMPLEMENTATIONS[op].items() if not problems.get(name, ""))
        excluded[op] = {name: why for name, why in problems.items() if why}
    return timed, excluded


def candidate_names() -> dict[str, list[str]]:
    """Per op, the names of its candidates: a race recorded with other candidates is run again."""
    return {op: list(IMPLEMENTATIONS[op]) for op in OPS}


def race(shapes: OpShapes, device: torch.device, timed: Mapping[str, Mapping[str, Callable[..., torch.Tensor]]],
         excluded: Mapping[str, Mapping[str, str]], timer: Timer = best_seconds_per_call) -> dict[str, Choice]:
    """Checks, then times, every candidate of every op at ``shapes`` on ``device``; per op, the
    correct one fastest by ``timer``'s wall time wins."""
    choices = {}
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for op, implementations in timed.items():
            if not shapes.has(op):
                continue  # the model has no such op (BERT: no local layers, no GeGLU)
            case = _case(op, shapes, device)
            wall_ms, device_ms, left_out = {}, {}, dict(excluded.get(op, {}))
            for name, fn in implementations.items():
                fn = case.form(name, fn)  # as the model calls it (attention: on its one Q/K/V projection)
                try:
                    # native is what every other falls back to: there is nothing to exclude it for
                    wrong = [] if name == "native" else case.check(fn)
                    if wrong:
                        left_out[name] = f"wrong at these shapes: {'; '.join(wrong[:3])}"
                        continue
                    timing = timer(functools.partial(case.run, fn), device)
                    wall_ms[name], device_ms[name] = timing.wall * 1e3, timing.device * 1e3
                except Exception as error:  # a candidate that cannot run these shapes is not one
                    left_out[name] = f"raised {type(error).__name__}: {_first_line(error)}"
            if "native" not in wall_ms:
                raise RuntimeError(f"the native {op} failed at {shapes.describe()}: {left_out.get('native')}")
            # By wall time, what the step pays. min() keeps the first of equals, and native comes
            # first: a tie is not a reason to leave it.
            choices[op] = Choice(min(wall_ms, key=wall_ms.__getitem__), wall_ms, device_ms, left_out)
    return choices


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _as_given(name: str, fn: Callable) -> Callable:
    return fn


@dataclass
class _AutogradCase:
    """One of the model's ops at the race's inputs: ``call(fn, leaves)`` runs candidate ``fn`` forward."""

    call: Callable[[Callable, dict[str, torch.Tensor]], torch.Tensor]
    leaves: dict[str, torch.Tensor]  # the inputs that take gradients
    grad: torch.Tensor  # the upstream gradient
    reference: Callable[..., torch.Tensor]
    dtype: torch.dtype
    # The call the check compares, where it is not ``call``: a dropout's candidates draw their masks
    # each from its own generator, so they are compared without one (the self-check compares the
    # fused kernel's mask with the reference's)
    checked: Callable[[Callable, dict[str, torch.Tensor]], torch.Tensor] | None = None
    # An integer output the candidate must give exactly as the reference does (the MLM loss's count of
    # right predictions), which the error rule's tolerance would let drift
    exact: Callable[[Callable, dict[str, torch.Tensor]], torch.Tensor] | None = None
    # Candidate ``name`` (its implementation ``fn``) in the form ``call`` calls, as the model runs it
    form: Callable[[str, Callable], Callable] = _as_given

    def run(self, fn: Callable) -> None:
        """One call of ``fn``, forward and backward: what is timed."""
        torch.autograd.grad(self.call(fn, self.leaves), list(self.leaves.values()), self.grad)

    def check(self, fn: Callable) -> list[str]:
        """What ``fn`` gets wrong here, output and gradients, against the reference (the self-check's rule)."""
        call = self.checked or self.call
        with selfcheck.clean_context():
            wrong = selfcheck.compare(str(self.dtype), lambda **t: call(fn, t), lambda **t: call(self.reference, t),
                                      self.leaves, self.grad, self.dtype)
            if self.exact is not None:
                exact = self.exact
                wrong += selfcheck.exact_problems(str(self.dtype), lambda **t: exact(fn, t),
                                                  lambda **t: exact(self.reference, t), self.leaves)
        return wrong


@dataclass
class _LambCase:
    """LAMB's update at the race's flat tensor; held to the self-check's LAMB case on the device."""

    run: Callable[[Callable], None]
    device: torch.device
    form: Callable[[str, Callable], Callable] = _as_given

    def check(self, fn: Callable) -> list[str]:
        with selfcheck.clean_context():
            return selfcheck.check_lamb_update(fn, self.device)


def _case(op: str, shapes: OpShapes, device: torch.device) -> _AutogradCase | _LambCase:
    """The op's inputs at ``shapes``: ``run(fn)`` is one call of candidate ``fn`` (forward and
    backward for the model's ops, one in-place step for LAMB's update), ``check(fn)`` what it
    gets wrong."""
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, shapes.dtype)
    lengths = shapes.lengths()
    tokens = sum(lengths)

    def rand(*shape: int, shift: float = 0.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=generator, device=device) + shift
        return x.to(dtype).requires_grad_()

    if op == "layer_norm":
        leaves = {"x": rand(tokens, shapes.hidden), "weight": rand(shapes.hidden, shift=1.0)}
        if shapes.layer_norm_bias:  # BERT's: the residual added in, and a bias
            leaves.update(residual=rand(tokens, shapes.hidden), bias=rand(shapes.hidden))
        return _AutogradCase(lambda fn, t: fn(t["x"], t["weight"], t.get("bias"), LAYER_NORM_EPS, t.get("residual")),
                             leaves, rand(tokens, shapes.hidden).detach(), layer_norm_ref, dtype)
    if op == "dropout_add_layer_norm":
        leaves = {"x": rand(tokens, shapes.hidden), "bias": rand(shapes.hidden),
                  "residual": rand(tokens, shapes.hidden), "weight": rand(shapes.hidden, shift=1.0),
                  "ln_bias": rand(shapes.hidden)}

        def sublayer_end(dropout_p: float):
            return lambda fn, t: fn(t["x"], t["bias"], t["residual"], t["weight"], t["ln_bias"], LAYER_NORM_EPS,
                                    dropout_p)
        return _AutogradCase(sublayer_end(shapes.hidden_dropout), leaves, rand(tokens, shapes.hidden).detach(),
                             dropout_add_layer_norm_ref, dtype, checked=sublayer_end(0.0))
    if op == "bias_gelu":
        leaves = {"x": rand(tokens, shapes.intermediate), "bias": rand(shapes.intermediate)}
        return _AutogradCase(lambda fn, t: fn(t["x"], t["bias"], shapes.approximate),
                             leaves, rand(tokens, shapes.intermediate).detach(), bias_gelu_ref, dtype)
    if op == "geglu":  # on the MLP's Wi projection, [input | gate]
        leaves = {"x": rand(tokens, 2 * shapes.intermediate)}
        return _AutogradCase(lambda fn, t: fn(t["x"], shapes.approximate),
                             leaves, rand(tokens, shapes.intermediate).detach(), geglu_ref, dtype)
    if op in ("varlen_attention", "local_attention"):
        return _attention_case(op, shapes, device, rand, dtype)
    if op == "mlm_cross_entropy":
        return _cross_entropy_case(shapes, device, generator, dtype)
    if op == "lamb_update":
        return _LambCase(_lamb_case(shapes, device, generator), device)
    raise ValueError(f"no timing case for op {op!r}")


RACE_ROPE_THETA = 10000.0  # a rotary model's race rotates by ModernBERT's local base: the cost is the same at any


def _attention_case(op: str, shapes: OpShapes, device: torch.device, rand: Callable[..., torch.Tensor],
                    dtype: torch.dtype) -> _AutogradCase:
    """An attention op as the model runs it: on one (T, 3, nh, hd) Q/K/V projection, its gradient
    in one piece. Without rotary embeddings a candidate reads the projection in place or as three
    views (attention.packed_form); with them (:attr:`OpShapes.rotary`) the fused kernel rotates q and k
    as it loads them and every other candidate runs after they are rotated in PyTorch
    (rotary_attention.rotary_form; the cos and sin tables, made once a forward for every layer, are
    made here before the timing), so that the race counts the rotation the fused path saves."""
    lengths = shapes.lengths()
    tokens = sum(lengths)
    cu_seqlens = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    window = shapes.window if op == "local_attention" else None
    leaves = {"qkv": rand(tokens, 3, shapes.num_heads, shapes.head_dim)}
    grad = rand(tokens, shapes.num_heads, shapes.head_dim).detach()
    if shapes.rotary:
        positions = rotary_attention.sequence_positions(cu_seqlens, tokens)
        tables = rotary_attention.rotary_tables(positions, shapes.head_dim, RACE_ROPE_THETA, dtype)
        form = functools.partial(rotary_attention.rotary_form, window=window, rope_theta=RACE_ROPE_THETA,
                                 tables=tables)
        reference = functools.partial(rotary_attention.rotary_attention_ref, rope_theta=RACE_ROPE_THETA,
                                      window=window)
    elif window is None:
        form, reference = attention.packed_form, attention.packed_form("reference", attention.varlen_attention_ref)
    else:
        form, reference = _local_form(window), _local_form(window)("reference", local_attention_ref)
    return _AutogradCase(lambda fn, t: fn(t["qkv"], cu_seqlens, shapes.max_seqlen), leaves, grad, reference, dtype,
                         form=form)


def _local_form(window: int) -> Callable[[str, Callable], Callable]:
    """The local op's candidates on the three views of a projection, without rotary embeddings."""
    def form(name: str, fn: Callable) -> Callable:
        return lambda qkv, cu_seqlens, max_seqlen: fn(*qkv.unbind(1), cu_seqlens, max_seqlen, window)
    return form


def _cross_entropy_case(shapes: OpShapes, device: torch.device, generator: torch.Generator,
                        dtype: torch.dtype) -> _AutogradCase:
    """The MLM loss on the decoder's logits: the masked rows of a micro-batch, at its padded width with
    -inf past the vocabulary, labels among the real columns (in training no masked row is ignored)."""
    logits = torch.randn(shapes.masked_rows, shapes.decoder_width, generator=generator, device=device)
    logits[:, shapes.vocab:] = float("-inf")
    labels = torch.randint(0, shapes.vocab, (shapes.masked_rows,), generator=generator, device=device)
    return _AutogradCase(lambda fn, t: fn(t["logits"], labels)[0], {"logits": logits.to(dtype).requires_grad_()},
                         torch.ones((), device=device), mlm_cross_entropy_ref, dtype,
                         exact=lambda fn, t: fn(t["logits"], labels)[1])


def _lamb_case(shapes: OpShapes, device: torch.device, generator: torch.Generator) -> Callable[[Callable], None]:
    """LAMB's step on a flat fp32 tensor cut like a ZeRO partition: the weights of two encoder
    layers (hidden^2 four times, hidden x intermediate twice, each), 14.2M elements at BERT-Base's
    shapes, about what each of 8 ranks holds of its 110M."""
    layer = [shapes.hidden ** 2] * 4 + [shapes.hidden * shapes.intermediate] * 2
    return lamb_timing_case(layer * 2, device, generator)


def lamb_timing_case(pieces: list[int], device: torch.device | str,
                     generator: torch.Generator | None = None) -> Callable[[Callable], None]:
    """``run(fn)``: one LAMB step by ``fn`` (``lamb_update_ref``'s signature) on a flat fp32 tensor
    of fragments of these lengths, with per-chunk multipliers from a callback as the optimizer's
    (its all-reduce aside); the learning rate is tiny, so repeated calls leave the weights put."""
    chunks, _ = lamb.Chunks.tile(pieces, device)
    w, g, m = (torch.randn(chunks.numel, generator=generator, device=device) for _ in range(3))
    v = torch.rand(chunks.numel, generator=generator, device=device)
    scalars = lamb.LambScalars.at_step((0.9, 0.999), 1e-6, 0.01, 10)

    def scales(squares: torch.Tensor) -> torch.Tensor:  # stands in for the optimizer's sums and ratios
        return (squares[:, 0].sqrt() / squares[:, 1].sqrt().clamp_min(1e-12)).mul_(1e-9)

    def run(fn) -> None:
        fn(w, g, m, v, chunks, scalars, scales)
    return run
