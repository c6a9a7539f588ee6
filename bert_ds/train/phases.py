"""A multi-phase recipe from one JSON file: BERT's two phases (most steps at 128 tokens, then
512), ModernBERT's (1,024 tokens, then a context extension to 8,192 with a larger rotary base,
then a decay).

    python -m bert_ds.train.phases --config bert_ds/recipes/bert_base_two_phase.json
    torchrun --nproc-per-node 8 -m bert_ds.train.phases --config FILE.json
    python -m bert_ds.train.phases --config FILE.json --check     # validate and print the plan

The file holds the run's output folder, the model (a preset plus field overrides), a
base training configuration shared by every phase, and the phases in order, each with
its name, steps and overrides of the base (``data`` and ``optim`` are merged key by key)::

    {"output": "runs/bert-base",
     "model": {"preset": "base"},
     "base": {"data": {"train": ["..."]}, "optim": {"name": "lamb"}, "ds_config": "zero1_bf16.json"},
     "phases": [{"name": "phase1", "steps": 7038, "data": {"max_seq_length": 128}, "optim": {"lr": 6e-3}},
                {"name": "phase2", "steps": 1563, "data": {"max_seq_length": 512}, "optim": {"lr": 4e-3}}]}

Design choices:
- Every phase is an ordinary ``bert_ds.train`` run in ``OUTPUT/<phase name>`` with a
  :class:`~bert_ds.config.TrainConfig` built and validated up front, so a typo in the
  last phase fails before the first one starts (unknown keys are a ConfigError). The model's
  family sets the data settings the plan leaves out, as on the command line
  (the family's ``data_defaults``: ModernBERT's whole documents, token budget, 30%
  masking, no pair task).
- A phase may change what leaves the weights' shapes as they are: the kernels and layer
  settings, and a ModernBERT's rotary bases (its context extension raises the global layers'
  theta).
- A phase after the first starts from the previous phase's final weights
  (``model.safetensors``, fp32 master copy) with a fresh optimizer and LR schedule, so it
  warms up again: what NVIDIA's and Google's BERT recipes do between the phases.
- Rerunning the same command resumes: a phase whose final checkpoint exists is not rerun,
  and a phase with checkpoints resumes from its newest one (its weights come from there,
  not from the previous phase). A stop signal ends the command after the phase's checkpoint.
- An optional last stage, ``"evaluate": {"glue": {"data": "DIR", "tasks": [...], "seeds": 3},
  "squad": {"data": "DIR"}, "ner": {"data": "DIR"}, "retrieval": {"data": "DIR"}}`` (any of
  them), exports the final weights to ``OUTPUT/hf`` and fine-tunes them into ``OUTPUT/glue``,
  ``OUTPUT/squad``, ``OUTPUT/ner``, ``OUTPUT/retrieval`` (``python -m bert_ds.eval glue``,
  ``squad``, ``ner``, ``retrieval``; their data is read and checked before the
  first phase).
- Exit statuses are those of ``bert_ds.train``.
- The plan is read and checked by torch-free modules; the training's (torch, DeepSpeed) are
  imported once the command line is read, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_ds.base.errors import ConfigError
from bert_ds.config import TrainConfig
from bert_ds.eval import glue, ner, retrieval, squad
from bert_ds.model.families import FAMILIES, PRESETS, family_of, model_preset

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MERGED = ("data", "optim")  # sections a phase overrides key by key
_SET_BY_PHASES = ("model", "output", "steps", "init_from")  # a phase's TrainConfig gets these from the plan
# the evaluation stage's commands, in the order they run
EVALUATIONS = {"glue": glue, "squad": squad, "ner": ner, "retrieval": retrieval}


@dataclass(frozen=True)
class Evaluation:
    """One command of the evaluation stage, checked and its data read."""

    name: str
    module: Any  # bert_ds.eval.glue, .squad, .ner or .retrieval: stage_args, prepare, run
    args: argparse.Namespace
    prepared: Any
# all a phase may change about the model: nothing of the weights' shapes; how it is computed, and
# what a family's record adds (a ModernBERT's rotary bases: a context extension raises them)
_PHASE_MODEL_KEYS = ("activation_checkpointing", "compile_layers", "kernels",
                     *dict.fromkeys(name for family in FAMILIES.values() for name in family.phase_fields))


@dataclass
class Phase:
    name: str  # also the phase's folder under the plan's output
    steps: int  # optimizer steps of this phase (its own count and schedule)
    overrides: dict[str, Any]  # TrainConfig fields that differ from the base ("data"/"optim": partial)
    model: dict[str, Any]  # subset of _PHASE_MODEL_KEYS

    @classmethod
    def from_dict(cls, d: Any, index: int) -> Phase:
        if not isinstance(d, dict):
            raise ConfigError(f"phases[{index}]: must be an object, got {type(d).__name__}")
        d = dict(d)
        name, steps = d.pop("name", None), d.pop("steps", None)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(f"phases[{index}]: name must be a folder-safe string, got {name!r}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
            raise ConfigError(f"phase {name!r}: steps must be a positive integer, got {steps!r}")
        model = d.pop("model", {})
        bad = sorted(set(model) - set(_PHASE_MODEL_KEYS)) if isinstance(model, dict) else ["(not an object)"]
        if bad:
            raise ConfigError(f"phase {name!r}: a phase may change only {', '.join(_PHASE_MODEL_KEYS)} of the model, "
                              f"not {', '.join(bad)} (the weights carry over between phases)")
        clash = sorted(set(d) & set(_SET_BY_PHASES))
        if clash:
            raise ConfigError(f"phase {name!r}: {', '.join(clash)} is set by the phase plan, not by a phase")
        return cls(name, steps, d, model)


@dataclass
class PhasePlan:
    output: str  # each phase runs in output/<phase name>
    model: dict[str, Any]  # {"preset": name, **model config overrides}; vocab_size comes from the data
    base: dict[str, Any]  # TrainConfig fields shared by all phases (no model, output or steps)
    phases: list[Phase]
    # The commands that make the plan's datasets (optional): named when they are missing.
    prepare: list[str] = dataclasses.field(default_factory=list)
    # What follows the last phase (optional): {"glue": {"data": DIR, ...}, "squad": {...}} exports
    # the final weights to OUTPUT/hf and fine-tunes them into OUTPUT/glue, OUTPUT/squad (bert_ds.eval).
    evaluate: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any) -> PhasePlan:
        if not isinstance(d, dict):
            raise ConfigError("a phase plan must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = sorted(set(d) - known), sorted(known - set(d) - {"prepare", "evaluate"})
        if unknown or missing:
            raise ConfigError(f"phase plan: {'unknown key(s) ' + ', '.join(unknown) if unknown else ''}"
                              f"{'; ' if unknown and missing else ''}"
                              f"{'missing key(s) ' + ', '.join(missing) if missing else ''}")
        if not isinstance(d["model"], dict) or not isinstance(d["model"].get("preset"), str):
            raise ConfigError(f'phase plan: "model" must be an object with a "preset" ({", ".join(PRESETS)})')
        if not isinstance(d["base"], dict):
            raise ConfigError('phase plan: "base" must be an object of training settings')
        clash = sorted(set(d["base"]) & set(_SET_BY_PHASES))
        if clash:
            raise ConfigError(f"phase plan: base sets {', '.join(clash)}; that belongs to the plan or its phases")
        if not isinstance(d["phases"], list) or not d["phases"]:
            raise ConfigError('phase plan: "phases" must be a non-empty list')
        phases = [Phase.from_dict(p, i) for i, p in enumerate(d["phases"])]
        names = [p.name for p in phases]
        if len(set(names)) != len(names):
            raise ConfigError(f"phase plan: phase names must be unique, got {names}")
        prepare = d.get("prepare", [])
        if not isinstance(prepare, list) or not all(isinstance(c, str) for c in prepare):
            raise ConfigError('phase plan: "prepare" must be a list of commands (strings)')
        evaluate = d.get("evaluate", {})
        if not isinstance(evaluate, dict) or set(evaluate) - set(EVALUATIONS):
            raise ConfigError(f'phase plan: "evaluate" must be an object whose keys are of {", ".join(EVALUATIONS)}')
        return cls(str(d["output"]), dict(d["model"]), dict(d["base"]), phases, prepare, dict(evaluate))

    @classmethod
    def load(cls, path: Path) -> PhasePlan:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the phase plan ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None

    def first_dataset(self) -> Path:
        train = self.base.get("data", {}).get("train")
        first = train[0] if isinstance(train, list) and train else train
        if not isinstance(first, str):
            raise ConfigError('phase plan: base.data.train must name the training dataset folder(s)')
        return Path(first)

    def evaluations(self) -> list[Evaluation]:
        """The evaluation stage's commands, their arguments checked and their data read (before
        any phase trains), in the order of EVALUATIONS."""
        found = []
        for name, module in EVALUATIONS.items():
            if name in self.evaluate:
                args = module.stage_args(self.evaluate[name], Path(self.output) / "hf", Path(self.output) / name)
                found.append(Evaluation(name, module, args, module.prepare(args, model_exists=False)))
        return found

    def train_configs(self, from_data: dict[str, int]) -> list[TrainConfig]:
        """Each phase's validated TrainConfig (init_from still unset: it is known once the previous phase
        ends); ``from_data``: what the first dataset sets of the model (:meth:`Manifest.model_fields`)."""
        preset = dict(self.model)
        name = preset.pop("preset")
        configs = []
        for phase in self.phases:
            d = {**self.base, **phase.overrides}
            for section in _MERGED:
                d[section] = {**self.base.get(section, {}), **phase.overrides.get(section, {})}
            try:
                model = model_preset(name, **{**preset, **phase.model, **from_data})
                d["data"] = {**family_of(model).data_defaults, **d["data"]}
                configs.append(TrainConfig.from_dict({**d, "model": model.to_dict(), "steps": phase.steps,
                                                      "output": str(Path(self.output) / phase.name)}))
            except ConfigError as e:
                raise ConfigError(f"phase {phase.name!r}: {e}") from None
            except TypeError as e:  # a value of the wrong JSON type reaching a dataclass
                raise ConfigError(f"phase {phase.name!r}: {e}") from None
        return configs


def finished_checkpoint(cfg: TrainConfig) -> Path | None:
    """The phase's final checkpoint if it has one (the phase is done), else None."""
    from bert_ds.checkpoint import store as checkpoint

    newest = checkpoint.find_latest(checkpoint.run_checkpoints(cfg.output))
    if newest is not None and checkpoint.read_train_state(newest).get("step", 0) >= cfg.steps:
        return newest
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bert_ds.train.phases", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="phase plan JSON (see bert_ds/recipes/)")
    p.add_argument("--check", action="store_true", help="validate the plan, print each phase's settings, and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bert_ds.train.session import entry, locked_session  # torch and the run's modules: once the command line is read

    def body() -> None:
        from bert_ds.base.errors import ShardError
        from bert_ds.data_tools.manifest import Manifest
        from bert_ds.data_tools.partition import dataset_folders

        plan = PhasePlan.load(Path(args.config))
        try:
            manifest = Manifest.load(dataset_folders(plan.first_dataset())[0])
        except ShardError as e:
            if not plan.prepare:
                raise
            raise ConfigError(f"{e}; this plan's data is made by: {' && '.join(plan.prepare)}") from None
        configs = plan.train_configs(manifest.model_fields())
        evaluations = plan.evaluations()  # a typo in the last stage fails before the first phase trains
        if args.check:
            for phase, cfg in zip(plan.phases, configs):
                warmup = (f" after {cfg.batch_warmup_steps} steps from {cfg.batch_warmup_start}"
                          if cfg.batch_warmup_steps else "")
                print(f"{phase.name}: {cfg.steps} steps, seq {cfg.data.max_seq_length}, batch "
                      f"{cfg.global_batch_size}{warmup} (micro {cfg.micro_batch_size}), {cfg.optim.name} lr "
                      f"{cfg.optim.lr:g}, warm-up {cfg.optim.warmup_steps}, {cfg.ds_config} -> {cfg.output}")
            for e in evaluations:
                what = (", ".join(t.name for t in e.prepared.tasks) if e.name == "glue" else
                        f"v{e.prepared.layout.version}" if e.name == "squad" else
                        ", ".join(e.prepared.data.qrels) if e.name == "retrieval" else ", ".join(e.prepared.data.splits))
                print(f"then {e.name}: {what}, seeds {e.prepared.seeds}, recipe {e.prepared.recipe.name}, export "
                      f"{e.args.model} -> {e.args.output}")
            return
        # the phases' folders are inside plan.output: its lock covers them
        with locked_session(plan.output, "bert_ds.train.phases", configs[0].collective_timeout) as (
                rank, world, device, stop):
            final = _run_phases(plan, configs, rank, world, device, stop)
        if final is not None and evaluations and rank == 0:
            _evaluate(final, evaluations, device)

    return entry(body)


def _run_phases(plan: PhasePlan, configs: list[TrainConfig], rank: int, world: int, device, stop) -> Path | None:
    """Each phase not yet finished, in order; the last phase's final checkpoint, or None where a
    phase stopped early (a signal, --exit-after: the same command goes on)."""
    import torch

    from bert_ds.train.loop import run
    from bert_ds.train.summary import print_summary

    say = print if rank == 0 else (lambda *a, **k: None)
    previous: Path | None = None
    for phase, cfg in zip(plan.phases, configs):
        done = finished_checkpoint(cfg)
        if done is not None:
            say(f"[bert_ds.train.phases] {phase.name}: finished ({done}), not rerun", file=sys.stderr, flush=True)
            previous = done
            continue
        if previous is not None:
            cfg = dataclasses.replace(cfg, init_from=str(previous))
        say(f"[bert_ds.train.phases] {phase.name}: {cfg.steps} steps at seq {cfg.data.max_seq_length}"
            f"{', from ' + str(previous) if previous else ''}", file=sys.stderr, flush=True)
        summary = run(cfg, True, rank, world, device, stop=stop)
        if rank == 0:
            print_summary(summary)
        if summary["steps"] < cfg.steps or summary["stopped_by"]:  # a signal or --exit-after: rerun to go on
            say(f"[bert_ds.train.phases] {phase.name}: stopped at step {summary['steps']}; rerun the same "
                "command to resume", file=sys.stderr, flush=True)
            return None
        previous = Path(summary["checkpoint"])
        gc.collect()  # the phase's engine, before the next one is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return previous


def _evaluate(final: Path, evaluations: list[Evaluation], device) -> None:
    """The plan's evaluation stage, on rank 0 once every phase is done: the final weights exported
    to OUTPUT/hf, then fine-tuned by each command; a rerun keeps the runs already finished."""
    from bert_ds.checkpoint.export import export_checkpoint

    model = evaluations[0].args.model
    print(f"[bert_ds.train.phases] evaluate: exporting {final} to {model}", file=sys.stderr, flush=True)
    export_checkpoint(final, model)
    for e in evaluations:
        e.args.device = str(device)
        e.module.run(e.args, e.prepared)


if __name__ == "__main__":
    sys.exit(main())
