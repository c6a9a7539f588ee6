"""What bert_ds.zero relies on in DeepSpeed, checked on the installed version: the test to read
on a DeepSpeed upgrade.

One probe process (``python -m tests.bert_ds.test_zero --probe OUT``, one CPU rank, gloo)
builds tiny engines (lamb_zero_worker's model and recipe) under ZeRO-0/1/2 in fp32, ZeRO-1 in
bf16 and ZeRO-1 in bf16 with fp32 gradient accumulation, checks every entry of
``bert_ds.zero.RELIED_ON`` on them (one test per entry below), and exercises each function of
bert_ds.zero: the world group's timeout, the flat partitions, the skip protocol, the loss
scale and the full optimizer state. A last test reads bert_ds/zero.py itself: a DeepSpeed name
used there and missing from the table fails it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from bert_ds import zero
from tests.conftest import cli_env, run_command

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)

WORLD_GROUP_TIMEOUT = timedelta(seconds=123)  # distinct from torch's default (30 min) and DeepSpeed's
ENGINES = ("zero0-fp32", "zero1-fp32", "zero2-fp32", "zero1-bf16", "zero1-bf16acc32")

# Attribute names bert_ds/zero.py may use that are torch's or Python's, not DeepSpeed's.
# A name there that is neither in this list nor in zero.RELIED_ON fails the last test.
NOT_DEEPSPEED = {
    "Optimizer", "Parameter", "import_module", "modules", "wraps", "Tensor", "WORLD", "__name__", "append", "clone", "contextmanager", "cpu",
    "data_ptr", "device", "element_size", "float", "get_world_size", "group", "is_tensor", "items",
    "named_parameters", "new_group", "nn", "optim", "param_groups", "shape", "state", "to", "values", "zeros_like",
    "addFilter", "removeFilter", "getMessage", "environ", "cuda", "is_available",  # logging's, os's, torch's
    "__init__", "dim", "dtype", "float32", "get_rank", "path", "isfile",
    "flat_partition",  # set by bert_ds.zero; DeepSpeed reads it (RELIED_ON's _get_preflattened_grad_partition)
}


# --------------------------------------------------------------------------- the probe (its own process)


@dataclass
class _Built:
    """An engine with what the checks compare it against."""
    name: str
    engine: object
    client: torch.optim.Optimizer
    groups: list[list[torch.nn.Parameter]]  # the param groups the client was built with


def _build(name: str) -> _Built:

    from bert_ds.optim.builders import bind_to_engine
    from bert_ds.optim.lamb import Lamb
    from tests.bert_ds import lamb_zero_worker as worker

    stage, precision = name.split("-")
    model = worker.build_model()
    groups = worker.param_groups(model)
    given = [list(g["params"]) for g in groups]  # DeepSpeed replaces them in these very dicts
    client = Lamb(groups, lr=worker.LR)
    engine, *_ = zero.initialize(model=model, optimizer=client,
                                      lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s),
                                      config=worker.ds_config(int(stage.removeprefix("zero")), precision, 1))
    bind_to_engine(client, engine)
    return _Built(name, engine, client, given)


def _train_step(built: _Built, seed: int = 0) -> None:
    """One optimizer step (its micro-steps)."""
    import torch.nn.functional as F

    from tests.bert_ds import lamb_zero_worker as worker

    x, y = worker.batches()
    dtype = next(built.engine.module.parameters()).dtype
    for k in range(worker.GAS):
        out = built.engine(x[seed, k].to(dtype)).float()
        built.engine.backward(F.cross_entropy(out, y[seed, k]))
        built.engine.step()


def _flats(built: _Built) -> list[torch.Tensor]:
    return [part.flat for part in zero.flat_partitions(built.engine)]


# One check per kind of `expect`, called as check(value, built) with value = getattr(obj, name).
# Returns False where the kind does not apply to this instance (an entry must apply to one).
def _function_check(expect: str):
    """For ``function(a, b)``: a callable whose parameters are named a, b."""
    want = expect.removeprefix("function(").removesuffix(")").split(", ")

    def check(value, built: _Built | None) -> bool:
        assert callable(value), f"{value!r} is not callable"
        assert list(inspect.signature(value).parameters) == want, inspect.signature(value)
        return True

    return check


def _check_per_group(value, built: _Built, each) -> bool:
    assert isinstance(value, list) and len(value) == len(built.client.param_groups), value
    for i, item in enumerate(value):
        each(i, item)
    return True


def _is_group(g) -> bool:
    return g is None or isinstance(g, torch.distributed.ProcessGroup)


def _check_flat(i: int, flat, built: _Built) -> None:
    assert isinstance(flat, torch.Tensor) and flat.dim() == 1 and flat.is_contiguous(), flat
    assert flat.dtype == torch.float32, flat.dtype
    assert built.client.param_groups[i]["params"] == [flat], "the client does not step the flat partition"
    assert flat.numel() >= sum(p.numel() for p in built.groups[i])  # one rank holds all of it


def _check_flat_weights(i: int, flat, built: _Built) -> None:
    """Group i's parameters are views of ``flat``, one after another in group order."""
    assert isinstance(flat, torch.Tensor) and flat.dim() == 1 and flat.is_contiguous(), flat
    offset = 0
    for p in built.groups[i]:
        assert p.data_ptr() == flat.data_ptr() + offset * flat.element_size(), f"group {i}: not a view at {offset}"
        offset += p.numel()
    assert flat.numel() >= offset


CHECKS = {
    "class": lambda v, b: isinstance(v, type) or pytest.fail(f"{v!r} is not a class"),
    "int": lambda v, b: (type(v) is int) or pytest.fail(f"{v!r} is not an int"),
    "process group or None": lambda v, b: _is_group(v) or pytest.fail(f"{v!r} is not a process group"),
    "the model": lambda v, b: v is b.engine.module or pytest.fail(repr(v)),
    "method": lambda v, b: callable(v) or pytest.fail(f"{v!r} is not callable"),
    "module": lambda v, b: inspect.ismodule(v) or pytest.fail(f"{v!r} is not a module"),
    "logger": lambda v, b: isinstance(v, logging.Logger) or pytest.fail(f"{v!r} is not a logging.Logger"),
    "client optimizer": lambda v, b: v is b.client or pytest.fail(f"{v!r} is not the client optimizer"),
    "wrapper or client optimizer": lambda v, b: (v is b.client or v.optimizer is b.client) or pytest.fail(repr(v)),
    "parameters per group": lambda v, b: _check_per_group(
        v, b, lambda i, ps: [id(p) for p in ps] == [id(p) for p in b.groups[i]] or pytest.fail(f"group {i}")),
    "flat partition per group": lambda v, b: _check_per_group(v, b, lambda i, f: _check_flat(i, f, b)),
    "flat weights per group": lambda v, b: _check_per_group(v, b, lambda i, f: _check_flat_weights(i, f, b)),
    "int per group": lambda v, b: _check_per_group(
        v, b, lambda i, n: (int(n) == n and n > 0) or pytest.fail(f"group {i}: {n!r}")),
    "process group per group": lambda v, b: _check_per_group(
        v, b, lambda i, g: _is_group(g) or pytest.fail(f"group {i}: {g!r}")),
    "loss scale": lambda v, b: float(v) == 1.0 or pytest.fail(f"{v!r}: no fp16 here, the scale is 1"),
    "loss scaler": lambda v, b: float(v.cur_scale) == 1.0 or pytest.fail(f"{v!r}"),
    "fragment or None": lambda v, b: (v is not None and type(v).__name__ == "tensor_fragment")
    or pytest.fail(f"{v!r}: one rank holds a fragment of every parameter"),
    "view into the flat partition": lambda v, b: any(
        f.data_ptr() <= v.data_ptr() < f.data_ptr() + f.numel() * f.element_size() for f in _flats(b))
    or pytest.fail("the fragment is not inside a flat partition"),
    "fragment address": lambda v, b: (type(v.start) is int and type(v.numel) is int) or pytest.fail(repr(v)),
    "bool": lambda v, b: (type(v) is bool) or pytest.fail(f"{v!r} is not a bool"),
    "float": lambda v, b: isinstance(v, (int, float)) and not isinstance(v, bool) or pytest.fail(f"{v!r} is no number"),
    "gradients per group": lambda v, b: _check_gradients(v, b),
    "returns torch.compile": lambda v, b: v() is torch.compile or pytest.fail(f"returns {v()!r}"),
}


def _check_gradients(value, built: _Built) -> bool:
    """A dict group -> list of gradient tensors (or None), empty until the first boundary backward."""
    assert isinstance(value, dict), f"{value!r} is not a dict"
    for group, grads in value.items():
        assert 0 <= group < len(built.client.param_groups), group
        assert grads is None or all(g is None or isinstance(g, torch.Tensor) for g in grads), grads
    return True


def _instances(owner: str, built: list[_Built]) -> list[tuple[object, _Built | None]]:
    """The objects ``owner`` names, each with the engine it belongs to."""
    if owner == "ZeRO parameter":
        return [(p, b) for b in built if zero.is_partitioned(b.engine) for p in b.engine.module.parameters()]
    try:
        return [(importlib.import_module(owner), None)]
    except ModuleNotFoundError:
        module, cls_name = owner.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), cls_name)
    found = []
    for b in built:
        objects = [b.engine, b.engine.optimizer]
        for p in b.engine.module.parameters():
            fragment = getattr(p, "_hp_mapping", None)
            if fragment is not None:
                objects += [fragment, fragment.hp_fragment_address]
        found += [(obj, b) for obj in objects if isinstance(obj, cls)]
    return found


def _check_field(field: zero.Field, built: list[_Built]) -> str:
    """"ok", or what is wrong with ``field`` on the installed DeepSpeed."""
    instances = _instances(field.owner, built)
    if not instances:
        return f"no {field.owner} among the engines {', '.join(b.name for b in built)}"
    check = _function_check(field.expect) if field.expect.startswith("function(") else CHECKS.get(field.expect)
    if check is None:
        return f"no check for the kind {field.expect!r}: add one to CHECKS"
    applied = 0
    for obj, b in instances:
        where = f"{field.owner}.{field.name}" + (f" ({b.name})" if b else "")
        try:
            value = obj if field.expect == "skip protocol" else getattr(obj, field.name)
            applied += bool(check(value, b))
        except AttributeError as e:
            return f"{where}: missing ({e})"
        except (AssertionError, pytest.fail.Exception) as e:
            return f"{where}: {e}"
    return "ok" if applied else f"{field.owner}.{field.name}: applies to none of the engines"


def _probe_world_group() -> dict:
    group = zero.world_group_with_timeout(WORLD_GROUP_TIMEOUT)
    timeout = group._get_backend(torch.device("cpu")).options._timeout
    return {"timeout_s": timeout.total_seconds(), "same_again": zero.world_group_with_timeout(timedelta(1)) is group}


def _probe_partitions(built: list[_Built]) -> dict:
    """Per engine: [(numel of parameter, (offset, numel) of its fragment)] per group, bound count."""
    out = {}
    for b in built:
        parts = zero.flat_partitions(b.engine)
        out[b.name] = {"groups": [[(p.numel(), [(s, n) for s, n, i in part.segments if i == k])
                                   for k, p in enumerate(part.params)] for part in parts],
                       "wrapper": type(b.engine.optimizer).__name__}
    return out


def _probe_full_state(built: dict[str, _Built]) -> dict:
    """Gather from a trained ZeRO-1 engine, install into the untrained ZeRO-2 one, gather again."""
    src, dst = built["zero1-fp32"], built["zero2-fp32"]
    before = zero.gather_partitioned_state(dst.engine)
    _train_step(src)
    full, scalars = zero.gather_partitioned_state(src.engine)
    zero.install_partitioned_state(dst.engine, full, scalars)
    again, again_scalars = zero.gather_partitioned_state(dst.engine)
    names = [n for n, _ in src.engine.module.named_parameters()]
    fp32 = {n: zero.full_fp32_param(p).clone() for n, p in src.engine.module.named_parameters()}
    for n, p in dst.engine.module.named_parameters():
        zero.set_full_fp32_param(p, fp32[n] + 1.0)
    moved = {n: zero.full_fp32_param(p) for n, p in dst.engine.module.named_parameters()}
    return {
        "before_first_step": before, "keys": sorted({k for k, _ in full}), "names": names,
        "full": full, "again": again, "scalars": scalars, "again_scalars": again_scalars,
        "fp32_set": all(torch.equal(moved[n], fp32[n] + 1.0) for n in names),
        "plain_fp32": zero.full_fp32_param(next(built["zero0-fp32"].engine.module.parameters())),
        "unsupported": {name: zero.full_state_unsupported(b.engine) for name, b in built.items()},
    }


def _probe_step(built: dict[str, _Built]) -> dict:
    out = {}
    for name, b in built.items():
        if name == "zero1-fp32":
            continue  # trained by the full-state probe
        _train_step(b)
        out[name] = {"loss_scale": zero.loss_scale(b.engine), "skipped": zero.skipped_steps(b.engine),
                     "directly": zero.steps_directly(b.engine, b.client)}
    return out


def _probe_owned_gradients() -> dict:
    """ZeRO-0 in fp32, ZeRO-1 and ZeRO-2 configured as bert_ds.config.step_owns_gradients
    configures them, beside the same engines with DeepSpeed clipping (and, ZeRO-1/2, checking and
    measuring): the gradients are there before engine.step(), the step's clipping moves the
    weights as DeepSpeed's does, and one poisoned gradient makes the step's device flag skip
    the update, with DeepSpeed none the wiser (nothing counted as skipped there)."""
    import torch.nn.functional as F

    from bert_ds.optim import device_skip
    from bert_ds.optim.builders import bind_to_engine
    from bert_ds.optim.lamb import Lamb
    from bert_ds.train.step import clip_gradients, grad_square_sum
    from tests.bert_ds import lamb_zero_worker as worker

    def engine_for(stage: int, precision: str, owned: bool):
        torch.manual_seed(0)
        model = worker.build_model()
        client = Lamb(worker.param_groups(model), lr=worker.LR)
        config = worker.ds_config(stage, precision, 1)
        if owned:
            config.update(gradient_clipping=0.0)
            if stage > 0:
                config["zero_optimization"]["compute_grad_norm"] = False
            if precision == "bf16":
                config["bf16"]["check_grad_overflow"] = False
        engine, *_ = zero.initialize(model=model, optimizer=client, config=config,
                                     lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s))
        bind_to_engine(client, engine)
        return engine, client

    x, y = worker.batches()
    out = {}
    for stage, precision in ((0, "fp32"), (1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16")):
        (owned, client), (theirs, _) = engine_for(stage, precision, True), engine_for(stage, precision, False)
        dtype = next(owned.module.parameters()).dtype
        flags, skipped, unchanged, lr_moved = [], [], [], []
        for seed, poison in ((0, False), (1, False), (2, True)):  # the last one skipped: the gap is of two steps
            for engine in (owned,) if poison else (owned, theirs):  # theirs sees no poisoned step
                for k in range(worker.GAS):
                    engine.backward(F.cross_entropy(engine(x[seed, k].to(dtype)).float(), y[seed, k]))
                    if k < worker.GAS - 1:
                        engine.step()
            grads = ([p.grad for p in owned.module.parameters()] if zero.steps_directly(owned, client)
                     else zero.partition_gradients(owned))
            if poison:
                grads[-1].view(-1)[0] = float("nan")
            square = grad_square_sum(grads, torch.device("cpu"))
            flag = (~torch.isfinite(square)).to(torch.float32)  # as bert_ds.train.step decides it
            device_skip.skip_next_step_if(client, flag)
            clip_gradients(grads, square.sqrt(), worker.CLIP)
            before, lr = zero.skipped_steps(owned), owned.get_lr()
            weights = [p.detach().clone() for p in owned.module.parameters()]
            owned.step()
            if not poison:
                theirs.step()
            flags.append(bool(flag))
            skipped.append(zero.skipped_steps(owned) - before)
            unchanged.append(all(torch.equal(a, b) for a, b in zip(weights, owned.module.parameters())))
            lr_moved.append(owned.get_lr() != lr)
        # fp32 master weights: each tensor's largest difference over its largest value
        master = zero.full_fp32_param if stage > 0 else (lambda p: p.detach())
        gap = max(float((master(a) - master(b)).abs().max() / master(b).abs().max())
                  for a, b in zip(owned.module.parameters(), theirs.module.parameters()))
        out[f"zero{stage}-{precision}"] = {"owned": zero.step_owns_gradients(owned),
                                           "theirs": zero.step_owns_gradients(theirs), "flags": flags,
                                           "skipped": skipped, "unchanged": unchanged, "lr_moved": lr_moved,
                                           "weight_gap": gap}
    return out


@contextlib.contextmanager
def _warnings_of_deepspeed():
    """The messages DeepSpeed's logger emits at WARNING or above inside the block."""
    from deepspeed.utils import logger

    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def _unfiltered_warnings() -> list[str]:
    """DeepSpeed's warnings for a ZeRO-1 engine over bert-ds's LAMB built by deepspeed.initialize
    itself: what zero.initialize keeps from the user."""
    import deepspeed

    from bert_ds.optim.lamb import Lamb
    from tests.bert_ds import lamb_zero_worker as worker

    model = worker.build_model()
    with _warnings_of_deepspeed() as warned:
        deepspeed.initialize(model=model, optimizer=Lamb(worker.param_groups(model), lr=worker.LR),
                             config=worker.ds_config(1, "fp32", 1))
    return list(warned)


def probe(out: Path) -> None:
    import deepspeed
    import torch.distributed as dist

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ["PROBE_PORT"])
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        result = {"world_group": _probe_world_group()}  # before any engine: DeepSpeed clones it there
        with _warnings_of_deepspeed() as warned:
            built = {name: _build(name) for name in ENGINES}
        result["warnings"] = {"ours": list(warned), "deepspeed": _unfiltered_warnings()}
        result["partitions"] = _probe_partitions(list(built.values()))
        result["fields"] = {f"{f.owner}.{f.name}": _check_field(f, list(built.values())) for f in zero.RELIED_ON}
        result["full_state"] = _probe_full_state(built)
        result["step"] = _probe_step(built)
        result["owned_gradients"] = _probe_owned_gradients()
        result["muon"] = {"imported": type(sys.modules.get(zero.MUON_MODULE)).__name__,
                          "compiler_loaded": "torch._inductor.compile_fx" in sys.modules}
        torch.save(result, out)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as lamb_zero_worker: gloo threads may abort a rank during interpreter finalization


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero-probe") / "probe.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = run_command([sys.executable, "-m", "tests.bert_ds.test_zero", "--probe", str(out)], timeout=300,
                       env={**cli_env(), "PROBE_PORT": port})
    if proc.returncode != 0 or not out.is_file():
        raise AssertionError(f"the probe exited {proc.returncode}\n{proc.stderr[-6000:]}")
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("field", zero.RELIED_ON, ids=lambda f: f"{f.owner.rsplit('.', 1)[-1]}.{f.name}")
def test_deepspeed_has_what_zero_relies_on(probed, field):
    assert probed["fields"][f"{field.owner}.{field.name}"] == "ok", field.why


def test_zero_py_uses_no_deepspeed_name_the_table_lacks():
    tree = ast.parse(Path(zero.__file__).read_text())
    listed = {f.name for f in zero.RELIED_ON}
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("deepspeed") for a in node.names}
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    # getattr(obj, "name", ...) reads a field too
    used |= {node.args[1].value for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "getattr" and isinstance(node.args[1], ast.Constant)}
    assert imported - listed == set(), "imported from DeepSpeed but not in zero.RELIED_ON"
    assert used - listed - NOT_DEEPSPEED == set(), "used in bert_ds/zero.py but in neither zero.RELIED_ON nor NOT_DEEPSPEED"
    assert "_hp_mapping" in used and "bit16_groups" in used  # the scan sees the accesses it is meant to
    assert NOT_DEEPSPEED & listed == set()


def test_world_group_gets_the_timeout_once(probed):
    assert probed["world_group"] == {"timeout_s": WORLD_GROUP_TIMEOUT.total_seconds(), "same_again": True}


def test_flat_partitions_hold_every_parameter_whole_on_one_rank(probed):
    parts = probed["partitions"]
    assert parts["zero0-fp32"] == {"groups": [], "wrapper": "Lamb"}
    assert parts["zero1-bf16acc32"]["wrapper"] == "BF16_Optimizer"
    for name in ("zero1-fp32", "zero2-fp32", "zero1-bf16", "zero1-bf16acc32"):
        groups = parts[name]["groups"]
        assert [len(g) for g in groups] == [2, 4], name  # lamb_zero_worker: 2 matrices; 2 biases, LN weight, bias
        for group in groups:
            offset = 0
            for numel, fragments in group:
                assert fragments == [(offset, numel)], (name, group)  # whole, in order, no gap on one rank
                offset += numel


def test_the_full_optimizer_state_survives_gather_and_install(probed):
    s = probed["full_state"]
    assert s["before_first_step"] is None
    assert s["keys"] == ["exp_avg", "exp_avg_sq"]
    assert set(s["full"]) == {(k, n) for k in s["keys"] for n in s["names"]}
    assert all(s["full"][k, n].abs().max() > 0 for k in s["keys"] for n in s["names"])  # every group linked
    assert all(torch.equal(s["full"][key], s["again"][key]) for key in s["full"])
    assert s["scalars"] == s["again_scalars"] == [{"step": 1}, {"step": 1}]
    assert s["fp32_set"] and s["plain_fp32"] is None
    assert {name: r is None for name, r in s["unsupported"].items()} == {name: True for name in ENGINES}


def test_the_engines_apply_every_step_of_the_probe(probed):
    for name in ("zero0-fp32", "zero2-fp32", "zero1-bf16", "zero1-bf16acc32"):
        assert probed["step"][name] == {"loss_scale": 1.0, "skipped": 0, "directly": name == "zero0-fp32"}, name


def test_the_step_owns_the_gradients_checks_as_deepspeed_would(probed):
    for stage, got in probed["owned_gradients"].items():
        gap = got.pop("weight_gap")
        # the poisoned step: weights as they were, DeepSpeed's count and LR schedule move on
        assert got == {"owned": True, "theirs": False, "flags": [False, False, True], "skipped": [0, 0, 0],
                       "unchanged": [False, False, True], "lr_moved": [True, True, True]}, stage
        # The step's clipping (float64 norm) against DeepSpeed's (float32 norm per tensor), after
        # two applied steps. fp32: the masters agree to float32 rounding. bf16: the step scales
        # the bf16 gradients, DeepSpeed their fp32 copy, one more rounding of gradients that
        # carry 2^-8 relative rounding already: the masters agree within that.
        assert gap <= (1e-6 if stage.endswith("fp32") else 2 ** -8), (stage, gap)


def test_engines_are_built_without_deepspeeds_untested_optimizer_warning(probed):
    """DeepSpeed warns of "an untested optimizer" for bert-ds's LAMB, which test_lamb.py holds to a
    single-process reference under ZeRO: zero.initialize leaves that warning out, and only it."""
    ours, theirs = probed["warnings"]["ours"], probed["warnings"]["deepspeed"]
    assert any(zero.UNTESTED_OPTIMIZER in m for m in theirs), theirs  # what there is to leave out
    assert not any(zero.UNTESTED_OPTIMIZER in m for m in ours), ours


def test_engines_are_built_without_loading_the_compiler(probed):
    """The probe's engines (ZeRO-0/1/2, bf16's wrapper) imported DeepSpeed's Muon, whose kernels
    are wrapped in torch.compile, and Inductor's compiler was never loaded."""
    assert probed["muon"] == {"imported": "module", "compiler_loaded": False}


def test_a_deferred_compile_compiles_once_at_the_first_call():
    calls = []

    def compile_now(fn, **options):
        calls.append(options)
        return lambda x: fn(x) + 1  # marks the "compiled" result

    deferred = zero.deferred_compile(compile_now)

    @deferred(dynamic=False)  # as a decorator with options, as DeepSpeed's Muon uses it
    def double(x):
        return 2 * x

    plain = deferred(lambda x: x)
    assert calls == [] and double.__name__ == "double"
    assert [double(3), double(4), plain(5)] == [7, 9, 6]
    assert calls == [{"dynamic": False}, {}]


def test_a_deepspeed_without_muon_builds_as_before(monkeypatch):
    compile_now = torch.compile
    monkeypatch.setattr(zero, "MUON_MODULE", "deepspeed.runtime.zero.no_such_muon")
    zero.import_muon_uncompiled()  # no error: DeepSpeed's own check takes Muon's absence
    assert torch.compile is compile_now and "deepspeed.runtime.zero.no_such_muon" not in sys.modules


def test_bind_to_engine_binds_nothing_for_another_optimizer():
    from bert_ds.optim.builders import bind_to_engine

    model = torch.nn.Linear(2, 2)
    adamw = torch.optim.AdamW(model.parameters())

    class _Engine:
        optimizer = object()  # never read: another optimizer is not bound

    assert bind_to_engine(adamw, _Engine()) == 0


def test_deepspeed_is_told_it_runs_on_the_cpu_only_where_torch_sees_no_gpu(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    zero.name_cpu_accelerator()
    assert "DS_ACCELERATOR" not in os.environ  # DeepSpeed finds the GPU itself
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    zero.name_cpu_accelerator()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")  # a user's choice stays
    zero.name_cpu_accelerator()
    assert os.environ["DS_ACCELERATOR"] == "xpu"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the probe of test_zero.py (one CPU rank)")
    parser.add_argument("--probe", required=True, type=Path)
    probe(parser.parse_args().probe)
