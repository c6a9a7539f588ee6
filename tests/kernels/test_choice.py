"""How ``kernels=auto`` chooses each op's implementation on a device, on a CPU.

The loader believes it runs on a CUDA device with the extension loaded; the race runs
on the CPU with a fake clock. The native candidates are the real ``<op>_native``, the
fused ones stand-ins (the real fused kernels need a GPU); both are wrapped to charge
the fake clock a set cost per call, and the choice, the record and the dispatch that
follows are the real code.
"""

import importlib
import dataclasses
import json
import logging
import sys

import pytest
import torch
import torch.nn.functional as F

from bert_ds import kernels
from bert_ds.kernels import _build, attention, choice, dispatch, selfcheck, speed
from bert_ds.kernels.choice import resolve_backend

# The modules, which kernels' own names for the public ops hide.
layer_norm = importlib.import_module("bert_ds.kernels.layer_norm")
bias_gelu = importlib.import_module("bert_ds.kernels.bias_gelu")

SHAPES = speed.OpShapes(hidden=16, intermediate=64, num_heads=2, max_seqlen=8, tokens=16, dtype="float32")
RECORDED = f"choices {SHAPES.key}"
MS = 1e-3  # the fake clock counts seconds


class FakeClock:
    """A clock that moves only when a candidate is charged for a call."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timed = []  # one entry per candidate timed

    def timer(self, run, device: torch.device) -> float:
        self.timed.append(device)
        start = self.now
        run()
        return self.now - start

    def charging(self, cost: float, fn):
        def charged(*args, **kwargs):
            self.now += cost
            return fn(*args, **kwargs)
        return charged


def _stand_in_fused(op: str, native, calls: list[str]):
    """A CPU stand-in for ``op``'s fused kernel: the native op, counting its calls."""
    def fused(*args, **kwargs):
        calls.append(op)
        return native(*args, **kwargs)
    return fused


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """A fake CUDA device ("Fake H100") whose extension loads and passes its self-check; the race
    on the CPU with a fake clock. ``auto.costs(op, native=..., fused=...)`` sets what each call costs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H100")
    (tmp_path / f"{_build.EXTENSION_NAME}.py").write_text(f"source_hash = {_build.source_hash()!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(selfcheck, "run_all", lambda: {op: "" for op in speed.OPS})
    clock = FakeClock()
    monkeypatch.setattr(choice, "race_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(choice, "race_timer", clock.timer)
    monkeypatch.setattr(layer_norm, "APEX_LAYER_NORM", None)
    monkeypatch.setattr(_build, "_jit_build", lambda: (None, "tests build nothing"))
    monkeypatch.setattr(choice, "_choices", None)

    class Auto:
        fused_calls: list[str] = []
        natives = {op: impls["native"] for op, impls in speed.IMPLEMENTATIONS.items()}

        @staticmethod
        def costs(op: str, **per_impl: float) -> None:
            for name, cost in per_impl.items():
                native = Auto.natives[op]
                fn = native if name == "native" else _stand_in_fused(op, native, Auto.fused_calls)
                monkeypatch.setitem(speed.IMPLEMENTATIONS[op], name, clock.charging(cost * MS, fn))

        @staticmethod
        def new_process() -> None:
            for cached in (_build.load_extension, choice.op_verdicts, _build.source_hash, choice._auto_backend,
                           choice._log_once, dispatch._log_fallback):
                cached.cache_clear()
            choice._choices = None

    Auto.clock = clock
    Auto.new_process()
    for op in speed.OPS:
        Auto.costs(op, native=2.0, fused=1.0)
    yield Auto
    Auto.new_process()
    sys.modules.pop(_build.EXTENSION_NAME, None)


def _runs() -> dict[str, str]:
    return {op: winner.runs for op, winner in choice.op_choices().items()}


# --------------------------------------------------------------------------- the race

def test_a_fused_kernel_slower_than_native_is_not_used(auto):
    auto.costs("bias_gelu", native=2.0, fused=3.0)
    auto.costs("varlen_attention", native=1.0, fused=1.0)  # a tie is no reason to run a kernel
    assert resolve_backend("auto", SHAPES) == "prefer_cuda"
    choices = choice.op_choices()
    assert _runs() == {"layer_norm": "fused", "bias_gelu": "native", "varlen_attention": "native",
                       "lamb_update": "fused"}
    assert choices["bias_gelu"].ms == pytest.approx({"native": 2.0, "fused": 3.0})
    assert len(auto.clock.timed) == 2 * len(speed.OPS) and set(auto.clock.timed) == {torch.device("cpu")}


def test_the_public_ops_run_the_winner(auto, monkeypatch):
    auto.costs("bias_gelu", native=2.0, fused=3.0)
    resolve_backend("auto", SHAPES)
    monkeypatch.setattr(layer_norm, "_unsupported", lambda impl, *inputs: "")  # CPU tensors, as if on the GPU
    monkeypatch.setattr(bias_gelu, "_unsupported", lambda *inputs: "")
    auto.fused_calls.clear()
    x, bias = torch.randn(3, 16), torch.randn(16)
    kernels.layer_norm(x, torch.ones(16), bias, 1e-12, x, backend="prefer_cuda")
    out = kernels.bias_gelu(x, bias, "none", backend="prefer_cuda")
    assert auto.fused_calls == ["layer_norm"]
    assert torch.equal(out, kernels.bias_gelu_native(x, bias, "none"))


def test_inputs_the_winner_cannot_take_run_the_native_op(auto, caplog):
    resolve_backend("auto", SHAPES)
    auto.fused_calls.clear()
    x, bias = torch.randn(3, 16), torch.randn(16)  # CPU tensors: the fused kernels decline them
    with caplog.at_level(logging.WARNING, logger="bert_ds.kernels.dispatch"):
        out = kernels.layer_norm(x, torch.ones(16), bias, 1e-12, backend="prefer_cuda")
    assert not auto.fused_calls and torch.equal(out, kernels.layer_norm_native(x, torch.ones(16), bias, 1e-12))
    assert "layer_norm runs the native op where fused cannot: its inputs are not all on a CUDA device" in caplog.text


def test_a_fused_kernel_that_failed_its_self_check_is_not_a_candidate(auto, monkeypatch):
    monkeypatch.setattr(selfcheck, "run_all", lambda: {"layer_norm": "out: error 9 > 2 x 0 + 0", "bias_gelu": "",
                                                       "varlen_attention": "", "lamb_update": ""})
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices()["layer_norm"]
    assert winner.runs == "native" and set(winner.ms) == {"native"}  # never timed, though the faster
    assert winner.excluded == {"fused": "failed the self-check: out: error 9 > 2 x 0 + 0",
                               "apex": "apex is not installed"}


def test_a_candidate_that_raises_at_the_model_s_shapes_is_not_a_candidate(auto, monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this head dim\nmore detail")
    monkeypatch.setitem(attention.IMPLEMENTATIONS, "fused", broken)
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices()["varlen_attention"]
    assert winner.runs == "native" and winner.excluded["fused"] == "raised RuntimeError: no kernel for this head dim"


def test_the_race_times_forward_and_backward_at_the_model_s_shapes(auto, monkeypatch):
    seen = []

    def native(x, weight, bias, eps, residual=None):
        seen.append((tuple(x.shape), x.dtype, x.requires_grad))
        return auto.natives["layer_norm"](x, weight, bias, eps, residual)
    auto.costs("layer_norm", fused=1.0)
    monkeypatch.setitem(layer_norm.IMPLEMENTATIONS, "native", native)
    resolve_backend("auto", SHAPES)
    assert seen and set(seen) == {((sum(SHAPES.lengths()), 16), torch.float32, True)}


# --------------------------------------------------------------------------- kernels=cuda and torch

def test_cuda_forces_every_fused_kernel_even_a_slower_one_and_races_nothing(auto):
    for op in speed.OPS:
        auto.costs(op, native=1.0, fused=5.0)
    assert resolve_backend("cuda") == "cuda"
    assert all(dispatch.choose(op, "cuda", lambda impl: "") == "fused" for op in speed.OPS)
    assert not auto.clock.timed and not _build.verdict_path().read_text().count('"choices"')


def test_torch_runs_native_and_races_nothing(auto):
    assert resolve_backend("torch", SHAPES) == "torch"
    assert dispatch.choose("layer_norm", "torch", lambda impl: "") == "native"
    assert not auto.clock.timed


# --------------------------------------------------------------------------- the record

def test_the_verdict_is_recorded_under_its_shapes_and_a_later_process_reads_it(auto):
    resolve_backend("auto", SHAPES)
    first = choice.op_choices()
    record = json.loads(_build.verdict_path().read_text())
    assert record["key"]["device"] == "Fake H100" and record[RECORDED]["shapes"]["hidden"] == 16
    assert set(record) == {"key", "selfcheck", RECORDED}
    timed = len(auto.clock.timed)

    auto.new_process()
    assert resolve_backend("auto", SHAPES) == "prefer_cuda"  # the same shapes: the record holds
    assert len(auto.clock.timed) == timed
    assert {op: c.to_json() for op, c in choice.op_choices().items()} == {op: c.to_json() for op, c in first.items()}


def test_a_model_of_other_shapes_races_its_own(auto):
    # A tiny model's verdict (the main job's) must not decide for a BERT-Base on the same GPU.
    resolve_backend("auto", SHAPES)
    timed = len(auto.clock.timed)
    auto.new_process()
    other = dataclasses.replace(SHAPES, max_seqlen=16)
    resolve_backend("auto", other)
    assert len(auto.clock.timed) > timed
    assert set(json.loads(_build.verdict_path().read_text())) == {"key", "selfcheck", RECORDED,
                                                                  f"choices {other.key}"}


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
    monkeypatch.setitem(layer_norm.IMPLEMENTATIONS, "apex", auto.clock.charging(0.5 * MS, layer_norm.layer_norm_apex))
    assert resolve_backend("auto", SHAPES) == "prefer_cuda"
    winner = choice.op_choices()["layer_norm"]
    assert winner.runs == "apex" and winner.ms == pytest.approx({"native": 2.0, "fused": 1.0, "apex": 0.5})
    assert "apex" not in choice.op_choices()["bias_gelu"].ms


def test_a_wrong_apex_fails_its_self_check_and_is_not_a_candidate(auto, monkeypatch):
    def wrong(x, weight, bias, normalized_shape, eps):
        return _apex_stand_in(x, weight, bias, normalized_shape, eps) * 1.05
    monkeypatch.setattr(layer_norm, "APEX_LAYER_NORM", wrong)
    resolve_backend("auto", SHAPES)
    winner = choice.op_choices()["layer_norm"]
    assert winner.runs == "fused" and "apex" not in winner.ms
    assert winner.excluded["apex"].startswith("failed the self-check: torch.float32 (96, 768) +residual out: error")


def test_apex_alone_makes_auto_time_layer_norm(auto, monkeypatch):
    monkeypatch.setattr(_build, "_prebuilt", lambda: None)  # and the fixture's JIT build builds nothing
    monkeypatch.setattr(layer_norm, "APEX_LAYER_NORM", _apex_stand_in)
    monkeypatch.setitem(layer_norm.IMPLEMENTATIONS, "apex", auto.clock.charging(0.5 * MS, layer_norm.layer_norm_apex))
    assert resolve_backend("auto", SHAPES) == "prefer_cuda"
    assert _runs() == {"layer_norm": "apex", "bias_gelu": "native", "varlen_attention": "native",
                       "lamb_update": "native"}
    excluded = choice.op_choices()["bias_gelu"].excluded
    assert excluded["fused"] == "the fused CUDA kernels cannot load: tests build nothing"


def test_apex_takes_only_inputs_of_one_dtype():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert "mixed dtypes" in layer_norm._unsupported("apex", x, torch.ones(8), torch.zeros(8), None)
    assert "CUDA device" in layer_norm._unsupported("apex", x, torch.ones(8, dtype=torch.bfloat16),
                                                    torch.zeros(8, dtype=torch.bfloat16), None)


# --------------------------------------------------------------------------- the log

def test_the_choice_is_logged_once_with_both_timings(auto, caplog):
    auto.costs("bias_gelu", native=2.0, fused=3.0)
    with caplog.at_level(logging.INFO, logger="bert_ds.kernels"):
        for shapes in (SHAPES, SHAPES, speed.OpShapes()):  # models of one size, then of another
            resolve_backend("auto", shapes)
    logged = [r.getMessage() for r in caplog.records if r.name == "bert_ds.kernels.choice"]
    choices = [m for m in logged if " runs " in m]  # beside them: the self-check's and the race's lines
    assert sorted(choices) == [
        "kernels=auto: bias_gelu runs native (native 2.000 ms, fused 3.000 ms per call)",
        "kernels=auto: lamb_update runs fused (native 2.000 ms, fused 1.000 ms per call)",
        "kernels=auto: layer_norm runs fused (native 2.000 ms, fused 1.000 ms per call); "
        "apex not a candidate: apex is not installed",
        "kernels=auto: varlen_attention runs fused (native 2.000 ms, fused 1.000 ms per call)",
    ]
    races = [r.getMessage() for r in caplog.records if "timing each op's candidates" in r.getMessage()]
    assert races == [f"kernels=auto: timing each op's candidates on Fake H100 at {SHAPES.describe()}"]


def test_the_model_has_its_own_shapes_timed(auto):
    from bert_ds.model.bert import BertForPreTraining, ModelConfig

    config = ModelConfig(vocab_size=50, hidden_size=24, num_layers=1, num_heads=3, intermediate_size=40,
                         max_position_embeddings=12, hidden_act="gelu_tanh", kernels="auto")
    assert BertForPreTraining(config).backend == "prefer_cuda"
    record = json.loads(_build.verdict_path().read_text())
    shapes = next(v for k, v in record.items() if k.startswith("choices "))["shapes"]
    assert (shapes["hidden"], shapes["intermediate"], shapes["num_heads"], shapes["max_seqlen"],
            shapes["approximate"]) == (24, 40, 3, 12, "tanh")
    auto.new_process()  # the trainer passes its sequence length: the race runs at it
    BertForPreTraining(config, train_seq_len=6)
    record = json.loads(_build.verdict_path().read_text())
    assert sorted(v["shapes"]["max_seqlen"] for k, v in record.items() if k.startswith("choices ")) == [6, 12]
