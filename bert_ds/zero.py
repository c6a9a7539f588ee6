"""Every use of DeepSpeed's internals in bert-ds: the rest of the code calls the functions here.

What this module owns, and why each part needs something DeepSpeed does not publish:

- **Where ZeRO put each parameter** (:func:`flat_partitions`). ZeRO-1/2 replace each param
  group's parameters by ONE flat fp32 tensor, this rank's slice of the group's concatenated
  parameters (the master copy), and hand that to the client optimizer. LAMB's per-parameter
  trust ratios need to know which fragment of which parameter lies where in it. DeepSpeed
  records that on each parameter (``param._hp_mapping``) and keeps the groups, the flat
  partitions and the data-parallel groups as wrapper attributes; none of it is public API.
- **The full, world-size-free optimizer state** (:func:`gather_partitioned_state`,
  :func:`install_partitioned_state`). DeepSpeed's public ``safe_{get,set}_full_*`` go through
  each parameter's fragment, but DeepSpeed links the fragments to the optimizer state once,
  after the first step of param group 0, while the other groups have no state yet. So the
  links are made again here (``lazy_init_hp_params_optimizer_state``, per group, found through
  ``_hp_mapping.param_group_index``), and a freshly built engine gets its state created in
  the layout DeepSpeed's first step would give it.
- **Which layouts leave the gradients to the training step** (:func:`step_owns_gradients`):
  ZeRO-0 in fp32, where the engine steps the client optimizer itself and checks nothing, and
  ZeRO-1/2 (``DeepSpeedZeroOptimizer``) with its overflow check, norm and clipping off. The
  step checks, measures and clips there, and skips a non-finite step on the device through
  the optimizer (:mod:`bert_ds.optim.device_skip`): DeepSpeed sees every step applied.
- **Gradients reduced outside the engine** (:func:`flat_groups`, :func:`hand_partition_gradients`,
  :func:`own_checkpoint_missing`): bert-ds runs bf16 on ZeRO-1/2 itself
  (:mod:`bert_ds.train.bf16_copy`): its bf16 copy of the model takes the layout of ZeRO's flat
  weights (``bit16_groups_flat``, ``partition_size``), and each rank's partition of the fp32
  gradient sum goes to the optimizer's step as a pre-flattened partition, which ``step()``
  uses as it is. Such an engine is fp32, so it names its checkpoint files as fp32 engines do;
  one saved by a bf16 engine is restored from its full state.
- **Skipped steps and the loss scale** (:func:`skipped_steps`, :func:`loss_scale`): the
  engine's counter and the wrappers' ``cur_scale``; DeepSpeed has no public getter for either.
- **An engine without Muon's compiler** (:func:`initialize`): the engine imports DeepSpeed's
  Muon optimizer to ask whether the client optimizer is one; that module wraps its kernels in
  ``torch.compile`` as it is imported, which loads TorchDynamo's and Inductor's compilers:
  about 2 s of CPU in every process that builds an engine, for an optimizer bert-ds never makes.
- **Two warnings that say nothing true of a bert-ds run** (:func:`name_cpu_accelerator`,
  :func:`initialize`): DeepSpeed, finding no GPU, warns that it "was unable to detect" one (on
  a CPU machine, where there is none to detect); and it warns of "an untested optimizer" for any
  client optimizer it did not write, while bert-ds's per-parameter optimizers (LAMB and
  StableAdamW, ZeRO-0 to 2 only) are held to a single-process reference under ZeRO
  (``tests/bert_ds/test_lamb.py``, ``tests/bert_ds/test_stable_adamw.py``).
- **The collective timeout of ZeRO's own group** (:func:`world_group_with_timeout`): DeepSpeed
  runs ZeRO's collectives on a clone of the world group, ``deepspeed.utils.groups._WORLD_GROUP``,
  which it makes with torch's default timeout (30 min) unless one is already there.

Checked against DeepSpeed 0.19.8, the installed version; ``pyproject.toml`` allows
``>=0.19,<0.20``. Every field, attribute and function this module uses is listed, with why,
in :data:`RELIED_ON`; ``tests/bert_ds/test_zero.py`` checks each on the installed DeepSpeed
(tiny engines on one CPU rank, ZeRO-0/1/2, fp32 and bf16) and fails on a name this file uses
that the table lacks. It is the one test to read on a DeepSpeed upgrade.

Layouts: ZeRO-0 in fp32 (the client optimizer steps the model's parameters: nothing is
partitioned), ZeRO-1/2 in any precision (``DeepSpeedZeroOptimizer``), and ZeRO-1 in bf16 with
fp32 gradient accumulation (``BF16_Optimizer``). ZeRO-3 cuts every parameter on its own and
has no flat partitions per group: refused where one is needed. ZeRO-0 with bf16/fp16 cannot
run LAMB: its wrapper (``FP16_UnfusedOptimizer``) steps the optimizer once with zero gradients
inside ``deepspeed.initialize``, for LAMB ``w -= lr * w`` wherever weight decay is on; LAMB's
``step()`` refuses the wrapper's tensors there, so that ends in an error, not in another optimizer.

Imports nothing of bert-ds; ``bert_ds.optim``, ``bert_ds.checkpoint`` and ``bert_ds.train``
import it. DeepSpeed is imported inside the functions, so that importing bert-ds does not.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Field:
    """Something of DeepSpeed this module relies on. ``owner``: a module, or a DeepSpeed object
    named as ``tests/bert_ds/test_zero.py`` finds it; ``expect``: what it must be there (the
    test has one check per kind)."""
    owner: str
    name: str
    expect: str
    why: str


_ZERO = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
_BF16 = "deepspeed.runtime.bf16_optimizer.BF16_Optimizer"
_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
_FRAGMENT = "deepspeed.utils.tensor_fragment.tensor_fragment"
_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"

RELIED_ON: tuple[Field, ...] = (
    # ---- classes, to tell the layouts apart
    Field("deepspeed.runtime.base_optimizer", "ZeROOptimizer", "class",
          "base of the ZeRO-1/2 wrappers (and bf16's): fp32 master and state live in per-rank flat partitions"),
    Field("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "class", "ZeRO-1/2, any precision"),
    Field("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer", "class", "ZeRO-1 in bf16, fp32 gradient accumulation"),
    # ---- the engine
    Field(_ENGINE, "optimizer", "wrapper or client optimizer",
          "the client optimizer itself under ZeRO-0 in fp32, else DeepSpeed's wrapper of it"),
    Field(_ENGINE, "skipped_steps", "int", "counts steps skipped on overflow; no getter"),
    Field(_ENGINE, "module", "the model", "the model, whose parameters carry the fragments"),
    Field(_ENGINE, "zero_optimization_stage", "method", "ZeRO-3 has no full-weight path here"),
    Field(_ENGINE, "gradient_clipping", "method", "DeepSpeed's clipping threshold: 0 where the step clips"),
    Field(_ENGINE, "_get_zero_ckpt_name", "method",
          "the ZeRO optimizer file this engine's load_checkpoint opens (bf16 engines name theirs bf16_*): "
          "absent where an engine of another precision saved the checkpoint"),
    # ---- ZeRO-1/2 and bf16 wrappers: the groups, the flat partitions, the data-parallel groups
    Field(_ZERO, "optimizer", "client optimizer", "the optimizer bert-ds built; it steps the flat partitions"),
    Field(_ZERO, "bit16_groups", "parameters per group", "model parameters of group i, in flat-partition order"),
    Field(_ZERO, "single_partition_of_fp32_groups", "flat partition per group", "this rank's fp32 slice of group i"),
    Field(_ZERO, "real_dp_process_group", "process group per group", "the ranks holding group i's other slices"),
    Field(_ZERO, "cur_scale", "loss scale", "the loss scale (1.0 without fp16); no public getter"),
    Field(_ZERO, "check_grad_overflow", "bool",
          "DeepSpeed's per-gradient overflow check, read at each step(): off where the step owns the gradients"),
    Field(_ZERO, "compute_grad_norm", "bool", "off: DeepSpeed neither measures nor clips the gradients"),
    Field(_ZERO, "clip_grad", "float", "DeepSpeed's own clipping threshold; 0 where the step clips"),
    Field(_ZERO, "averaged_gradients", "gradients per group",
          "this rank's reduced gradients per group, ready at the accumulation boundary before step()"),
    Field(_ZERO, "loss_scaler", "loss scaler", "holds `cur_scale` where the wrapper has no property for it"),
    # ---- ZeRO-1/2 under bert-ds's bf16 copy (bert_ds.train.bf16_copy): the engine holds the fp32 weights
    Field(_ZERO, "bit16_groups_flat", "flat weights per group",
          "group i's parameters as one tensor, of which they are views: the bf16 copy and its gradients take its layout"),
    Field(_ZERO, "partition_size", "int per group", "elements of group i's flat tensor per rank: rank r steps the r-th"),
    Field(_ZERO, "_get_preflattened_grad_partition", "method",
          "step() takes averaged_gradients[i].flat_partition, where set, as group i's flat gradient partition, uncopied"),
    Field(_BF16, "optimizer", "client optimizer", "as for ZeRO-1/2"),
    Field(_BF16, "bf16_groups", "parameters per group", "as bit16_groups"),
    Field(_BF16, "fp32_groups_flat_partition", "flat partition per group", "as single_partition_of_fp32_groups"),
    Field(_BF16, "real_dp_process_group", "process group per group", "as for ZeRO-1/2"),
    # ---- per parameter: where its fragment lies
    Field("ZeRO parameter", "_hp_mapping", "fragment or None",
          "where this rank's fragment of the parameter lies in the flat partition; None: no element here"),
    Field(_FRAGMENT, "hp_fragment", "view into the flat partition", "checked against the address before it is trusted"),
    Field(_FRAGMENT, "hp_fragment_address", "fragment address", "offset and length in the flat partition"),
    Field(_FRAGMENT, "param_group_index", "int", "which flat partition (param group) holds the fragment"),
    Field(_ADDRESS, "start", "int", "offset of the fragment in the flat partition"),
    Field(_ADDRESS, "numel", "int", "length of the fragment"),
    # ---- functions
    Field("deepspeed.utils", "safe_get_full_fp32_param", "function(param)", "full fp32 master (collective)"),
    Field("deepspeed.utils", "safe_set_full_fp32_param", "function(param, value)", "set the fp32 master fragment"),
    Field("deepspeed.utils", "safe_get_full_optimizer_state", "function(param, optim_state_key)",
          "full optimizer state of a parameter (collective)"),
    Field("deepspeed.utils", "safe_set_full_optimizer_state", "function(param, value, optim_state_key)",
          "set this rank's fragment of a parameter's optimizer state"),
    Field("deepspeed.utils", "lazy_init_hp_params_optimizer_state",
          "function(lp_param_list, flat_hp_partition, optimizer_state)",
          "link fragments to the optimizer state; DeepSpeed does it for group 0 only"),
    Field("deepspeed.utils", "groups", "module", "holds DeepSpeed's process groups"),
    Field("deepspeed", "initialize", "method", "builds the engine (public API), after import_muon_uncompiled"),
    Field("deepspeed.utils", "logger", "logger",
          "DeepSpeed's logger: its untested-optimizer warning is filtered out while the engine is built"),
    Field("deepspeed.runtime.compiler", "compile", "returns torch.compile",
          "how Muon's module wraps its kernels as it is imported; import_muon_uncompiled defers them"),
    Field("deepspeed.utils.groups", "_WORLD_GROUP", "process group or None",
          "DeepSpeed's clone of the world group, made with torch's default timeout if not already there"),
)


# --------------------------------------------------------------------------- the engine

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


UNTESTED_OPTIMIZER = "You are using ZeRO with an untested optimizer"  # DeepSpeed's warning, as it begins


def initialize(**kwargs):
    """``deepspeed.initialize(**kwargs)``, with DeepSpeed's Muon imported first without its
    compiler (:func:`import_muon_uncompiled`), and without its untested-optimizer warning (the
    module docstring says why)."""
    import deepspeed
    from deepspeed.utils import logger

    import_muon_uncompiled()

    def quiet(record) -> bool:  # a logging filter: False drops the record
        return UNTESTED_OPTIMIZER not in record.getMessage()

    logger.addFilter(quiet)
    try:
        return deepspeed.initialize(**kwargs)
    finally:
        logger.removeFilter(quiet)


def name_cpu_accelerator() -> None:
    """Where torch sees no CUDA device, tell DeepSpeed it runs on the CPU (``DS_ACCELERATOR=cpu``,
    as run.sh does) before DeepSpeed is imported and looks for itself: it would find the same,
    and say so in a warning that it "was unable to detect" a GPU. A value already set is kept."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def import_muon_uncompiled() -> None:
    """Import :data:`MUON_MODULE` with its ``torch.compile`` wrappers deferred to their first call.

    The engine imports DeepSpeed's Muon optimizer wherever it asks whether the client optimizer
    is one (``is_zero_supported_optimizer``, the ZeRO and bf16 wrappers), and Muon's module wraps
    its kernels in ``torch.compile`` as it is imported, which loads TorchDynamo's and Inductor's
    compilers: 2 s of CPU in every process that builds an engine, a quarter of a short run's,
    for an optimizer bert-ds never makes. Imported here first, with ``torch.compile`` standing in
    as :func:`deferred_compile` for the import only, the module holds the same classes and its
    kernels compile on their first use, as they would have."""
    if MUON_MODULE in sys.modules:
        return
    compile_now = torch.compile
    torch.compile = deferred_compile(compile_now)
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:  # a DeepSpeed without Muon: nothing to defer, and its engine does without
        pass
    finally:
        torch.compile = compile_now


def deferred_compile(compile_now: Callable) -> Callable:
    """A ``torch.compile`` that calls ``compile_now`` with the same arguments at the compiled
    function's first call instead of at once (as a decorator too: ``@torch.compile(...)``)."""
    def deferred(model=None, **options):
        if model is None:
            return lambda fn: deferred(fn, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return deferred


# --------------------------------------------------------------------------- which layout


def is_partitioned(engine) -> bool:
    """True under ZeRO-1/2 (and DeepSpeed's bf16 wrapper): the fp32 master weights and the
    optimizer state live in per-rank flat partitions, reachable per parameter through fragments."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    return isinstance(engine.optimizer, ZeROOptimizer)


def steps_directly(engine, optimizer: torch.optim.Optimizer) -> bool:
    """True where the engine steps ``optimizer`` itself on the model's parameters (ZeRO-0 in fp32):
    no DeepSpeed wrapper checks the gradients, so the training step does (:func:`step_owns_gradients`)."""
    return engine.optimizer is optimizer


def client_optimizer(engine) -> torch.optim.Optimizer:
    """The optimizer the engine was built from; under ZeRO-1/2 its param groups hold the flat partitions."""
    return engine.optimizer.optimizer if is_partitioned(engine) else engine.optimizer


def full_state_unsupported(engine) -> str | None:
    """Why full weights and optimizer state cannot be gathered from or put into this engine; None where they can."""
    if engine.zero_optimization_stage() == 3:
        return "loading full weights into a ZeRO-3 engine is not supported; use a ZeRO stage 0-2 config"
    if not is_partitioned(engine) and not isinstance(engine.optimizer, torch.optim.Optimizer):
        return ("loading full weights needs ZeRO-0 in fp32 or ZeRO-1/2 "
                f"(this engine's optimizer is DeepSpeed's {type(engine.optimizer).__name__})")
    return None


def own_checkpoint_missing(engine, folder: str, tag: str) -> bool:
    """Whether the DeepSpeed checkpoint ``folder``/``tag`` lacks the ZeRO optimizer file this
    engine's ``load_checkpoint`` would open: one saved by an engine of another precision
    (DeepSpeed names a bf16 engine's files ``bf16_zero_pp_rank_*``, an fp32 one's
    ``zero_pp_rank_*``), such as a bf16 run saved before bert-ds ran bf16 on an fp32 engine
    (:mod:`bert_ds.train.bf16_copy`). False where the engine has no such file (ZeRO-0)."""
    if not is_partitioned(engine):
        return False
    return not os.path.isfile(engine._get_zero_ckpt_name(folder, tag))


# --------------------------------------------------------------------------- flat partitions


@dataclass(frozen=True)
class FlatPartition:
    """One param group's share on this rank under ZeRO-1/2."""
    params: list[torch.nn.Parameter]    # the group's model parameters, in the same order on every rank
    flat: torch.Tensor                  # this rank's fp32 slice of their concatenation; the client optimizer steps it
    segments: list[tuple[int, int, int]]  # (offset, numel, index into params) of each fragment held here
    group: object                       # the process group whose ranks hold the other slices


def flat_partitions(engine) -> list[FlatPartition]:
    """This rank's flat partition of every param group, with the fragments it holds; [] under
    ZeRO-0 in fp32 (nothing is partitioned). Param group i of the client optimizer holds
    partition i. Raises ValueError for the layouts without flat partitions per group (ZeRO-3,
    ZeRO-0 with DeepSpeed's fp16/bf16 wrapper)."""
    wrapper = engine.optimizer
    if isinstance(wrapper, torch.optim.Optimizer):
        return []
    client = client_optimizer(engine)
    partitions = []
    for i, (params, flat, group) in enumerate(_zero_groups(wrapper)):
        held = client.param_groups[i]["params"]
        if len(held) != 1 or held[0] is not flat:
            raise RuntimeError(f"param group {i} does not hold DeepSpeed's flat partition {i}")
        segments = []
        for index, p in enumerate(params):
            address = _fragment_address(p, flat, i, index)
            if address is not None:
                segments.append((*address, index))
        partitions.append(FlatPartition(list(params), flat, segments, dist.group.WORLD if group is None else group))
    return partitions


def _zero_groups(wrapper) -> list[tuple[list[torch.nn.Parameter], torch.Tensor, object]]:
    """[(model parameters of group i, flat fp32 partition i, data-parallel group i)] of a ZeRO-1/2 wrapper."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(wrapper, DeepSpeedZeroOptimizer):  # ZeRO-1/2, any precision
        return list(zip(wrapper.bit16_groups, wrapper.single_partition_of_fp32_groups, wrapper.real_dp_process_group))
    if isinstance(wrapper, BF16_Optimizer):  # ZeRO-1 in bf16 with fp32 gradient accumulation
        return list(zip(wrapper.bf16_groups, wrapper.fp32_groups_flat_partition, wrapper.real_dp_process_group))
    raise ValueError(f"DeepSpeed's {type(wrapper).__name__} has no flat partition per param group: Lamb runs "
                     "under ZeRO-0 in fp32 and ZeRO-1/2 in any precision")


def _fragment_address(param: torch.nn.Parameter, flat: torch.Tensor, group: int, index: int) -> tuple[int, int] | None:
    """(offset, numel) of ``param``'s fragment in ``flat``; None where this rank holds none of it."""
    fragment = param._hp_mapping
    if fragment is None:
        return None
    address = fragment.hp_fragment_address
    if fragment.hp_fragment.data_ptr() != flat.data_ptr() + address.start * flat.element_size():
        raise RuntimeError(f"parameter {index} of group {group}: its fragment is not a view of the "
                           "flat partition at the address DeepSpeed recorded")
    return address.start, address.numel


# --------------------------------------------------------------------------- full weights and optimizer state


def full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (collective under ZeRO-1/2); None where DeepSpeed keeps
    no master apart from the parameter (ZeRO-0 in fp32)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param)


def set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's fragment of ``param``'s fp32 master from the whole tensor (no-op without a master)."""
    from deepspeed.utils import safe_set_full_fp32_param

    safe_set_full_fp32_param(param, value)


def gather_partitioned_state(engine) -> tuple[dict[tuple[str, str], torch.Tensor], list[dict[str, Any]]] | None:
    """Under ZeRO-1/2: every parameter's whole optimizer state, fp32 on the CPU, keyed by
    (state key, parameter name), and each param group's non-tensor state (step counts).
    None before the first step (no state yet). Collective: every rank, in the same order."""
    from deepspeed.utils import safe_get_full_optimizer_state

    opt = client_optimizer(engine)
    flats = [g["params"][0] for g in opt.param_groups]
    if any(f not in opt.state for f in flats):
        return None
    keys = sorted(k for k, v in opt.state[flats[0]].items() if torch.is_tensor(v) and v.shape == flats[0].shape)
    params = dict(engine.module.named_parameters())
    _link_fragments(opt, params.values())
    full = {(key, name): safe_get_full_optimizer_state(p, key).float().cpu().clone()
            for key in keys for name, p in params.items()}
    scalars = [{k: v for k, v in opt.state[f].items() if k not in keys} for f in flats]
    return full, scalars


def install_partitioned_state(engine, full: dict[tuple[str, str], torch.Tensor], scalars: list[dict[str, Any]]) -> None:
    """Under ZeRO-1/2, on a freshly built engine: give every parameter's fragments their share
    of ``full`` ((state key, parameter name) -> whole tensor, every key for every parameter)
    and each param group ``scalars[i]``. Every rank, before the first step."""
    from deepspeed.utils import safe_set_full_optimizer_state

    opt = client_optimizer(engine)
    keys = sorted({key for key, _ in full})
    params = dict(engine.module.named_parameters())
    # DeepSpeed creates the state at the first step; create it now, in that layout, and link
    # each parameter's fragment to it as DeepSpeed does after a step.
    for i, group in enumerate(opt.param_groups):
        flat = group["params"][0]
        opt.state[flat] = {**{key: torch.zeros_like(flat) for key in keys}, **scalars[i]}
    _link_fragments(opt, params.values())
    for (key, name), t in full.items():
        safe_set_full_optimizer_state(params[name], t.to(params[name].device), key)


def _link_fragments(opt: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> None:
    """Point every parameter's fragment at the optimizer state of its flat partition.

    DeepSpeed links them once, after the first step of param group 0, while the other groups
    have no state yet; so with two groups (decay / no decay) the second group's fragments stay
    unlinked and ``safe_get_full_optimizer_state`` fails for them. Linking again is idempotent
    (the links are views).
    """
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    params = list(params)
    for i, group in enumerate(opt.param_groups):
        members = [p for p in params if p._hp_mapping is not None and p._hp_mapping.param_group_index == i]
        lazy_init_hp_params_optimizer_state(members, group["params"][0], opt.state)


# --------------------------------------------------------------------------- the step: skips and loss scale


def step_owns_gradients(engine) -> bool:
    """True where DeepSpeed neither checks the gradients for overflow nor measures or clips them,
    as :func:`bert_ds.config.step_owns_gradients` configures it: ZeRO-0 in fp32 with the engine's
    clipping off, and the ZeRO-1/2 wrapper with ``check_grad_overflow`` and ``compute_grad_norm``
    off and ``clip_grad`` 0. The training step then does all three, over the model's gradients
    (:func:`steps_directly`) or :func:`partition_gradients`, and skips a non-finite step on the
    device through the client optimizer."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    wrapper = engine.optimizer
    if isinstance(wrapper, torch.optim.Optimizer):  # ZeRO-0 in fp32: the client itself
        return engine.gradient_clipping() == 0.0
    return (isinstance(wrapper, DeepSpeedZeroOptimizer) and not wrapper.check_grad_overflow
            and not wrapper.compute_grad_norm and wrapper.clip_grad == 0.0)


@dataclass(frozen=True)
class FlatGroup:
    """One param group's weights under ZeRO-1/2 as DeepSpeed lays them out: one flat tensor, of
    which the group's parameters are views, cut into one equal partition per rank."""
    params: list[torch.nn.Parameter]  # the group's model parameters, views of ``flat``
    flat: torch.Tensor  # every element of the group (padded to a multiple of the world size), on every rank
    partition: slice  # the elements of ``flat`` this rank steps
    group: object  # the data-parallel process group


def flat_groups(engine) -> list[FlatGroup]:
    """Every param group's flat weights and this rank's partition of them, under ZeRO-1/2's
    ``DeepSpeedZeroOptimizer`` (ValueError elsewhere)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    wrapper = engine.optimizer
    if not isinstance(wrapper, DeepSpeedZeroOptimizer):
        raise ValueError(f"DeepSpeed's {type(wrapper).__name__} keeps no flat weights per param group "
                         "(ZeRO-1/2's DeepSpeedZeroOptimizer does)")
    groups = []
    for params, flat, size, group in zip(wrapper.bit16_groups, wrapper.bit16_groups_flat, wrapper.partition_size,
                                         wrapper.real_dp_process_group):
        rank = dist.get_rank(group=group)
        groups.append(FlatGroup(list(params), flat, slice(rank * int(size), (rank + 1) * int(size)),
                                dist.group.WORLD if group is None else group))
    return groups


class _FlatGradients(list):
    """``averaged_gradients[i]`` as ZeRO-1/2's ``step()`` reads a gradient partition handed in
    whole: a list holding it (as :func:`partition_gradients` reads it) and ``flat_partition``."""

    def __init__(self, flat: torch.Tensor):
        super().__init__([flat])
        self.flat_partition = flat


def hand_partition_gradients(engine, grads: list[torch.Tensor]) -> None:
    """Make ``grads[i]`` (this rank's reduced fp32 gradient of group i's partition, as
    :func:`flat_groups` cuts it) what the next ``engine.step()`` at a boundary steps group i
    with: the tensor itself, not a copy. For a step that reduced the gradients itself instead
    of through ``engine.backward`` (:mod:`bert_ds.train.bf16_copy`)."""
    wrapper = engine.optimizer
    if len(grads) != len(wrapper.partition_size):
        raise ValueError(f"{len(grads)} gradient partitions for {len(wrapper.partition_size)} param groups")
    for i, (grad, size) in enumerate(zip(grads, wrapper.partition_size)):
        if grad.dim() != 1 or grad.numel() != int(size) or grad.dtype != torch.float32:
            raise ValueError(f"group {i}: a gradient partition is a flat fp32 tensor of {int(size)} elements, "
                             f"got {grad.dtype} {tuple(grad.shape)}")
        wrapper.averaged_gradients[i] = _FlatGradients(grad)


def partition_gradients(engine) -> list[torch.Tensor]:
    """This rank's reduced gradients of its partition (ZeRO-1/2), ready once the backward of a
    step's last micro-batch has returned, before ``engine.step()``."""
    return [g for grads in engine.optimizer.averaged_gradients.values() if grads for g in grads if g is not None]


def skipped_steps(engine) -> int:
    """Optimizer steps the engine skipped so far (DeepSpeed's overflow checks); a step was
    skipped when this grew across its last ``engine.step()``. A step that the training step
    skips on the device (:func:`step_owns_gradients`) is not counted here."""
    return engine.skipped_steps


def loss_scale(engine) -> float:
    """fp16's dynamic loss scale; 1.0 where there is none (bf16, fp32).

    Read where the ZeRO-1/2 wrapper keeps it (``cur_scale``, or its ``loss_scaler``). ZeRO-0's
    fp16 wrappers of DeepSpeed 0.19 keep it in ``loss_scale_config`` instead, which is not read:
    there this reports 1.0.
    """
    opt = engine.optimizer
    scale = getattr(opt, "cur_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else 1.0


# --------------------------------------------------------------------------- process groups


def world_group_with_timeout(timeout: timedelta) -> object:
    """DeepSpeed's clone of the world group, made here with ``timeout`` if DeepSpeed has none yet.

    DeepSpeed runs ZeRO's collectives on that clone and makes it with torch's default timeout
    (30 min), not the one the process group was started with; call this right after
    ``deepspeed.init_distributed`` and before ``deepspeed.initialize``, on every rank.
    """
    from deepspeed.utils import groups

    if groups._WORLD_GROUP is None:
        groups._WORLD_GROUP = dist.new_group(ranks=range(dist.get_world_size()), timeout=timeout)
    return groups._WORLD_GROUP
