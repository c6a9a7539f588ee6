"""``python -m bert_ds.eval glue``: fine-tune a model on the GLUE tasks and report their scores.

    python -m bert_ds.eval glue --model DIR --data DIR --output DIR
                                [--tasks mnli,qqp,...] [--seeds 3] [--recipe bert_paper]
                                [--lr X] [--epochs N] [--batch-size N] [--max-seq-length N]

``--model`` is a bert_ds export (``python -m bert_ds.checkpoint.export``) or a Hugging Face
BERT or ModernBERT folder; ``--data`` holds the tasks' folders in any layout of
:mod:`bert_ds.eval.glue_data`. Every task is read and checked before the first one trains.
Each (task, seed) is one fine-tuning run (:mod:`bert_ds.eval.finetune`) whose scores go to
``OUTPUT/TASK/seedN.json`` as soon as it ends; ``OUTPUT/results.md`` and ``results.json``
hold the table: per dev set, the median over seeds of the task's score, the spread
(min-max) and the seeds' count, then the BERT paper's average (:mod:`bert_ds.eval.metrics`).

The same command run again keeps the runs already done (an interrupted evaluation goes on
where it stopped) when they were made from the same model, data and recipe; a results
folder of another model or recipe is refused, never mixed into the table or overwritten.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import ConfigError, UserError
from bert_ds.eval import metrics, recipe as recipes, runs
from bert_ds.eval.glue_data import EXCLUDED, TASKS, Examples, Task, read_split


def add_arguments(p: argparse.ArgumentParser) -> None:
    runs.add_common_arguments(p, data="the folder holding the tasks' folders (SST-2/ or sst2/)", recipes="glue",
                              length="sequence length")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")


def parse_tasks(text: str) -> list[Task]:
    names = [n.strip().lower().replace("-", "") for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError("--tasks: name at least one task")
    for name in names:
        if name in EXCLUDED:
            raise ConfigError(f"--tasks: {name} is {EXCLUDED[name]}")
        if name not in TASKS:
            raise ConfigError(f"--tasks: unknown task {name!r} (known: {', '.join(TASKS)})")
    return [TASKS[n] for n in dict.fromkeys(names)]


@dataclass
class Prepared:
    """A GLUE evaluation checked and read, before anything trains."""

    tasks: list[Task]
    recipe: recipes.Recipe  # with the command line's overrides
    data: dict[str, tuple[Examples, dict[str, Examples]]]  # task -> (train, {dev set: examples})
    seeds: list[int]
    identity: dict[str, str]  # what a kept result must have been made from


def prepare(args: argparse.Namespace, *, model_exists: bool = True) -> Prepared:
    """Every input checked and every task's data read (``model_exists=False``: the model is
    still to be trained, by a phase plan that ends with this evaluation)."""
    tasks = parse_tasks(args.tasks)
    runs.check_inputs(args, _ours_or_empty, model_exists=model_exists)
    recipe = recipes.load(args.recipe).with_overrides(
        learning_rate=args.lr, epochs=args.epochs, batch_size=args.batch_size, max_seq_length=args.max_seq_length)
    if model_exists:
        runs.check_length(args.model, max(recipe.for_task(task.name).max_seq_length for task in tasks))
    data = {task.name: (read_split(args.data, task, "train"),
                        {name: read_split(args.data, task, name) for name, _, _ in task.evals}) for task in tasks}
    if model_exists:
        runs.check_tokenizer(args.model)  # last: imports transformers
    seeds = list(range(args.seed, args.seed + args.seeds))
    return Prepared(tasks, recipe, data, seeds, {"model": str(args.model.resolve()), "data": str(args.data.resolve())})


def run(args: argparse.Namespace, prepared: Prepared | None = None) -> dict[str, Any]:
    import torch

    from bert_ds.eval.finetune import finetune

    p = prepared or prepare(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # Every kept result is checked before anything trains: a refusal must not come after hours.
    kept = {(t.name, s): runs.kept(args.output, t.name, s, p.identity, p.recipe.for_task(t.name).to_dict())
            for t in p.tasks for s in p.seeds}
    done: dict[str, list[dict[str, Any]]] = {}
    for task in p.tasks:
        recipe = p.recipe.for_task(task.name)
        train, evals = p.data[task.name]
        for seed in p.seeds:
            result = kept[task.name, seed]
            if result is not None:
                print(f"{_line(task, result)}: kept from an earlier run", flush=True)
            else:
                result = finetune(args.model, task, train, evals, recipe, seed, device, progress=not args.no_progress)
                result.update(p.identity, recipe=recipe.to_dict())
                (args.output / task.name).mkdir(parents=True, exist_ok=True)
                atomic_write(runs.seed_file(args.output, task.name, seed), json.dumps(result, indent=2) + "\n")
                print(_line(task, result), flush=True)
            done.setdefault(task.name, []).append(result)
    report = {**p.identity, "recipe": p.recipe.to_dict(), "seeds": p.seeds, **summarize(p.tasks, done)}
    atomic_write(args.output / "results.json", json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    atomic_write(args.output / "results.md", text)
    print(text, end="")
    return report


def stage_args(values: Any, model: Path, output: Path) -> argparse.Namespace:
    """A phase plan's ``"evaluate": {"glue": {...}}`` as this command's arguments: ``data``
    required; ``tasks`` (a list), ``seeds``, ``seed``, ``recipe``, ``lr``, ``epochs``,
    ``batch_size``, ``max_seq_length`` as the flags; the model and output come from the plan."""
    return runs.stage_args("glue", add_arguments, values, model, output, STAGE_KEYS, lists=("tasks",))


STAGE_KEYS = runs.STAGE_KEYS


def _ours_or_empty(output: Path) -> None:
    """An --output that exists must be empty or an earlier GLUE evaluation: its results.md and
    results.json are rewritten, and another folder's files of those names are not ours to replace."""
    if not output.is_dir() or not any(output.iterdir()):
        return
    earlier = any((output / name).is_dir() for name in TASKS) or (output / "results.json").is_file()
    try:
        earlier = earlier and (not (output / "results.json").is_file()
                               or "columns" in json.loads((output / "results.json").read_text()))
    except (OSError, ValueError):
        earlier = False
    if not earlier:
        raise UserError(f"--output {output} exists and holds no GLUE results; give a new or empty folder")


def _line(task: Task, result: dict[str, Any]) -> str:
    scores = ", ".join(f"{name} {s['score']:.2f}" for name, s in result["scores"].items())
    return (f"{task.name} seed {result['seed']}: {scores} ({task.metric}; {result['steps']} steps, "
            f"{result['seconds']:.0f} s)")


def summarize(tasks: list[Task], done: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per dev set: median, min and max over seeds of each figure; the paper's average of the medians."""
    columns: dict[str, dict[str, Any]] = {}
    for task in tasks:
        for name, _, _ in task.evals:
            per_seed = [r["scores"][name] for r in done[task.name]]
            columns[name] = {"task": task.name, "metric": task.metric, "seeds": len(per_seed),
                             "figures": runs.figures(per_seed)}
    value, missing = metrics.average({name: c["figures"]["score"]["median"] for name, c in columns.items()})
    return {"columns": columns, "average": None if math.isnan(value) else value, "average_missing": missing}


def markdown(report: dict[str, Any]) -> str:
    r = report["recipe"]
    lines = [f"# GLUE dev results: {report['model']}", "",
             f"Recipe {r['name']} ({runs.recipe_summary(r)}, max length {r['max_seq_length']}"
             + (f"; per task: {json.dumps(r['per_task'])}" if r["per_task"] else "") + f"); seeds {report['seeds']}.",
             "Each cell: the median over seeds of the task's score, (min-max) over seeds. Scores in percent: "
             "CoLA Matthews correlation, MRPC and QQP F1, STS-B Spearman, accuracy elsewhere.", "",
             "| dev set | metric | median | min-max | other figures (median) |", "|---|---|---:|---:|---|"]
    for name, c in report["columns"].items():
        f = c["figures"]
        others = ", ".join(f"{k} {v['median']:.2f}" for k, v in f.items() if k not in ("score", c["metric"]))
        lines.append(f"| {name} | {c['metric']} | {f['score']['median']:.2f} | {f['score']['min']:.2f}-"
                     f"{f['score']['max']:.2f} | {others} |")
    lines.append("")
    if report["average"] is not None:
        missing = report["average_missing"]
        lines.append(f"**Average {report['average']:.2f}**: the BERT paper's (mean of MNLI-m, MNLI-mm, QQP, QNLI, "
                     "SST-2, CoLA, STS-B, MRPC, RTE; BERT-Base: 79.6 on the test server)"
                     + (f"; over the dev sets run, without {', '.join(missing)}: not comparable to it" if missing
                        else "") + ".")
    return "\n".join(lines) + "\n"
