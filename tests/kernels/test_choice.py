"""How ``kernels=auto`` chooses each op's implementation on a device, on a CPU.

The loader believes it runs on a CUDA device with the extension loaded; the race runs
on the CPU with a fake clock. The native candidates are the real ``<op>_native``, the
others stand-ins (the real fused kernels and SDPA backends need a GPU, and
``torch.compile`` takes a minute on a CPU): the native op, counting its calls. Both are
wrapped to charge the fake clock a set cost per call, and the checks, the choice, the
plan, the record and the dispatch that follows are the real code. The real candidates
are tested at the end, where a CPU can run them.
"""

import dataclasses
import functools
import importlib
import json
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from bert_ds.kernels import ops as kernels
from bert_ds.kernels import _build, attention, choice, dispatch, selfcheck, speed
from bert_ds.kernels.choice import resolve_backend
from bert_ds.kernels.compiled import CompiledReference
from bert_ds.kernels.dispatch import OpPlan
from bert_ds.model import backend

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)

# The modules, which kernels' own names for the public ops hide.
layer_norm = importlib.import_module("bert_ds.kernels.layer_norm")
dropout_layer_norm = importlib.import_module("bert_ds.kernels.dropout_layer_norm")
bias_gelu = importlib.import_module("bert_ds.kernels.bias_gelu")
cross_entropy = importlib.import_module("bert_ds.kernels.cross_entropy")
rotary_attention = importlib.import_module("bert_ds.kernels.rotary_attention")

SHAPES = speed.OpShapes(hidden=16, intermediate=64, num_heads=2, max_seqlen=8, tokens=16, dtype="float32")
PHASE_2 = dataclasses.replace(SHAPES, max_seqlen=16)  # the same model at phase 2's longer sequences
RECORDED = f"choices {SHAPES.key}"
MS = 1e-3  # the fake clock counts seconds
# The candidates the fixture stands in for (apex aside: it is no candidate unless a test installs it).
STOOD_IN = {op: [name for name in impls if name not in ("native", "apex")] for op, impls in speed.IMPLEMENTATIONS.items()}
# A model without local layers or GeGLU (BERT's SHAPES) races every op but those two.
RACED_HERE = [op for op in dispatch.OPS if SHAPES.has(op)]
TIMED_PER_RACE = sum(1 + len(STOOD_IN[op]) for op in RACED_HERE)


class FakeClock:
    """The race's two clocks, the host's wall clock and the device's, which move only when a
    candidate is charged for a call."""

    def __init__(self) -> None:
        self.now = 0.0  # the wall clock
        self.device_now = 0.0
        self.timed = []  # one entry per candidate timed

    def timer(self, run, device: torch.device) -> speed.Timing:
        self.timed.append(device)
        wall, on_device = self.now, self.device_now
        run()
        return speed.Timing(self.now - wall, self.device_now - on_device)

    def charging(self, cost, fn):
        """``fn``, charging ``cost`` ms per call to both clocks, or a ``(wall, device)`` pair to each;
        a callable cost is given the call's arguments."""
        def charged(*args, **kwargs):
            spent = cost(*args) if callable(cost) else cost
            wall, on_device = spent if isinstance(spent, tuple) else (spent, spent)
            self.now += wall * MS
            self.device_now += on_device * MS
            return fn(*args, **kwargs)
        return charged


def _stand_in(op: str, name: str, native, calls: list[tuple[str, str]]):
    """A CPU stand-in for candidate ``name`` of ``op``: the native op, counting its calls."""
    def stand_in(*args, **kwargs):
        calls.append((op, name))
        return native(*args, **kwargs)
    return stand_in


ATTENTION_OPS = ("varlen_attention", "local_attention")


APPLY_ROTARY = rotary_attention.apply_rotary  # before a test charges for it


def _rotating(fused_by_op: dict):
    """A stand-in for the fused kernels' rotary form (rotary_attention_fused's signature): q and k of the
    unrotated projection rotated as the reference rotates them, then the op's fused stand-in, which charges."""
    def rotary_fused(qkv, cu_seqlens, max_seqlen, rope_theta, window=None, *rest):
        q, k, v = qkv.unbind(1)
        tables = rotary_attention.rotary_tables(rotary_attention.sequence_positions(cu_seqlens, qkv.shape[0]),
                                                qkv.shape[-1], rope_theta, qkv.dtype)
        q, k = APPLY_ROTARY(q, *tables), APPLY_ROTARY(k, *tables)
        if window is None:
            return fused_by_op["varlen_attention"](q, k, v, cu_seqlens, max_seqlen, *rest)
        return fused_by_op["local_attention"](q, k, v, cu_seqlens, max_seqlen, window, *rest)
    return rotary_fused


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """A fake CUDA device ("Fake H100") whose extension loads and passes its self-check; the race
    on the CPU with a fake clock. ``auto.costs(op, native=..., fused=..., ...)`` sets what each
    call costs (ms to both clocks, a (wall, device) pair, or a function of the call's arguments
    giving either); by default native 2, fused 1 and every other candidate 3."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H100")
    (tmp_path / f"{_build.EXTENSION_NAME}.py").write_text(f"source_hash = {_build.source_hash()!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(selfcheck, "run_all", lambda: {op: "" for op in dispatch.OPS})
    clock = FakeClock()
    monkeypatch.setattr(choice, "race_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(choice, "race_timer", clock.timer)
    monkeypatch.setattr(layer_norm, "APEX_LAYER_NORM", None)
    monkeypatch.setattr(_build, "_jit_build", lambda: (None, "tests build nothing"))
    # A model races on 64 tokens here: a micro-batch's 32,768, each candidate checked in three
    # dtypes' worth of references, would take a CPU a minute per model.
    monkeypatch.setattr(backend, "OpShapes", functools.partial(speed.OpShapes, tokens=64))

    class Auto:
        calls: list[tuple[str, str]] = []  # (op, candidate) of every call of a stand-in
        natives = {op: impls["native"] for op, impls in speed.IMPLEMENTATIONS.items()}
        real = {op: dict(impls) for op, impls in speed.IMPLEMENTATIONS.items()}  # before any stand-in
        rotary: dict[str, object] = {}  # per attention op, its fused stand-in, which the rotary one calls

        @staticmethod
        def costs(op: str, **per_impl) -> None:
            for name, cost in per_impl.items():
                native = Auto.natives[op]
                fn = native if name == "native" else _stand_in(op, name, native, Auto.calls)
                charged = clock.charging(cost, fn)
                monkeypatch.setitem(speed.IMPLEMENTATIONS[op], name, charged)
                if op == "varlen_attention" and name in attention.PACKED_IMPLEMENTATIONS:  # the model's QKV layout
                    monkeypatch.setitem(attention.PACKED_IMPLEMENTATIONS, name,
                                        lambda qkv, *rest, fn=charged: fn(*qkv.unbind(1), *rest))
                if op in ATTENTION_OPS and name in rotary_attention.ROTARY_IMPLEMENTATIONS:  # a rotary model's
                    Auto.rotary[op] = charged
                    monkeypatch.setitem(rotary_attention.ROTARY_IMPLEMENTATIONS, name, _rotating(Auto.rotary))

        @staticmethod
        def new_process() -> None:
            for cached in (_build.load_extension, choice.op_verdicts, _build.source_hash, choice._auto_backend,
                           choice._log_once, dispatch._log_fallback):
                cached.cache_clear()

        @staticmethod
        def fused_calls() -> list[str]:
            return [op for op, name in Auto.calls if name == "fused"]

    Auto.clock = clock
    Auto.new_process()
    for op in dispatch.OPS:
        Auto.costs(op, native=2.0, **{name: 1.0 if name == "fused" else 3.0 for name in STOOD_IN[op]})
    yield Auto
    Auto.new_process()
    sys.modules.pop(_build.EXTENSION_NAME, None)


def _runs(shapes=SHAPES) -> dict[str, str]:
    return {op: winner.runs for op, winner in choice.op_choices(shapes).items()}


def _takes_anything(monkeypatch) -> None:
    """The CPU tensors of these tests pass for CUDA ones: every candidate takes them."""
    for module in (layer_norm, dropout_layer_norm, bias_gelu, attention, cross_entropy):
        monkeypatch.setattr(module, "_unsupported", lambda impl, *inputs: "")


# --------------------------------------------------------------------------- the race

def test_a_fused_kernel_slower_than_native_is_not_used(auto):
    auto.costs("bias_gelu", native=2.0, fused=3.0)
    auto.costs("varlen_attention", native=1.0, fused=1.0)  # a tie is no reason to run a kernel
    plan = resolve_backend("auto", SHAPES)
    assert plan == OpPlan((("layer_norm", "fused"), ("dropout_add_layer_norm", "fused"), ("bias_gelu", "native"),
                           ("varlen_attention", "native"), ("mlm_cross_entropy", "fused"), ("lamb_update", "fused")),
                          SHAPES.key)
    choices = choice.op_choices(SHAPES)
    assert choices["bias_gelu"].wall_ms == pytest.approx({"native": 2.0, "fused": 3.0, "compiled": 3.0})
    assert len(auto.clock.timed) == TIMED_PER_RACE and set(auto.clock.timed) == {torch.device("cpu")}


def test_a_candidate_faster_on_the_device_but_slower_in_wall_time_loses(auto):
    # (wall, device) ms: varlen_attn is the fastest on the device, the slowest to launch (as on an
    # H100: about 460 us of host time per call against 130 for the fused op); the step pays the wall time.
    auto.costs("varlen_attention", native=(2.0, 1.9), fused=(1.2, 1.0), varlen_attn=(2.5, 0.4))
    auto.costs("bias_gelu", native=(2.0, 2.0), fused=(2.2, 0.5), compiled=(3.0, 3.0))
    plan = resolve_backend("auto", SHAPES)
    assert plan.winner("varlen_attention") == "fused" and plan.winner("bias_gelu") == "native"
    attention_choice = choice.op_choices(SHAPES)["varlen_attention"]
    assert attention_choice.runner_up == "native" and attention_choice.margin == pytest.approx(2.0 / 1.2)
    record = json.loads(_build.verdict_path().read_text())[RECORDED]["ops"]
    assert record["varlen_attention"]["wall_ms"]["varlen_attn"] == pytest.approx(2.5)
    assert record["varlen_attention"]["device_ms"]["varlen_attn"] == pytest.approx(0.4)
    assert record["bias_gelu"]["wall_ms"] == pytest.approx({"native": 2.0, "fused": 2.2, "compiled": 3.0})
    assert record["bias_gelu"]["device_ms"] == pytest.approx({"native": 2.0, "fused": 0.5, "compiled": 3.0})
    assert record["bias_gelu"]["runs"] == "native" and record["bias_gelu"]["runner_up"] == "fused"


def test_a_wall_time_tie_goes_to_native_whatever_the_device_says(auto):
    auto.costs("layer_norm", native=(2.0, 2.0), fused=(2.0, 0.5), compiled=(2.0, 1.0))
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices(SHAPES)["layer_norm"]
    assert winner.runs == "native" and winner.margin == pytest.approx(1.0)
    assert winner.describe().startswith("runs native (as fast as fused; wall (device) per call: native 2.000 ms "
                                        "(2.000), fused 2.000 ms (0.500), ")


def test_every_candidate_is_timed_and_the_fastest_wins(auto):
    auto.costs("varlen_attention", native=2.0, fused=1.5, compiled=1.8, varlen_attn=1.4, flash_attn=1.35,
               sdpa_flash=1.3, sdpa_efficient=1.2, sdpa_cudnn=0.9)
    auto.costs("layer_norm", compiled=0.5)
    auto.costs("bias_gelu", native=1.5, fused=2.0, compiled=2.0)
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices(SHAPES)["varlen_attention"]
    assert winner.runs == "sdpa_cudnn" and list(winner.wall_ms) == list(speed.IMPLEMENTATIONS["varlen_attention"])
    assert winner.wall_ms == pytest.approx({"native": 2.0, "fused": 1.5, "compiled": 1.8, "varlen_attn": 1.4,
                                       "flash_attn": 1.35, "sdpa_flash": 1.3, "sdpa_efficient": 1.2,
                                       "sdpa_cudnn": 0.9})
    assert _runs()["layer_norm"] == "compiled" and _runs()["bias_gelu"] == "native"


def test_the_race_times_attention_on_the_models_one_projection(auto, monkeypatch):
    """The model hands attention q, k and v as views of one (T, 3, nh, hd) projection, which the
    fused kernel reads in place through its packed form: the race times every candidate so
    (one given three separate tensors is charged 100 times its cost here)."""
    def on_one_projection(cost):
        def charge(q, k, v, *rest):
            one_projection = k.data_ptr() - q.data_ptr() == q.shape[1] * q.shape[2] * q.element_size()
            return cost if one_projection else 100 * cost
        return charge
    auto.costs("varlen_attention", native=on_one_projection(2.0), fused=on_one_projection(1.0))
    packed = []
    fused = attention.PACKED_IMPLEMENTATIONS["fused"]
    monkeypatch.setitem(attention.PACKED_IMPLEMENTATIONS, "fused",
                        lambda qkv, *rest: packed.append(tuple(qkv.shape[1:])) or fused(qkv, *rest))
    resolve_backend("auto", SHAPES)
    ms = choice.op_choices(SHAPES)["varlen_attention"].wall_ms
    assert ms["native"] == pytest.approx(2.0) and ms["fused"] == pytest.approx(1.0)
    assert packed and set(packed) == {(3, SHAPES.num_heads, SHAPES.head_dim)}


def test_the_record_says_what_won_and_by_how_much(auto):
    auto.costs("varlen_attention", fused=2.5, sdpa_efficient=1.25, sdpa_cudnn=1.5)
    resolve_backend("auto", SHAPES)
    section = json.loads(_build.verdict_path().read_text())[RECORDED]
    attention_record = section["ops"]["varlen_attention"]
    assert attention_record["runs"] == "sdpa_efficient" and attention_record["runner_up"] == "sdpa_cudnn"
    assert attention_record["margin"] == pytest.approx(1.2)
    assert section["candidates"] == speed.candidate_names()
    assert choice.op_choices(SHAPES)["varlen_attention"].describe().startswith(
        "runs sdpa_efficient (1.20x faster than sdpa_cudnn; wall (device) per call: native 2.000 ms (2.000), "
        "fused 2.500 ms (2.500), ")
    assert choice.op_choices(SHAPES)["lamb_update"].describe() == (
        "runs fused (2.00x faster than native; wall (device) per call: native 2.000 ms (2.000), fused 1.000 ms "
        "(1.000))")


def test_the_public_ops_run_the_winner(auto, monkeypatch):
    auto.costs("bias_gelu", native=2.0, fused=3.0)
    plan = resolve_backend("auto", SHAPES)
    _takes_anything(monkeypatch)
    auto.calls.clear()
    x, bias = torch.randn(3, 16), torch.randn(16)
    kernels.layer_norm(x, torch.ones(16), bias, 1e-12, x, backend=plan)
    out = kernels.bias_gelu(x, bias, "none", backend=plan)
    assert auto.calls == [("layer_norm", "fused")]
    assert torch.equal(out, kernels.bias_gelu_native(x, bias, "none"))


def test_inputs_the_winner_cannot_take_run_the_native_op(auto, caplog):
    plan = resolve_backend("auto", SHAPES)
    auto.calls.clear()
    x, bias = torch.randn(3, 16), torch.randn(16)  # CPU tensors: the fused kernels decline them
    with caplog.at_level(logging.WARNING, logger="bert_ds.kernels.dispatch"):
        out = kernels.layer_norm(x, torch.ones(16), bias, 1e-12, backend=plan)
    assert not auto.calls and torch.equal(out, kernels.layer_norm_native(x, torch.ones(16), bias, 1e-12))
    assert "layer_norm runs the native op where fused cannot: its inputs are not all on a CUDA device" in caplog.text


def test_a_fused_kernel_that_failed_its_self_check_is_not_a_candidate(auto, monkeypatch):
    monkeypatch.setattr(selfcheck, "run_all", lambda: {"layer_norm": "out: error 9 > 2 x 0 + 0", "bias_gelu": "",
                                                       "varlen_attention": "", "lamb_update": ""})
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices(SHAPES)["layer_norm"]
    assert winner.runs == "native" and set(winner.wall_ms) == {"native", "compiled", "liger"}  # fused never timed
    assert winner.excluded == {"fused": "failed the self-check: out: error 9 > 2 x 0 + 0",
                               "apex": "apex is not installed"}


def test_a_candidate_that_raises_at_the_model_s_shapes_is_not_a_candidate(auto, monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this head dim\nmore detail")
    monkeypatch.setitem(attention.PACKED_IMPLEMENTATIONS, "fused", broken)  # what the race times: the model's form
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices(SHAPES)["varlen_attention"]
    assert winner.runs == "native" and winner.excluded["fused"] == "raised RuntimeError: no kernel for this head dim"


def test_a_candidate_that_is_wrong_at_the_model_s_shapes_is_not_a_candidate(auto, monkeypatch):
    # The fastest, and off by 5%: the check at the race's own inputs leaves it out before timing.
    wrong = auto.clock.charging(0.1, lambda *args: layer_norm.layer_norm_ref(*args) * 1.05)
    monkeypatch.setitem(layer_norm.IMPLEMENTATIONS, "compiled", wrong)
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices(SHAPES)["layer_norm"]
    assert winner.runs == "fused" and "compiled" not in winner.wall_ms
    assert winner.excluded["compiled"].startswith("wrong at these shapes: torch.float32 out: error ")


def test_the_race_times_forward_and_backward_at_the_model_s_shapes(auto, monkeypatch):
    seen = []

    def native(x, weight, bias, eps, residual=None):
        seen.append((tuple(x.shape), x.dtype, x.requires_grad))
        return auto.natives["layer_norm"](x, weight, bias, eps, residual)
    auto.costs("layer_norm", fused=1.0)
    monkeypatch.setitem(layer_norm.IMPLEMENTATIONS, "native", native)
    resolve_backend("auto", SHAPES)
    assert seen and set(seen) == {((sum(SHAPES.lengths()), 16), torch.float32, True)}


def test_the_mlm_loss_is_raced_on_the_masked_rows_at_the_decoder_s_padded_width(auto, monkeypatch):
    seen = []

    def native(logits, labels):
        seen.append((tuple(logits.shape), bool(torch.isinf(logits[:, 50:]).all()), int(labels.max())))
        return auto.natives["mlm_cross_entropy"](logits, labels)
    monkeypatch.setitem(cross_entropy.IMPLEMENTATIONS, "native", native)
    shapes = dataclasses.replace(SHAPES, tokens=40, vocab=50)
    resolve_backend("auto", shapes)
    assert seen and {s[:2] for s in seen} == {((6, 56), True)} and max(s[2] for s in seen) < 50


def test_a_candidate_that_miscounts_the_right_predictions_is_not_a_candidate(auto, monkeypatch):
    # The loss and its gradient right, the count one off: the rule's tolerance would pass it, the race does not.
    def miscounting(logits, labels):
        loss, correct = cross_entropy.mlm_cross_entropy_ref(logits, labels)
        return loss, correct + 1
    monkeypatch.setitem(cross_entropy.IMPLEMENTATIONS, "fused", auto.clock.charging(0.5, miscounting))
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices(SHAPES)["mlm_cross_entropy"]
    assert winner.runs == "native" and "fused" not in winner.wall_ms
    assert winner.excluded["fused"].startswith("wrong at these shapes: torch.float32: 1 where the reference gives 0")


# --------------------------------------------------------------------------- the default clock

class SimulatedGPU:
    """A device the host queues work on, for the default clock's CUDA path: the host's clock
    moves by each launch's host cost; the device runs its queue in order, each piece once it
    is launched and the device is free, and an event is reached once the work before it is done."""

    def __init__(self) -> None:
        self.host = 0.0  # seconds
        self.idle_at = 0.0  # when the device has done all that is queued

    def launch(self, host_s: float, device_s: float) -> None:
        self.host += host_s
        self.idle_at = max(self.idle_at, self.host) + device_s

    def synchronize(self, *device) -> None:
        self.host = max(self.host, self.idle_at)

    def event(self, enable_timing: bool = False):
        gpu = self

        class Event:
            def record(self) -> None:
                self.at = max(gpu.idle_at, gpu.host)

            def synchronize(self) -> None:
                gpu.host = max(gpu.host, self.at)

            def elapsed_time(self, end) -> float:
                return (end.at - self.at) * 1e3
        return Event()


@pytest.fixture
def gpu(monkeypatch):
    simulated = SimulatedGPU()
    monkeypatch.setattr(torch.cuda, "Event", simulated.event)
    monkeypatch.setattr(torch.cuda, "synchronize", simulated.synchronize)
    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=lambda: simulated.host))
    return simulated


def test_the_wall_clock_counts_what_the_launches_left_queued_and_not_what_came_before(gpu, monkeypatch):
    monkeypatch.setattr(speed, "SAMPLES", 1)  # the one sample right after the untimed call and its queue
    calls = []

    def run():  # the device's work outlasts the launches: the run ends when the device's queue does
        if not calls:
            gpu.launch(0.0, 1.0)  # the untimed first call leaves a second of work queued
        calls.append(None)
        gpu.launch(10e-6, 300e-6)
    timing = speed.best_seconds_per_call(run, torch.device("cuda", 0))
    assert len(calls) == 1 + speed.SAMPLES * speed.CALLS_PER_SAMPLE
    # per call: 300 us of the device's, and the first launch's 10 us before the device starts
    assert timing.wall == pytest.approx(301e-6) and timing.device == pytest.approx(301e-6)


def test_the_wall_clock_counts_the_launches_where_they_outlast_the_device_s_work(gpu):
    def run():  # a costly launch (Python, checks, a host copy) for a little of the device's work
        gpu.launch(460e-6, 100e-6)
    timing = speed.best_seconds_per_call(run, torch.device("cuda", 0))
    assert timing.wall == pytest.approx((10 * 460e-6 + 100e-6) / 10)
    assert timing.device == pytest.approx(timing.wall)  # the device waited for the host between calls


def test_on_a_cpu_the_device_s_time_is_the_wall_time(monkeypatch):
    host = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=lambda: host.now))
    # the untimed call, then each sample's calls: the best sample decides
    costs = iter([9.0] + [cost for cost in (2e-3, 1e-3, 3e-3, 1e-3, 5e-3) for _ in range(speed.CALLS_PER_SAMPLE)])

    def run():
        host.now += next(costs)
    timing = speed.best_seconds_per_call(run, torch.device("cpu"))
    assert timing == speed.Timing(pytest.approx(1e-3), pytest.approx(1e-3))


# --------------------------------------------------------------------------- one plan per model's shapes

def _attention_costs(fused_at_8: float, efficient_at_8: float, fused_at_16: float, efficient_at_16: float):
    """Attention's costs by the call's max_seqlen (its fifth argument): one set per phase."""
    return {"fused": lambda *args: fused_at_8 if args[4] == 8 else fused_at_16,
            "sdpa_efficient": lambda *args: efficient_at_8 if args[4] == 8 else efficient_at_16}


def _model(train_seq_len: int):
    from bert_ds.model.bert.model import BertForPreTraining
    from bert_ds.model.bert.config import ModelConfig

    config = ModelConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=64,
                         max_position_embeddings=16, kernels="auto")
    return BertForPreTraining(config, train_seq_len=train_seq_len)


def test_each_phase_s_model_runs_the_winners_at_its_own_sequence_length(auto, monkeypatch):
    # Phase 1 (seq 8): the fused kernel the fastest; phase 2 (seq 16): memory-efficient SDPA.
    auto.costs("varlen_attention", **_attention_costs(fused_at_8=1.0, efficient_at_8=3.0,
                                                       fused_at_16=4.0, efficient_at_16=1.5))
    phase_1, phase_2 = _model(8), _model(16)  # one process, as bert_ds.train.phases builds them
    assert phase_1.backend.winner("varlen_attention") == "fused"
    assert phase_2.backend.winner("varlen_attention") == "sdpa_efficient"
    assert phase_1.backend.shapes != phase_2.backend.shapes

    _takes_anything(monkeypatch)
    hidden, cu_seqlens = torch.randn(12, 16), torch.tensor([0, 5, 12], dtype=torch.int32)
    for model, ran in ((phase_1, "fused"), (phase_2, "sdpa_efficient"), (phase_1, "fused")):
        auto.calls.clear()
        model.bert.encoder.layer[0].attention.self(hidden, cu_seqlens, 7)
        assert auto.calls == [("varlen_attention", ran)]

    record = json.loads(_build.verdict_path().read_text())
    for model, ran in ((phase_1, "fused"), (phase_2, "sdpa_efficient")):
        section = record[f"choices {model.op_shapes.key}"]
        assert section["ops"]["varlen_attention"]["runs"] == ran
        assert section["shapes"]["max_seqlen"] == model.op_shapes.max_seqlen


def test_a_plan_read_back_from_the_record_dispatches_the_same(auto, monkeypatch):
    auto.costs("varlen_attention", **_attention_costs(fused_at_8=1.0, efficient_at_8=3.0,
                                                       fused_at_16=4.0, efficient_at_16=1.5))
    raced = {shapes: resolve_backend("auto", shapes) for shapes in (SHAPES, PHASE_2)}
    timed = len(auto.clock.timed)

    auto.new_process()
    read = {shapes: resolve_backend("auto", shapes) for shapes in (SHAPES, PHASE_2)}
    assert len(auto.clock.timed) == timed  # read, not raced
    assert read == raced and read[SHAPES] != read[PHASE_2]
    _takes_anything(monkeypatch)
    q = torch.randn(12, 2, 8)
    for shapes, ran in ((SHAPES, "fused"), (PHASE_2, "sdpa_efficient")):
        auto.calls.clear()
        kernels.varlen_attention(q, q, q, torch.tensor([0, 5, 12], dtype=torch.int32), 7, backend=read[shapes])
        assert auto.calls == [("varlen_attention", ran)]


def test_a_plan_is_a_constant_to_torch_compile():
    from torch._dynamo.testing import CompileCounter

    def run(x, bias, plan):
        return kernels.bias_gelu(x, bias, "tanh", backend=plan)
    counter = CompileCounter()
    compiled = torch.compile(run, fullgraph=True, backend=counter)  # fullgraph: a break would be an error
    plan = OpPlan((("bias_gelu", "native"),), "shapes")
    x, bias = torch.randn(4, 8), torch.randn(8)
    assert torch.allclose(compiled(x, bias, plan), kernels.bias_gelu_native(x, bias, "tanh"))
    compiled(torch.randn(4, 8), bias, plan)
    assert counter.frame_count == 1


def test_a_plan_names_only_the_ops_it_raced():
    with pytest.raises(ValueError, match="lamb_update was not raced"):
        OpPlan((("bias_gelu", "native"),), "shapes").winner("lamb_update")


# --------------------------------------------------------------------------- kernels=cuda and torch

def test_cuda_forces_every_fused_kernel_even_a_slower_one_and_races_nothing(auto):
    for op in dispatch.OPS:
        auto.costs(op, native=1.0, fused=5.0)
    assert resolve_backend("cuda") == "cuda"
    assert all(dispatch.choose(op, "cuda", lambda impl: "") == "fused" for op in dispatch.OPS)
    assert not auto.clock.timed and not _build.verdict_path().read_text().count('"choices"')


def test_torch_runs_native_and_races_nothing(auto):
    assert resolve_backend("torch", SHAPES) == "torch"
    assert dispatch.choose("layer_norm", "torch", lambda impl: "") == "native"
    assert not auto.clock.timed


# --------------------------------------------------------------------------- the record

def test_the_verdict_is_recorded_under_its_shapes_and_a_later_process_reads_it(auto):
    plan = resolve_backend("auto", SHAPES)
    first = choice.op_choices(SHAPES)
    record = json.loads(_build.verdict_path().read_text())
    assert record["key"]["device"] == "Fake H100" and record[RECORDED]["shapes"]["hidden"] == 16
    assert set(record) == {"key", "selfcheck", RECORDED}
    timed = len(auto.clock.timed)

    auto.new_process()
    assert resolve_backend("auto", SHAPES) == plan  # the same shapes: the record holds
    assert len(auto.clock.timed) == timed
    assert {op: c.to_json() for op, c in choice.op_choices(SHAPES).items()} == {
        op: c.to_json() for op, c in first.items()}


def test_a_model_of_other_shapes_races_its_own(auto):
    # A tiny model's verdict (the main job's) must not decide for a BERT-Base on the same GPU.
    resolve_backend("auto", SHAPES)
    timed = len(auto.clock.timed)
    auto.new_process()
    other = dataclasses.replace(SHAPES, hidden=32)
    resolve_backend("auto", other)
    assert len(auto.clock.timed) > timed
    assert set(json.loads(_build.verdict_path().read_text())) == {"key", "selfcheck", RECORDED,
                                                                  f"choices {other.key}"}


def test_a_race_recorded_with_other_candidates_is_raced_again(auto):
    # A record made before a candidate joined (same kernel sources, older bert_ds) never names it.
    resolve_backend("auto", SHAPES)
    path = _build.verdict_path()
    record = json.loads(path.read_text())
    record[RECORDED]["candidates"]["varlen_attention"] = ["native", "fused"]
    path.write_text(json.dumps(record))
    assert _raced_again(auto)
    assert json.loads(path.read_text())[RECORDED]["candidates"] == speed.candidate_names()


def test_a_race_recorded_by_an_earlier_version_of_the_race_is_raced_again(auto):
    # Same candidates, timed another way (attention on three tensors before RACE_VERSION 2).
    resolve_backend("auto", SHAPES)
    path = _build.verdict_path()
    record = json.loads(path.read_text())
    del record[RECORDED]["race"]
    path.write_text(json.dumps(record))
    assert _raced_again(auto)
    assert json.loads(path.read_text())[RECORDED]["race"] == speed.RACE_VERSION


def test_the_race_runs_on_a_training_micro_batch_of_tokens():
    lengths = speed.OpShapes().lengths()
    assert sum(lengths) >= 32768 and set(lengths) == {128, 64} and lengths.count(64) == len(lengths) // 10


def _raced_again(auto) -> bool:
    timed = len(auto.clock.timed)
    auto.new_process()
    resolve_backend("auto", SHAPES)
    return len(auto.clock.timed) > timed


def test_another_device_races_again(auto, monkeypatch):
    resolve_backend("auto", SHAPES)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake A100")
    assert _raced_again(auto)
    assert not _raced_again(auto)


def _stand_in_built_for_these_sources() -> None:
    """The prebuilt stand-in as rebuilt for what the source hash now covers."""
    _build.source_hash.cache_clear()
    sys.modules[_build.EXTENSION_NAME].source_hash = _build.source_hash()


def test_another_torch_races_again(auto, monkeypatch):
    resolve_backend("auto", SHAPES)
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    _stand_in_built_for_these_sources()
    assert _raced_again(auto)


def test_other_kernel_sources_race_again(auto, monkeypatch, tmp_path):
    resolve_backend("auto", SHAPES)
    edited = tmp_path / "csrc"
    edited.mkdir()
    for path in _build.CSRC.iterdir():
        if path.is_file():
            (edited / path.name).write_bytes(path.read_bytes())
    with open(edited / "layer_norm.cu", "a") as source:
        source.write("// an edit\n")
    monkeypatch.setattr(_build, "CSRC", edited)
    _stand_in_built_for_these_sources()
    assert _raced_again(auto)


def test_a_record_made_under_another_key_is_not_read(auto):
    resolve_backend("auto", SHAPES)
    path = _build.verdict_path()
    record = json.loads(path.read_text())
    record["key"]["cuda"] = "12.4"
    path.write_text(json.dumps(record))
    assert _raced_again(auto)


# --------------------------------------------------------------------------- apex

def _apex_stand_in(x, weight, bias, normalized_shape, eps):
    """apex's fused_layer_norm_affine, as far as its results go (fp32 inside, like apex's kernel)."""
    return F.layer_norm(x.float(), normalized_shape, weight.float(), bias.float(), eps).to(x.dtype)


def test_apex_layer_norm_joins_the_candidates_and_wins_when_fastest(auto, monkeypatch):
    monkeypatch.setattr(layer_norm, "APEX_LAYER_NORM", _apex_stand_in)
    auto.costs("layer_norm", native=2.0, fused=1.0)
    monkeypatch.setitem(layer_norm.IMPLEMENTATIONS, "apex", auto.clock.charging(0.5, layer_norm.layer_norm_apex))
    assert resolve_backend("auto", SHAPES).winner("layer_norm") == "apex"
    winner = choice.op_choices(SHAPES)["layer_norm"]
    assert winner.wall_ms == pytest.approx({"native": 2.0, "fused": 1.0, "compiled": 3.0, "apex": 0.5, "liger": 3.0})
    assert "apex" not in choice.op_choices(SHAPES)["bias_gelu"].wall_ms


def test_a_wrong_apex_fails_its_self_check_and_is_not_a_candidate(auto, monkeypatch):
    def wrong(x, weight, bias, normalized_shape, eps):
        return _apex_stand_in(x, weight, bias, normalized_shape, eps) * 1.05
    monkeypatch.setattr(layer_norm, "APEX_LAYER_NORM", wrong)
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices(SHAPES)["layer_norm"]
    assert winner.runs == "fused" and "apex" not in winner.wall_ms
    assert winner.excluded["apex"].startswith("failed the self-check: torch.float32 (96, 768) +residual out: error")


def test_without_the_extension_a_gpu_races_the_other_candidates(auto, monkeypatch, caplog):
    monkeypatch.setattr(_build, "_prebuilt", lambda: None)  # and the fixture's JIT build builds nothing
    monkeypatch.setattr(layer_norm, "APEX_LAYER_NORM", _apex_stand_in)
    monkeypatch.setitem(layer_norm.IMPLEMENTATIONS, "apex", auto.clock.charging(0.5, layer_norm.layer_norm_apex))
    auto.costs("bias_gelu", compiled=1.5)
    auto.costs("varlen_attention", sdpa_cudnn=1.0)
    with caplog.at_level(logging.WARNING, logger="bert_ds.kernels.choice"):
        plan = resolve_backend("auto", SHAPES)
    assert plan.runs == (("layer_norm", "apex"), ("dropout_add_layer_norm", "native"), ("bias_gelu", "compiled"),
                         ("varlen_attention", "sdpa_cudnn"), ("mlm_cross_entropy", "native"), ("lamb_update", "native"))
    excluded = choice.op_choices(SHAPES)["bias_gelu"].excluded
    assert excluded["fused"] == "the fused CUDA kernels cannot load: tests build nothing"
    assert "the fused CUDA kernels cannot load (tests build nothing); racing the other candidates" in caplog.text


def test_apex_takes_only_inputs_of_one_dtype():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert "mixed dtypes" in layer_norm._unsupported("apex", x, torch.ones(8), torch.zeros(8), None)
    assert "CUDA device" in layer_norm._unsupported("apex", x, torch.ones(8, dtype=torch.bfloat16),
                                                    torch.zeros(8, dtype=torch.bfloat16), None)


# --------------------------------------------------------------------------- the log

def test_the_choice_is_logged_once_per_shapes_with_its_margin_and_timings(auto, caplog):
    auto.costs("bias_gelu", native=2.0, fused=3.0)
    with caplog.at_level(logging.INFO, logger="bert_ds.kernels"):
        for shapes in (SHAPES, SHAPES, PHASE_2):  # two models of one size, then phase 2's
            resolve_backend("auto", shapes)
    logged = [r.getMessage() for r in caplog.records if r.name == "bert_ds.kernels.choice"]
    choices = [m for m in logged if " runs " in m]  # beside them: the self-check's and the race's lines
    assert sorted(m for m in choices if "at seq 8:" in m) == [
        "kernels=auto at seq 8: bias_gelu runs native (1.50x faster than fused; wall (device) per call: "
        "native 2.000 ms (2.000), fused 3.000 ms (3.000), compiled 3.000 ms (3.000))",
        "kernels=auto at seq 8: dropout_add_layer_norm runs fused (2.00x faster than native; wall (device) per call: "
        "native 2.000 ms (2.000), fused 1.000 ms (1.000), compiled 3.000 ms (3.000))",
        "kernels=auto at seq 8: lamb_update runs fused (2.00x faster than native; wall (device) per call: "
        "native 2.000 ms (2.000), fused 1.000 ms (1.000))",
        "kernels=auto at seq 8: layer_norm runs fused (2.00x faster than native; wall (device) per call: "
        "native 2.000 ms (2.000), fused 1.000 ms (1.000), compiled 3.000 ms (3.000), liger 3.000 ms (3.000)); "
        "apex not a candidate: apex is not installed",
        "kernels=auto at seq 8: mlm_cross_entropy runs fused (2.00x faster than native; wall (device) per call: "
        "native 2.000 ms (2.000), fused 1.000 ms (1.000), compiled 3.000 ms (3.000))",
        "kernels=auto at seq 8: varlen_attention runs fused (2.00x faster than native; wall (device) per call: "
        "native 2.000 ms (2.000), fused 1.000 ms (1.000), compiled 3.000 ms (3.000), varlen_attn 3.000 ms (3.000), "
        "flash_attn 3.000 ms (3.000), sdpa_flash 3.000 ms (3.000), sdpa_efficient 3.000 ms (3.000), "
        "sdpa_cudnn 3.000 ms (3.000))",
    ]
    assert len(choices) == 2 * len(RACED_HERE) and sum("at seq 16:" in m for m in choices) == len(RACED_HERE)
    races = [r.getMessage() for r in caplog.records if "timing each op's candidates" in r.getMessage()]
    assert races == [f"kernels=auto: timing each op's candidates on Fake H100 at {shapes.describe()}"
                     for shapes in (SHAPES, PHASE_2)]


def test_the_model_has_its_own_shapes_timed(auto):
    from bert_ds.model.bert.model import BertForPreTraining
    from bert_ds.model.bert.config import ModelConfig

    config = ModelConfig(vocab_size=50, hidden_size=24, num_layers=1, num_heads=3, intermediate_size=40,
                         max_position_embeddings=12, hidden_act="gelu_tanh", kernels="auto")
    model = BertForPreTraining(config)
    assert isinstance(model.backend, OpPlan) and model.backend.shapes == model.op_shapes.key
    record = json.loads(_build.verdict_path().read_text())
    shapes = next(v for k, v in record.items() if k.startswith("choices "))["shapes"]
    assert (shapes["hidden"], shapes["intermediate"], shapes["num_heads"], shapes["max_seqlen"],
            shapes["approximate"], shapes["vocab"]) == (24, 40, 3, 12, "tanh", 50)
    BertForPreTraining(config, train_seq_len=6)  # the trainer passes its sequence length: the race runs at it
    record = json.loads(_build.verdict_path().read_text())
    assert sorted(v["shapes"]["max_seqlen"] for k, v in record.items() if k.startswith("choices ")) == [6, 12]


def test_a_model_with_local_layers_and_geglu_races_them_and_bert_does_not(auto, monkeypatch):
    """A ModernBERT-class model's shapes carry its window and its GeGLU MLP: its plan holds the local
    attention's winner among the fused kernel and PyTorch's candidates, raced at that window, and GeGLU's
    among the fused kernel, the native op and the compiled reference; a BERT's plan has neither."""
    from bert_ds.model.families import model_preset
    from bert_ds.model.modernbert.model import ModernBertForPreTraining

    monkeypatch.setattr(backend, "OpShapes", functools.partial(speed.OpShapes, tokens=64))  # as the fixture's BERT

    auto.costs("local_attention", fused=(2.5, 0.2), flex=(1.0, 1.0), varlen_attn=(4.0, 0.5))
    auto.costs("geglu", native=2.0, fused=1.5, compiled=1.0)
    config = model_preset("modernbert-tiny", 50, hidden_size=16, intermediate_size=24, local_attention=6)
    model = ModernBertForPreTraining(config, train_seq_len=8)
    assert model.op_shapes.window == 3 and "window 3" in model.op_shapes.key
    assert model.backend.winner("local_attention") == "flex"
    verdict = choice.op_choices(model.op_shapes)["local_attention"]
    assert set(verdict.wall_ms) == {"native", "fused", "varlen_attn", "flash_attn", "flex", "sdpa_efficient"}
    assert model.op_shapes.geglu and not model.op_shapes.layer_norm_bias
    assert model.op_shapes.rotary and model.op_shapes.key.endswith(" geglu layernorm plain rotary")
    assert model.backend.winner("geglu") == "compiled"
    assert set(choice.op_choices(model.op_shapes)["geglu"].wall_ms) == {"native", "fused", "compiled", "liger"}
    bert_plan = _model(8).backend
    assert not bert_plan.has("local_attention") and not bert_plan.has("geglu")


ROTARY = dataclasses.replace(SHAPES, window=3, rotary=True)  # a rotary model with local layers


def test_a_rotary_model_races_attention_with_the_rotation_each_candidate_runs_with(auto, monkeypatch):
    """In a rotary model the fused kernels rotate q and k as they load them; every other candidate runs
    after the model rotates them in PyTorch, and is timed so: here the rotation costs 0.6 ms a call (q
    and k: 1.2 per attention), which makes the fused kernel (2.0) win over native (1.0 + 1.2). Without
    rotary embeddings nothing is rotated and native wins."""
    rotations = []

    def charged_rotation(x, cos, sin):
        rotations.append(x.shape)
        auto.clock.now += 0.6 * MS
        auto.clock.device_now += 0.6 * MS
        return APPLY_ROTARY(x, cos, sin)
    monkeypatch.setattr(rotary_attention, "apply_rotary", charged_rotation)
    for op in ATTENTION_OPS:
        auto.costs(op, native=1.0, fused=2.0)
    for op, verdict in choice.op_choices(ROTARY).items():
        if op in ATTENTION_OPS:
            assert verdict.runs == "fused", (op, verdict.wall_ms)
            assert verdict.wall_ms["native"] == pytest.approx(2.2) and verdict.wall_ms["fused"] == pytest.approx(2.0)
    assert rotations and set(rotations) == {(sum(ROTARY.lengths()), ROTARY.num_heads, ROTARY.head_dim)}

    rotations.clear()
    plain = dataclasses.replace(ROTARY, rotary=False)
    assert {op: verdict.runs for op, verdict in choice.op_choices(plain).items() if op in ATTENTION_OPS} == {
        "varlen_attention": "native", "local_attention": "native"}
    assert not rotations and ROTARY.key == plain.key + " rotary"


def test_a_rotary_candidate_that_does_not_rotate_is_not_a_candidate(auto, monkeypatch):
    """The rotary race holds each candidate to the rotary reference: a fused form that leaves q and k
    as they are is wrong at the model's shapes, and excluded with the reason."""
    def unrotated(qkv, cu_seqlens, max_seqlen, rope_theta, window=None, dropout_p=0.0):
        return auto.rotary["local_attention"](*qkv.unbind(1), cu_seqlens, max_seqlen, window)
    monkeypatch.setitem(rotary_attention.ROTARY_IMPLEMENTATIONS, "fused", unrotated)
    verdict = choice.op_choices(ROTARY)["local_attention"]
    assert "fused" not in verdict.wall_ms and verdict.excluded["fused"].startswith("wrong at these shapes")


def test_the_optimizer_follows_the_model_s_plan(auto):
    from bert_ds.optim.lamb import Lamb

    model = _model(8)
    timed = len(auto.clock.timed)
    lamb = Lamb([torch.zeros(4, requires_grad=True)], kernels="auto", shapes=model.op_shapes)
    assert lamb._backend(torch.zeros(4)) is model.backend and len(auto.clock.timed) == timed


# --------------------------------------------------------------------------- what a run records

class PrintedLog:
    """The run's reporter (MetricsLogger.print), keeping what it printed."""

    def __init__(self) -> None:
        self.lines = []

    def print(self, message: str, prefix: str = "bert_ds") -> None:
        self.lines.append(message)


def _phase_model(train_seq_len: int):
    from bert_ds.model.bert.model import BertForPreTraining
    from bert_ds.model.bert.config import ModelConfig

    config = ModelConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=64,
                         max_position_embeddings=512, kernels="auto")
    return BertForPreTraining(config, train_seq_len=train_seq_len)


def test_each_phase_s_run_records_its_race_with_both_clocks(auto, tmp_path):
    from bert_ds.train.kernel_record import record_kernels

    auto.costs("varlen_attention", fused=(1.0, 0.5), varlen_attn=(4.0, 0.25))
    models = {seq: _phase_model(seq) for seq in (128, 512)}  # phase 1's and phase 2's, as bert_ds.train.phases
    timed = len(auto.clock.timed)
    for seq, model in models.items():
        log, output = PrintedLog(), tmp_path / f"phase_{seq}"
        output.mkdir()
        assert record_kernels(log, model, output, rank=1) is None and not list(output.iterdir())  # rank 0 only
        record_kernels(log, model, output, rank=0)
        record = json.loads((output / "kernels.json").read_text())
        assert (record["setting"], record["backend"], record["reason"]) == ("auto", "plan", "")
        assert record["seq"] == record["shapes"]["max_seqlen"] == seq
        assert record["shapes"] == dataclasses.asdict(model.op_shapes) and record["race_version"] == speed.RACE_VERSION
        assert list(record["ops"]) == [op for op, _ in model.backend.runs]
        for op, verdict in record["ops"].items():
            assert verdict["runs"] == model.backend.winner(op)
            assert set(verdict["wall_ms"]) == set(verdict["device_ms"]) == {"native", *STOOD_IN[op]}
            assert {"excluded", "runner_up", "margin"} <= set(verdict)
        attention_verdict = record["ops"]["varlen_attention"]
        assert attention_verdict["wall_ms"]["varlen_attn"] == pytest.approx(4.0)
        assert attention_verdict["device_ms"]["varlen_attn"] == pytest.approx(0.25)
        assert attention_verdict["runs"] == "fused" and attention_verdict["margin"] == pytest.approx(2.0)
        assert log.lines == [f"kernels=auto at seq {seq}: {op} {choice.Choice.from_json(verdict).describe()}"
                             for op, verdict in record["ops"].items()]
    assert len(auto.clock.timed) == timed  # read from the race's record, not raced again


def test_without_a_race_the_record_says_what_runs_and_why(monkeypatch):
    monkeypatch.setattr(choice, "no_cuda", lambda: "no CUDA device")
    resolved = choice.resolution("auto", SHAPES, "torch")
    assert resolved.lines() == ["kernels=auto: the native PyTorch ops run (no CUDA device to race on)"]
    assert resolved.to_json() == {"setting": "auto", "backend": "torch", "reason": "no CUDA device to race on",
                                  "seq": 8, "shapes": dataclasses.asdict(SHAPES), "race_version": None, "ops": {}}
    monkeypatch.setattr(choice, "no_cuda", lambda: "the installed torch (2.13.0+cpu) is a CPU-only build")
    assert choice.resolution("auto", SHAPES, "torch").reason == (
        "no CUDA device to race on: the installed torch (2.13.0+cpu) is a CPU-only build")
    assert choice.resolution("torch", SHAPES).lines() == [
        "kernels=torch: the native PyTorch ops run (as kernels=torch asks)"]
    assert choice.resolution("cuda", SHAPES, "cuda").lines() == [
        "kernels=cuda: the fused CUDA kernels run for every op (as kernels=cuda asks)"]


# --------------------------------------------------------------------------- the candidates themselves

def _varlen_inputs(lengths, num_heads=2, head_dim=8, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), num_heads, head_dim, generator=generator, dtype=dtype) for _ in range(3))
    return q, k, v, torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _forward_backward(fn, q, k, v, cu_seqlens, max_seqlen, softmax_scale=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, cu_seqlens, max_seqlen, 0.0, softmax_scale)
    out.backward(torch.ones_like(out) + torch.arange(out.numel()).view(out.shape) % 3)
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("lengths", [[5, 1, 17, 2], [9, 9], [1]])
@pytest.mark.parametrize("softmax_scale", [None, 0.3])
@pytest.mark.parametrize("layout", ["padded", "nested"])
def test_sdpa_around_a_padded_or_nested_batch_is_the_reference(lengths, softmax_scale, layout):
    # On the math backend, which every CPU has: the padding and its removal (or the nested
    # layout) are what is tested; the backends themselves are PyTorch's.
    wrapper = attention.padded_sdpa if layout == "padded" else attention.nested_sdpa
    q, k, v, cu_seqlens = _varlen_inputs(lengths)

    def math(*args):
        return wrapper(*args, backend=SDPBackend.MATH)
    ours = _forward_backward(math, q, k, v, cu_seqlens, max(lengths), softmax_scale)
    reference = _forward_backward(attention.varlen_attention_ref, q, k, v, cu_seqlens, max(lengths), softmax_scale)
    for name, got, want in zip(("out", "dq", "dk", "dv"), ours, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_the_real_candidates_a_cpu_cannot_run_are_excluded_with_the_reason(auto, monkeypatch):
    # The SDPA backends restricted to one each, varlen_attn and flash-attn, as they are (not stood in).
    for name in ("varlen_attn", "flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn"):
        monkeypatch.setitem(attention.IMPLEMENTATIONS, name, auto.real["varlen_attention"][name])
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices(SHAPES)["varlen_attention"]
    assert set(winner.wall_ms) == {"native", "fused", "compiled"}
    assert winner.excluded["varlen_attn"] == ("raised ValueError: varlen_attn cannot take these inputs: its inputs "
                                              "are not on a CUDA device of compute capability 8.0 or newer")
    assert winner.excluded["flash_attn"] == ("raised ValueError: flash-attn cannot take these inputs: its inputs "
                                             "are not on a CUDA device of compute capability 8.0 or newer")
    for name in ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn"):
        assert winner.excluded[name].startswith("raised RuntimeError: No viable backend for scaled_dot_product")


def test_a_compiled_reference_compiles_once_for_every_token_count():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()  # counts what is compiled and runs it as it is: no Inductor on a CPU in tests
    compiled = CompiledReference(layer_norm.layer_norm_ref, rows=(0, 4), backend=counter)
    weight, bias = torch.randn(16), torch.randn(16)
    for tokens in (5, 7, 12):
        x, residual = torch.randn(tokens, 16), torch.randn(tokens, 16)
        torch.testing.assert_close(compiled(x, weight, bias, 1e-12, residual),
                                   layer_norm.layer_norm_ref(x, weight, bias, 1e-12, residual))
    assert counter.frame_count == 1


def test_compiled_attention_compiles_once_for_every_batch():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = CompiledReference(attention.varlen_attention_ref, dynamic=True, backend=counter)
    for lengths in ([5, 1, 8], [2, 7], [4, 4, 3, 6]):
        q, k, v, cu_seqlens = _varlen_inputs(lengths)
        torch.testing.assert_close(compiled(q, k, v, cu_seqlens, max(lengths)),
                                   attention.varlen_attention_ref(q, k, v, cu_seqlens, max(lengths)))
    assert counter.frame_count == 1


def test_the_op_s_candidates_are_compiled_where_torch_compile_makes_sense():
    assert {op: "compiled" in impls for op, impls in speed.IMPLEMENTATIONS.items()} == {
        "layer_norm": True, "dropout_add_layer_norm": True, "bias_gelu": True, "varlen_attention": True,
        "mlm_cross_entropy": True, "lamb_update": False, "geglu": True,
        "local_attention": False}  # its compiled candidate is FlexAttention's, with the window in its block mask
    assert isinstance(attention.IMPLEMENTATIONS["compiled"], CompiledReference)


@pytest.mark.parametrize("impl, inputs, reason", [
    ("sdpa_flash", {"dtype": torch.float32}, "torch.float32/torch.float32/torch.float32 inputs"),
    ("sdpa_cudnn", {"head_dim": 256}, "head_dim 256 (it takes multiples of 8 up to 128)"),
    ("sdpa_efficient", {"head_dim": 12}, "head_dim 12 (it takes multiples of 8 up to 256)"),
    ("sdpa_efficient", {"dropout_p": 0.1}, "attention dropout"),
    ("compiled", {"dropout_p": 0.1}, "attention dropout"),
    ("sdpa_efficient", {}, "its inputs are not all on a CUDA device"),
    ("compiled", {}, "its inputs are not all on a CUDA device"),
    ("varlen_attn", {}, "its inputs are not on a CUDA device of compute capability 8.0 or newer"),
    ("flash_attn", {}, "its inputs are not on a CUDA device of compute capability 8.0 or newer"),
])
def test_each_candidate_says_which_inputs_it_cannot_take(impl, inputs, reason):
    dtype, head_dim = inputs.get("dtype", torch.bfloat16), inputs.get("head_dim", 64)
    q, k, v, cu_seqlens = _varlen_inputs([3, 5], head_dim=head_dim, dtype=dtype)
    assert reason in attention._unsupported(impl, q, k, v, cu_seqlens, inputs.get("dropout_p", 0.0), None)


def test_the_other_ops_compiled_candidates_decline_only_host_tensors():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert layer_norm._unsupported("compiled", x, torch.ones(8), torch.zeros(8), None) == (
        "its inputs are not all on a CUDA device")
    assert layer_norm._unsupported("apex", x, torch.ones(8, dtype=x.dtype), None, None) == (
        "no bias (apex's affine LayerNorm takes one)")
    assert bias_gelu._unsupported("compiled", x, torch.zeros(8)) == "its inputs are not all on a CUDA device"
    assert dropout_layer_norm._unsupported("compiled", x, None, x, torch.ones(8), torch.zeros(8)) == (
        "its inputs are not all on a CUDA device")


def test_layer_norm_is_raced_as_the_model_calls_it():
    """BERT's post-LN with the residual added in and a bias; ModernBERT's pre-LN with neither
    (OpShapes.layer_norm_bias): each is timed and checked in its own form, under its own key."""
    from bert_ds.kernels.layer_norm import layer_norm_ref

    plain_shapes = dataclasses.replace(SHAPES, layer_norm_bias=False)
    bert_case = speed._case("layer_norm", SHAPES, torch.device("cpu"))
    plain_case = speed._case("layer_norm", plain_shapes, torch.device("cpu"))
    assert set(bert_case.leaves) == {"x", "residual", "weight", "bias"} and set(plain_case.leaves) == {"x", "weight"}
    calls = []

    def recorded(x, weight, bias, eps, residual):
        calls.append((bias, residual))
        return layer_norm_ref(x, weight, bias, eps, residual)
    plain_case.run(recorded)
    assert calls == [(None, None)] and plain_case.check(layer_norm_ref) == []
    assert plain_shapes.key == SHAPES.key + " layernorm plain"
    with pytest.raises(ValueError, match="layer_norm_bias must be True or False"):
        speed.OpShapes(layer_norm_bias=0)
