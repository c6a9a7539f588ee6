"""The fused kernels against their references on this device: the verdicts behind
``kernels=cuda`` refusing to start and ``kernels=auto`` choosing per op (see
``kernels/choice.py``, which runs this once per build and device). The same checks
take any implementation of an op (apex's LayerNorm is held to them too) and device;
:func:`compare` is the rule alone, which the race of ``kernels=auto`` applies to each
candidate at the model's shapes before it times it (``kernels/speed.py``).

Each check runs the op's implementation, forward and backward, on seeded random
inputs (never zeros) in every dtype it takes and a few shapes, covering the fast and
general paths, and compares the output and every gradient by flash-attention's rule:
the kernel's error against the reference run on float32 inputs may be at most twice
the error of the reference run in the input dtype, plus a tolerance proportional to
the values' size. A check that raises fails with the exception's first line.

The check runs in a clean context whatever its caller's: its own generator (the
caller's RNG stream is untouched), gradients on, no autocast, no inference mode, TF32
off (so that the float32 truth is float32).
"""

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator

import torch

from bert_ds.kernels.attention import varlen_attention_fused, varlen_attention_packed_fused, varlen_attention_ref
from bert_ds.kernels.bias_gelu import bias_gelu_fused, bias_gelu_ref
from bert_ds.kernels.cross_entropy import IGNORE_INDEX, mlm_cross_entropy_fused, mlm_cross_entropy_ref
from bert_ds.kernels.dropout_layer_norm import dropout_add_layer_norm_fused, dropout_add_layer_norm_ref
from bert_ds.kernels.geglu import geglu_fused, geglu_ref
from bert_ds.kernels.lamb import Chunks, LambScalars, lamb_update_fused, lamb_update_ref
from bert_ds.kernels.layer_norm import layer_norm_fused, layer_norm_ref
from bert_ds.kernels.local_attention import local_attention_fused, local_attention_ref
from bert_ds.kernels.rotary_attention import rotary_attention_fused, rotary_attention_ref

# atol = TOLERANCE[dtype] * max(1, |truth|_max): room for the case where the same-dtype
# reference is (nearly) exact, e.g. float32, or a sum the reference rounds only once.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}

Tensors = dict[str, torch.Tensor]


def run_all() -> dict[str, str]:
    """Per op, "" if its kernels pass, else what failed (at most three findings)."""
    cuda = torch.device("cuda")
    return {op: verdict(functools.partial(check, impl, cuda)) for op, (check, impl) in fused_checks().items()}


def fused_checks() -> dict[str, tuple[Callable[..., list[str]], Callable[..., object]]]:
    """Each op of ``dispatch.OPS``: its check and its fused implementation."""
    return {"layer_norm": (check_layer_norm, layer_norm_fused),
            "dropout_add_layer_norm": (check_dropout_add_layer_norm, dropout_add_layer_norm_fused),
            "bias_gelu": (check_bias_gelu, bias_gelu_fused),
            "varlen_attention": (functools.partial(check_varlen_attention, packed=varlen_attention_packed_fused,
                                                   rotary=rotary_attention_fused), varlen_attention_fused),
            "mlm_cross_entropy": (check_mlm_cross_entropy, mlm_cross_entropy_fused),
            "lamb_update": (check_lamb_update, lamb_update_fused),
            "geglu": (check_geglu, geglu_fused),
            "local_attention": (functools.partial(check_local_attention, rotary=rotary_attention_fused),
                                local_attention_fused)}


def verdict(check: Callable[[], list[str]]) -> str:
    """"" if ``check`` finds nothing, else its first three findings; a check that raises fails."""
    with clean_context():
        try:
            problems = check()
        except Exception as error:  # a kernel that raises is a failed kernel; say how
            message = str(error).strip().splitlines()
            problems = [f"raised {type(error).__name__}: {message[0] if message else ''}"]
    return "; ".join(problems[:3])


@contextlib.contextmanager
def clean_context() -> Iterator[None]:
    """Whatever the caller had on (no_grad, inference_mode, autocast, TF32), the check runs without."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with (torch.inference_mode(False), torch.enable_grad(), torch.autocast("cuda", enabled=False),
              torch.autocast("cpu", enabled=False)):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class _Inputs:
    """Seeded normal tensors on ``device``, from a private generator."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, *shape: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.generator, device=self.device, dtype=torch.float32)
        return (x * scale + shift).to(dtype)


def _forward_backward(fn: Callable[..., torch.Tensor], leaves: Tensors, grad_out: torch.Tensor) -> Tensors:
    """fn(**leaves) and the gradient of every leaf, for the upstream gradient grad_out."""
    leaves = {name: t.detach().clone().requires_grad_() for name, t in leaves.items()}
    out = fn(**leaves)
    out.backward(grad_out.to(out.dtype))
    return {"out": out.detach(), **{f"d{name}": t.grad for name, t in leaves.items()}}


def compare(case: str, fn, fn_ref, leaves: Tensors, grad_out: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """``fn(**leaves)`` and every gradient against ``fn_ref``'s by the rule of the module docstring:
    one finding per output or gradient that breaks it."""
    ours = _forward_backward(fn, leaves, grad_out)
    same_dtype = _forward_backward(fn_ref, leaves, grad_out)
    truth = _forward_backward(fn_ref, {name: t.float() for name, t in leaves.items()}, grad_out.float())
    problems = []
    for name, value in ours.items():
        if value is None or value.dtype != same_dtype[name].dtype or value.shape != truth[name].shape:
            problems.append(f"{case} {name}: wrong dtype or shape")
            continue
        value, reference, exact = value.float(), same_dtype[name].float(), truth[name].float()
        if not torch.isfinite(value).all():
            problems.append(f"{case} {name}: non-finite values")
            continue
        err = (value - exact).abs().max().item()
        reference_err = (reference - exact).abs().max().item()
        atol = TOLERANCE[dtype] * max(1.0, exact.abs().max().item())
        if err > 2.0 * reference_err + atol:
            problems.append(f"{case} {name}: error {err:.3g} > 2 x reference {reference_err:.3g} + {atol:.3g}")
    return problems


def exact_problems(case: str, fn, fn_ref, leaves: Tensors) -> list[str]:
    """``fn(**leaves)`` against ``fn_ref(**leaves)``, which it must equal: for an integer output (a
    count), where the rule's tolerance would let a wrong one pass."""
    with torch.no_grad():
        ours, expected = fn(**leaves), fn_ref(**leaves)
    if ours.dtype != expected.dtype or not torch.equal(ours, expected):
        return [f"{case}: {ours.tolist()} where the reference gives {expected.tolist()}"]
    return []


def check_layer_norm(impl: Callable[..., torch.Tensor], device: torch.device,
                     mixed_dtypes: bool = True, without_bias: bool = True) -> list[str]:
    """``impl`` (``layer_norm_ref``'s signature) against the reference; ``mixed_dtypes``: also
    float32 weights with half inputs (apex's LayerNorm takes one dtype); ``without_bias``: also
    LayerNorms without a bias, on both paths (apex's takes one)."""
    rand = _Inputs(seed=0, device=device)
    problems = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, hidden, residual, weight_dtype, bias in ((96, 768, True, dtype, True),
                                                           (33, 1024, False, torch.float32, False),
                                                           (17, 1023, True, dtype, True),
                                                           (24, 100, False, dtype, False)):
            if weight_dtype != dtype and not mixed_dtypes:
                weight_dtype = dtype
            leaves = {"x": rand(rows, hidden, dtype=dtype, scale=2.0, shift=0.5),
                      "weight": rand(hidden, dtype=weight_dtype, shift=1.0)}
            bias = bias or not without_bias
            if bias:
                leaves["bias"] = rand(hidden, dtype=weight_dtype, scale=0.5)
            if residual:
                leaves["residual"] = rand(rows, hidden, dtype=dtype)
            case = f"{dtype} ({rows}, {hidden}){' +residual' if residual else ''}{'' if bias else ' no bias'}"
            problems += compare(
                case,
                lambda x, weight, bias=None, residual=None: impl(x, weight, bias, 1e-12, residual),
                lambda x, weight, bias=None, residual=None: layer_norm_ref(x, weight, bias, 1e-12, residual),
                leaves, rand(rows, hidden, dtype=dtype), dtype)
    return problems


def check_dropout_add_layer_norm(impl: Callable[..., torch.Tensor], device: torch.device) -> list[str]:
    """``impl`` (:func:`~bert_ds.kernels.dropout_layer_norm.dropout_add_layer_norm_fused`'s signature: it
    takes ``seed``, ``offset`` and ``keep_out``) against the reference given the mask ``impl`` reports
    using, with dropout off and at p = 0.1; and that mask's keep rate, which must be 0.9 within six
    standard deviations (a kernel that never drops would otherwise pass: the reference would be
    handed an all-true mask). A fixed Philox stream, so the caller's generators are untouched."""
    rand = _Inputs(seed=4, device=device)
    problems, kept, total = [], 0, 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, hidden, dropout_p, weight_dtype in ((96, 768, 0.1, dtype), (33, 1024, 0.1, torch.float32),
                                                      (17, 1023, 0.1, dtype), (40, 768, 0.0, dtype)):
            keep = torch.empty(rows, hidden, dtype=torch.bool, device=device)
            leaves = {"x": rand(rows, hidden, dtype=dtype, scale=2.0, shift=0.5),
                      "bias": rand(hidden, dtype=weight_dtype, scale=0.5),
                      "residual": rand(rows, hidden, dtype=dtype),
                      "weight": rand(hidden, dtype=weight_dtype, shift=1.0),
                      "ln_bias": rand(hidden, dtype=weight_dtype, scale=0.5)}
            stream = {"seed": 1234 + rows, "offset": 4 * hidden}

            def ours(x, bias, residual, weight, ln_bias, dropout_p=dropout_p, keep=keep, stream=stream):
                return impl(x, bias, residual, weight, ln_bias, 1e-12, dropout_p, keep_out=keep, **stream)

            def reference(x, bias, residual, weight, ln_bias, dropout_p=dropout_p, keep=keep):
                return dropout_add_layer_norm_ref(x, bias, residual, weight, ln_bias, 1e-12, dropout_p, keep)
            # compare() runs ``ours`` first: the reference sees the mask it wrote
            problems += compare(f"{dtype} ({rows}, {hidden}) p={dropout_p}", ours, reference, leaves,
                                rand(rows, hidden, dtype=dtype), dtype)
            if dropout_p == 0.0 and not bool(keep.all()):
                problems.append(f"{dtype} ({rows}, {hidden}) p=0: dropped elements")
            elif dropout_p > 0:
                kept, total = kept + int(keep.sum()), total + keep.numel()
    rate, sigma = kept / total, (0.9 * 0.1 / total) ** 0.5
    if abs(rate - 0.9) > 6 * sigma:
        problems.append(f"p=0.1 keeps {rate:.4f} of {total} elements (0.9 +- {6 * sigma:.4f})")
    return problems


def check_bias_gelu(impl: Callable[..., torch.Tensor], device: torch.device) -> list[str]:
    """``impl`` (``bias_gelu_ref``'s signature) against the reference."""
    rand = _Inputs(seed=1, device=device)
    problems = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, cols, approximate in ((64, 3072, "none"), (9, 1031, "tanh"), (40, 256, "tanh")):
            leaves = {"x": rand(rows, cols, dtype=dtype, scale=2.0), "bias": rand(cols, dtype=dtype)}
            problems += compare(
                f"{dtype} ({rows}, {cols}) {approximate}",
                lambda x, bias, approximate=approximate: impl(x, bias, approximate),
                lambda x, bias, approximate=approximate: bias_gelu_ref(x, bias, approximate),
                leaves, rand(rows, cols, dtype=dtype), dtype)
    return problems


def check_geglu(impl: Callable[..., torch.Tensor], device: torch.device) -> list[str]:
    """``impl`` (``geglu_ref``'s signature) against the reference, in both GELU forms: ModernBERT-base's
    width (1,152: 16-byte vectors in every dtype), 260 (16-byte vectors in fp32 alone) and 1,031 (scalar)."""
    rand = _Inputs(seed=7, device=device)
    problems = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, cols, approximate in ((64, 1152, "none"), (9, 1031, "tanh"), (40, 260, "tanh")):
            leaves = {"x": rand(rows, 2 * cols, dtype=dtype, scale=2.0)}
            problems += compare(
                f"{dtype} ({rows}, 2 x {cols}) {approximate}",
                lambda x, approximate=approximate: impl(x, approximate),
                lambda x, approximate=approximate: geglu_ref(x, approximate),
                leaves, rand(rows, cols, dtype=dtype), dtype)
    return problems


def check_varlen_attention(impl: Callable[..., torch.Tensor], device: torch.device,
                           packed: Callable[..., torch.Tensor] | None = None,
                           rotary: Callable[..., torch.Tensor] | None = None) -> list[str]:
    """``impl`` (``varlen_attention_ref``'s signature) against the reference, in the dtypes
    the fused kernel takes; and ``packed`` (``varlen_attention_packed``'s: q, k, v read from
    one (T, 3, nh, hd) projection, the gradient returned in one piece) and ``rotary``
    (``rotary_attention_ref``'s: q and k rotated as they load, the global layers' base), where given."""
    rand = _Inputs(seed=2, device=device)
    problems = check_packed_attention(packed, device) if packed is not None else []
    problems += check_rotary_attention(rotary, device, None, 160000.0) if rotary is not None else []
    return problems + _compare_attention(impl, varlen_attention_ref, rand, device,
                                         (([1, 512, 77, 128], 3, 64, None), ([3, 65, 1], 2, 32, None)))


def check_local_attention(impl: Callable[..., torch.Tensor], device: torch.device,
                          rotary: Callable[..., torch.Tensor] | None = None) -> list[str]:
    """``impl`` (``local_attention_ref``'s signature) against the reference, in the dtypes the fused
    kernel takes: windows inside one tile, ModernBERT's 64 and wider than every tile, over sequences
    shorter and longer than them; and ``rotary`` (``rotary_attention_ref``'s), windowed, where given."""
    rand = _Inputs(seed=3, device=device)
    problems = check_rotary_attention(rotary, device, 64, 10000.0) if rotary is not None else []
    return problems + _compare_attention(impl, local_attention_ref, rand, device,
                                         (([1, 300, 77, 128], 2, 64, 64), ([1, 300, 77, 128], 2, 64, 3),
                                          ([3, 260, 1], 2, 32, 130)))


def _compare_attention(impl: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor], rand: _Inputs,
                       device: torch.device, cases: Iterable[tuple[list[int], int, int, int | None]]) -> list[str]:
    """``impl`` against ``reference`` in the dtypes the fused kernel takes, over cases of (lengths,
    heads, head_dim, window): window None for the global op's signature, else the local op's, which
    takes the window after max_seqlen."""
    problems = []
    for dtype in (torch.float16, torch.bfloat16):
        for lengths, heads, head_dim, window in cases:
            total, max_seqlen = sum(lengths), max(lengths)
            offsets = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
            windowed = () if window is None else (window,)
            rest = (offsets, max_seqlen, *windowed, 0.0, head_dim ** -0.5)  # ..., dropout_p, softmax_scale
            leaves = {name: rand(total, heads, head_dim, dtype=dtype) for name in ("q", "k", "v")}
            problems += compare(
                f"{dtype} lengths {lengths} heads {heads} head_dim {head_dim}" + "".join(f" window {w}" for w in windowed),
                lambda q, k, v, rest=rest: impl(q, k, v, *rest),
                lambda q, k, v, rest=rest: reference(q, k, v, *rest),
                leaves, rand(total, heads, head_dim, dtype=dtype), dtype)
    return problems


def check_rotary_attention(rotary: Callable[..., torch.Tensor], device: torch.device, window: int | None,
                           rope_theta: float, lengths: tuple[int, ...] = (1, 128, 77, 300)) -> list[str]:
    """``rotary`` (``rotary_attention_ref``'s signature: an unrotated (T, 3, nh, hd) projection, q and k
    rotated by the model's rotary, each sequence from position 0) against the reference, in both
    dtypes, at head dims 64 and 32."""
    rand = _Inputs(seed=6, device=device)
    lengths, problems = list(lengths), []
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    for dtype in (torch.float16, torch.bfloat16):
        for heads, head_dim in ((2, 64), (2, 32)):
            rest = (offsets, max(lengths), rope_theta, window, 0.0, head_dim ** -0.5)
            problems += compare(f"rotary {dtype} lengths {lengths} head_dim {head_dim} window {window} "
                                f"theta {rope_theta:g}",
                                lambda qkv, rest=rest: rotary(qkv, *rest),
                                lambda qkv, rest=rest: rotary_attention_ref(qkv, *rest),
                                {"qkv": rand(sum(lengths), 3, heads, head_dim, dtype=dtype)},
                                rand(sum(lengths), heads, head_dim, dtype=dtype), dtype)
    return problems


def check_packed_attention(packed: Callable[..., torch.Tensor], device: torch.device,
                           lengths: tuple[int, ...] = (1, 128, 77, 300), heads: int = 12) -> list[str]:
    """``packed`` (``varlen_attention_packed``'s signature: q, k, v read from one (T, 3, nh, hd)
    projection, the gradient returned in one piece) against the reference on its three views,
    by default at the model's layout: BERT-Base's 12 heads of 64, one sequence past one key tile."""
    rand = _Inputs(seed=5, device=device)
    lengths, head_dim, dtype = list(lengths), 64, torch.bfloat16
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    rest = (offsets, max(lengths), 0.0, head_dim ** -0.5)
    return compare(f"packed qkv {dtype} lengths {lengths} heads {heads} head_dim {head_dim}",
                   lambda qkv: packed(qkv, *rest), lambda qkv: varlen_attention_ref(*qkv.unbind(1), *rest),
                   {"qkv": rand(sum(lengths), 3, heads, head_dim, dtype=dtype)},
                   rand(sum(lengths), heads, head_dim, dtype=dtype), dtype)


def check_mlm_cross_entropy(impl: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                            device: torch.device) -> list[str]:
    """``impl`` (``mlm_cross_entropy_ref``'s signature) against the reference: the summed loss and the
    logits' gradient by the rule, the count of right predictions exactly (:func:`mlm_rows` says what
    the rows hold); at BERT's padded vocabulary, and at two widths that no 16-byte vector divides."""
    problems = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, vocab, width in ((48, 30522, 30528), (33, 1000, 1000), (9, 1031, 1031)):
            logits, labels = mlm_rows(rows, vocab, width, dtype, device)
            case = f"{dtype} ({rows}, {width})"

            def loss(logits, fn, labels=labels):
                return fn(logits, labels)[0]

            def count(logits, fn, labels=labels):
                return fn(logits, labels)[1]
            problems += compare(case, functools.partial(loss, fn=impl),
                                functools.partial(loss, fn=mlm_cross_entropy_ref), {"logits": logits},
                                torch.full((), 0.7, device=device), dtype)
            problems += exact_problems(f"{case} correct", functools.partial(count, fn=impl),
                                       functools.partial(count, fn=mlm_cross_entropy_ref), {"logits": logits})
    return problems


def mlm_rows(rows: int, vocab: int, width: int, dtype: torch.dtype, device: torch.device,
             seed: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (rows, width) of ``dtype``, labels (rows,) int64) as the model's decoder gives them: -inf
    past ``vocab`` (its padding), labels among the real columns. Row 0's label is the last real column
    and its maximum; from row 4, every third row's label is its argmax; row 2's maximum is shared by a
    column before its label (not counted: the first maximal column is the argmax), row 3's by one after
    (counted); every fourth row from row 1 is ignored; the last row is shifted by +100, where exp of a
    logit without the row's maximum subtracted overflows fp32. Needs rows >= 5 and vocab >= 10."""
    rand = _Inputs(seed, device)
    x = rand(rows, width, dtype=torch.float32, scale=3.0)
    x[:, vocab:] = float("-inf")
    x[-1, :vocab] += 100.0
    labels = torch.randint(0, vocab, (rows,), generator=rand.generator, device=rand.device)
    labels[0], x[0, vocab - 1] = vocab - 1, 20.0
    labels[2], x[2, 3], x[2, 7] = 7, 20.0, 20.0
    labels[3], x[3, 7], x[3, 9] = 7, 20.0, 20.0
    x = x.to(dtype)
    labels[4::3] = x[4::3].float().argmax(dim=1)  # after the rounding to dtype, which may tie values
    labels[1::4] = IGNORE_INDEX
    return x, labels


def check_lamb_update(impl: Callable[..., None], device: torch.device) -> list[str]:
    """``impl`` (``lamb_update_ref``'s signature) against the reference, both in float32 (the
    only dtype of the fused kernel): the moments, the weights and the per-chunk squared norms
    the callback receives, within a relative 1e-5 (float32 rounding of a few operations; a
    wrong index or a lost chunk is off by far more). Ragged chunks (1, 1023, 1024, 1025, 7
    elements, ...), with and without weight decay, with per-chunk multipliers and one for all."""
    rand = _Inputs(seed=3, device=device)
    problems = []
    chunks, _ = Chunks.tile([1, 1023, 1024, 1025, 7, 4096 + 13, 300], device)
    for weight_decay, adapt in ((0.01, True), (0.0, True), (0.0, False)):
        s = LambScalars.at_step((0.9, 0.999), 1e-6, weight_decay, step=3)
        state = {"param": rand(chunks.numel, dtype=torch.float32), "grad": rand(chunks.numel, dtype=torch.float32),
                 "exp_avg": rand(chunks.numel, dtype=torch.float32, scale=0.1),
                 "exp_avg_sq": rand(chunks.numel, dtype=torch.float32).abs().mul_(0.01)}
        runs = {}
        for name, fn in (("ours", impl), ("reference", lamb_update_ref)):
            tensors = {k: t.clone() for k, t in state.items()}
            seen: list[torch.Tensor] = []

            def scales(squares: torch.Tensor, seen=seen) -> torch.Tensor:
                seen.append(squares.detach().clone())
                return squares[:, 0].sqrt() / squares[:, 1].sqrt() * 1e-2
            fn(tensors["param"], tensors["grad"], tensors["exp_avg"], tensors["exp_avg_sq"], chunks, s,
               scales if adapt else 1e-2)
            runs[name] = {**tensors, "squares": seen[0] if seen else torch.zeros(0, device=device)}
        case = f"weight_decay {weight_decay}{' per-chunk scales' if adapt else ' one scale'}"
        for key in ("param", "exp_avg", "exp_avg_sq", "squares"):
            ours, truth = runs["ours"][key], runs["reference"][key]
            if ours.shape != truth.shape or not torch.isfinite(ours).all():
                problems.append(f"{case} {key}: wrong shape or non-finite values")
            elif ours.numel() and (ours - truth).abs().max().item() > 1e-5 * max(1.0, truth.abs().max().item()):
                problems.append(f"{case} {key}: off by {(ours - truth).abs().max().item():.3g}")
    problems += _check_lamb_skip(impl, rand, chunks)
    return problems


def _check_lamb_skip(impl: Callable[..., None], rand: _Inputs, chunks: Chunks) -> list[str]:
    """A step skipped by its device flag, over a gradient of NaN and inf: the weights and both
    moments bitwise as they were, per-chunk multipliers or one; a flag of 0 steps as usual."""
    problems = []
    device = chunks.offsets.device
    s = LambScalars.at_step((0.9, 0.999), 1e-6, 0.01, step=3)
    state = {"param": rand(chunks.numel, dtype=torch.float32), "exp_avg": rand(chunks.numel, dtype=torch.float32),
             "exp_avg_sq": rand(chunks.numel, dtype=torch.float32).abs()}
    grad = rand(chunks.numel, dtype=torch.float32)
    grad[::7], grad[1::7] = float("nan"), float("inf")
    for flag, adapt in ((1.0, True), (1.0, False), (0.0, True)):
        tensors = {k: t.clone() for k, t in state.items()}
        impl(tensors["param"], grad, tensors["exp_avg"], tensors["exp_avg_sq"], chunks, s,
             (lambda squares: torch.full_like(squares[:, 0], 1e-2)) if adapt else 1e-2,
             torch.full((), flag, dtype=torch.float32, device=device))
        unchanged = [k for k in state if torch.equal(tensors[k], state[k])]
        if flag and len(unchanged) < len(state):
            problems.append(f"skip flag set ({'per-chunk scales' if adapt else 'one scale'}): "
                            f"{', '.join(sorted(set(state) - set(unchanged)))} changed")
        if not flag and unchanged:
            problems.append(f"skip flag 0: {', '.join(unchanged)} not stepped")
    return problems
