"""What the ops run on this device: a ``kernels`` setting resolved, and the verdicts behind it.

- self-check: the first time a build meets a device, :func:`op_verdicts` runs every
  op against its ``<op>_ref`` (``kernels/selfcheck.py``: every dtype, a few shapes,
  forward and backward). An op that failed is refused by :func:`bert_ds.kernels.dispatch.choose`
  under ``kernels=cuda``, and its fused kernel is no candidate under ``kernels=auto``.
- speed: the first time ``kernels=auto`` meets a device with a model's shapes,
  :func:`op_choices` checks and times each op's candidates (fused, native, compiled,
  apex's LayerNorm, torch's ``varlen_attn`` and the SDPA backends for attention) at those
  shapes and the training's sequence length, and records the winners, their margins and the
  timings under the shapes (``kernels/speed.py``): each candidate's wall time, which decides,
  and its device time beside it.
- :func:`resolve_backend`: a ``kernels: auto | cuda | torch`` setting to the backend the ops
  run (``kernels/dispatch.py`` says what each runs). ``auto`` resolves to an
  :class:`~bert_ds.kernels.dispatch.OpPlan`, the winners at the model's shapes, which the
  model hands to every op call: each model runs what won at its own shapes, so phase 2 of
  BERT's recipe (seq 512), built in phase 1's process, runs phase 2's winners.
- :func:`resolution`: a model's setting as resolved, with the recorded verdicts behind it
  (:class:`Resolution`), read rather than raced again: what a training run writes into its
  folder as ``kernels.json`` and prints as it starts, so that each run, and each phase of a
  plan, keeps the verdicts it ran with.

Both verdicts are recorded beside the build (:func:`bert_ds.kernels._build.recorded`), so
a later process, or another rank, only reads them; a race recorded with other candidates
than there are now is run again. They are made by running the ops, so this module sits
above the ops, which sit above the dispatch: the dispatch reads the self-check's verdicts
through :func:`bert_ds.kernels.dispatch.consult`, which this module calls with
:func:`op_verdicts` as it is imported (every backend but "torch" comes from here), and the
race's inside the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from bert_ds.base.errors import UserError
from bert_ds.kernels import layer_norm, selfcheck, speed
from bert_ds.kernels._build import device_key, load_extension, no_cuda, recorded, verdict_path
from bert_ds.kernels.dispatch import OPS, SETTINGS, Backend, KernelUnavailable, OpPlan, consult
from bert_ds.kernels.speed import Choice, OpShapes

logger = logging.getLogger(__name__)


class UnknownKernelBackend(UserError):
    """The ``kernels`` setting names no known backend."""


# --------------------------------------------------------------------------- resolving a setting

def check_setting(requested: str) -> None:
    """What :func:`resolve_backend` would refuse without building or touching a device: an unknown
    setting, or ``cuda`` where no CUDA kernel can run. A command checks this before it starts
    anything, so such a mistake leaves nothing behind."""
    if requested not in SETTINGS:
        raise UnknownKernelBackend(f"kernels must be one of {', '.join(SETTINGS)}; got {requested!r}")
    if requested == "cuda" and no_cuda():
        raise KernelUnavailable(_unavailable(no_cuda()))


def _unavailable(reason: str) -> str:
    return (f"kernels=cuda was requested but the fused CUDA kernels cannot load: {reason}; "
            "use kernels=torch (or auto) to run the native PyTorch ops")


def resolve_backend(requested: str, shapes: OpShapes | None = None) -> Backend:
    """Maps a ``kernels`` setting ("auto" | "cuda" | "torch") to the backend the ops run.

    ``shapes``: the model's (a BERT-Base's at seq 128 when None). ``auto`` returns the
    :class:`~bert_ds.kernels.dispatch.OpPlan` of the winners at these shapes, raced the first
    time it meets them on this device; one plan per shapes and process.
    """
    if requested == "torch":
        return "torch"
    if requested == "cuda":
        extension, reason = load_extension()
        if extension is None:
            raise KernelUnavailable(_unavailable(reason))
        failed = {op: why for op, why in op_verdicts().items() if why}
        if failed:
            raise KernelUnavailable(
                "kernels=cuda was requested but fused kernels failed their self-check on this device: "
                + "; ".join(f"{op}: {why}" for op, why in sorted(failed.items()))
                + f" (recorded in {verdict_path()}; `python -m bert_ds.kernels.build --recheck` checks again); "
                "use kernels=auto to run the native op for those ops"
            )
        return "cuda"
    if requested == "auto":
        return _auto_backend(shapes or OpShapes())
    raise UnknownKernelBackend(f"kernels must be one of {', '.join(SETTINGS)}; got {requested!r}")


@functools.cache
def _auto_backend(shapes: OpShapes) -> Backend:
    extension, reason = load_extension()
    if not torch.cuda.is_available():  # no device to race on: the native ops are the only candidates
        logger.info("kernels=auto: running the native PyTorch ops (%s)", reason)
        return "torch"
    if extension is None:
        # A GPU without the kernels may be a slower run than the user intended; the other
        # candidates (torch.compile, SDPA's backends, apex) still race.
        _log_once(logging.WARNING, f"kernels=auto: the fused CUDA kernels cannot load ({reason}); "
                                   "racing the other candidates without them")
    for op, why in sorted(op_verdicts().items()):
        if why:
            _log_once(logging.WARNING, f"kernels=auto: {op} never runs its fused kernel here: "
                                       f"it failed the self-check ({why})")
    choices = op_choices(shapes)
    for op, winner in choices.items():
        _log_once(logging.INFO, f"kernels=auto at seq {shapes.max_seqlen}: {op} {winner.describe()}")
    return plan_of(choices, shapes)


def plan_of(choices: dict[str, Choice], shapes: OpShapes) -> OpPlan:
    """The winners of a race at ``shapes``, as the plan a model hands to its ops."""
    return OpPlan(tuple((op, choices[op].runs) for op in OPS if op in choices), shapes.key)


@functools.cache
def _log_once(level: int, message: str) -> None:
    # Once per process and message: the models built at one set of shapes share one plan.
    logger.log(level, message)


# --------------------------------------------------------------------------- what a run records

@dataclass(frozen=True)
class Resolution:
    """A ``kernels`` setting as one model resolved it, and the verdicts behind it."""

    setting: str  # what the config asked for: "auto", "cuda" or "torch"
    backend: str  # "plan" (a race decided: ``ops`` filled), else the backend: "torch" or "cuda"
    reason: str  # why no race decided ("" under a plan)
    shapes: OpShapes  # the model's, at the training's sequence length
    ops: dict[str, Choice]  # under a plan, per op, the recorded race's verdict

    def to_json(self) -> dict[str, Any]:
        """``OUTPUT/kernels.json``: ``race_version`` is the race's (``speed.RACE_VERSION``) under a
        plan, else None (nothing was raced)."""
        return {"setting": self.setting, "backend": self.backend, "reason": self.reason,
                "seq": self.shapes.max_seqlen, "shapes": dataclasses.asdict(self.shapes),
                "race_version": speed.RACE_VERSION if self.backend == "plan" else None,
                "ops": {op: verdict.to_json() for op, verdict in self.ops.items()}}

    def lines(self) -> list[str]:
        """What runs, for a run's start-up output: a line per op under a plan, else one line and why."""
        if self.backend == "plan":
            return [f"kernels={self.setting} at seq {self.shapes.max_seqlen}: {op} {verdict.describe()}"
                    for op, verdict in self.ops.items()]
        runs = "the native PyTorch ops run" if self.backend == "torch" else "the fused CUDA kernels run for every op"
        return [f"kernels={self.setting}: {runs} ({self.reason})"]


def resolution(setting: str, shapes: OpShapes, backend: Backend | None = None) -> Resolution:
    """``setting`` resolved at ``shapes``, with the verdicts behind it.

    ``backend``: what the model resolved the setting to (:func:`resolve_backend`'s, resolved
    here when None). A plan's verdicts are read from the record the race left (the race runs
    again only where the record could not be written).
    """
    backend = resolve_backend(setting, shapes) if backend is None else backend
    if isinstance(backend, OpPlan):
        choices = op_choices(shapes)
        return Resolution(setting, "plan", "", shapes, {op: choices[op] for op, _ in backend.runs})
    if backend == "cuda":
        return Resolution(setting, "cuda", "as kernels=cuda asks", shapes, {})
    if setting == "torch":
        return Resolution(setting, "torch", "as kernels=torch asks", shapes, {})
    why = no_cuda()
    reason = "no CUDA device to race on" + (f": {why}" if why and why != "no CUDA device" else "")
    return Resolution(setting, "torch", reason, shapes, {})


# --------------------------------------------------------------------------- the self-check

@functools.cache
def op_verdicts() -> dict[str, str]:
    """Per op, "" if its kernels passed the self-check on this device, else why not.

    Empty when the extension does not load.
    """
    extension, _ = load_extension()
    if extension is None:
        return {}
    return {op: str(why) for op, why in recorded("selfcheck", _run_selfcheck).items()}


def _run_selfcheck() -> dict[str, str]:
    logger.info("kernels: self-checking the fused CUDA kernels on %s", torch.cuda.get_device_name())
    return selfcheck.run_all()


# --------------------------------------------------------------------------- the race

# Where and by what clock the race runs: the current CUDA device and the default clock of
# kernels/speed.py (wall and device time per call); tests substitute a CPU and a fake clock.
def race_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


race_timer: speed.Timer | None = None


def op_choices(shapes: OpShapes | None = None) -> dict[str, Choice]:
    """Per op, the implementation ``kernels=auto`` runs at ``shapes`` on this device, with the
    timings behind it.

    Raced at ``shapes`` (a BERT-Base's at seq 128 when None) the first time ``kernels=auto``
    meets these shapes on this device under this :func:`~bert_ds.kernels._build.device_key`,
    and recorded under the shapes with the candidates' names: a later process with the same
    shapes reads it, one with other shapes (another model, the next phase's sequence length)
    races them, and a record made with other candidates, or by another version of the race
    (``speed.RACE_VERSION``), is raced again
    (``python -m bert_ds.kernels.build --recheck`` races again in any case).
    """
    fused = _fused_problems()  # before the record's lock: the self-check takes it too
    shapes = shapes or OpShapes()

    def run_race() -> dict[str, Any]:
        device = race_device()
        timed, excluded = speed.candidates(fused, _apex_problem(device))
        logger.info("kernels=auto: timing each op's candidates on %s at %s", device_key()["device"],
                    shapes.describe())
        choices = speed.race(shapes, device, timed, excluded, race_timer or speed.best_seconds_per_call)
        return {"shapes": dataclasses.asdict(shapes), "candidates": speed.candidate_names(),
                "race": speed.RACE_VERSION, "ops": {op: c.to_json() for op, c in choices.items()}}

    def same_race(section: dict[str, Any]) -> bool:
        return section.get("candidates") == speed.candidate_names() and section.get("race") == speed.RACE_VERSION

    section = recorded(f"choices {shapes.key}", run_race, holds=same_race)
    return {op: Choice.from_json(c) for op, c in section["ops"].items()}


def _fused_problems() -> dict[str, str]:
    """Per op, why its fused kernel is no candidate ("" if it is one)."""
    extension, reason = load_extension()
    if extension is None:
        return {op: f"the fused CUDA kernels cannot load: {reason}" for op in OPS}
    verdicts = op_verdicts()
    return {op: f"failed the self-check: {verdicts[op]}" if verdicts.get(op) else "" for op in OPS}


def _apex_problem(device: torch.device) -> str:
    """Why apex's fused LayerNorm is no candidate ("" if it is one: installed and correct here)."""
    if layer_norm.APEX_LAYER_NORM is None:
        return "apex is not installed"
    why = selfcheck.verdict(
        lambda: selfcheck.check_layer_norm(layer_norm.layer_norm_apex, device, mixed_dtypes=False,
                                           without_bias=False))
    return f"failed the self-check: {why}" if why else ""


consult(op_verdicts)  # "cuda" comes from resolve_backend: the dispatch reads the verdicts from then on
