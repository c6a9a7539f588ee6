"""What every evaluation command does with its fine-tuning runs: one JSON file per (task, seed)
under ``--output``, kept by a rerun when it was made from the same model, data and recipe (and
refused, never mixed in, when not), and the figures over seeds that the results table shows."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import ConfigError, UserError
from bert_ds.eval import recipe


def add_common_arguments(p: argparse.ArgumentParser, *, data: str, recipes: str, length: str) -> None:
    """The flags every evaluation command takes (``data``: what --data holds; ``recipes``: the
    built-in recipes' folder under bert_ds/recipes; ``length``: what --max-seq-length bounds)."""
    p.add_argument("--model", required=True, type=Path,
                   help="an export, or a Hugging Face BERT or ModernBERT folder (config.json, tokenizer)")
    p.add_argument("--data", required=True, type=Path, help=data)
    p.add_argument("--output", required=True, type=Path, help="results folder (a rerun keeps what is done)")
    p.add_argument("--seeds", type=int, default=3, help="fine-tuning runs (per task; seeds SEED..SEED+N-1)")
    p.add_argument("--seed", type=int, default=1, help="the first seed")
    p.add_argument("--recipe", default=recipe.DEFAULT, help=f"a recipe name (bert_ds/recipes/{recipes}/NAME.json) or a file")
    p.add_argument("--lr", type=float, default=None, help="override the recipe's learning rate")
    p.add_argument("--epochs", type=float, default=None, help="override the recipe's epochs")
    p.add_argument("--batch-size", type=int, default=None, help="override the recipe's batch size")
    p.add_argument("--max-seq-length", type=int, default=None, help=f"override the recipe's {length}")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


# The common flags as keys of a phase plan's "evaluate" stage, with their types.
STAGE_KEYS: dict[str, type | tuple[type, ...]] = {
    "seeds": int, "seed": int, "batch_size": int, "max_seq_length": int, "lr": (int, float), "epochs": (int, float),
    "recipe": str}


def seed_file(output: Path, task: str, seed: int) -> Path:
    return output / task / f"seed{seed}.json"


def seed_folder(output: Path, task: str, seed: int) -> Path:
    """Where a run keeps files beside its scores (SQuAD's predictions); its ``seed_file`` is
    written after them, so a run whose file is there has them whole."""
    return output / task / f"seed{seed}"


def kept(output: Path, task: str, seed: int, identity: Mapping[str, str], recipe: dict[str, Any]) -> dict | None:
    """The finished run of ``task`` and ``seed`` made from the same ``identity`` (model, data)
    and ``recipe``, or None where there is none; one made from others is refused."""
    path = seed_file(output, task, seed)
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
        same = all(result[k] == v for k, v in identity.items()) and result["recipe"] == recipe
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path}: unreadable; move it away to run {task} seed {seed} again") from None
    if not same:
        raise UserError(f"--output {output}: {path.name} of {task} was made from another model, data or "
                        "recipe; give another --output (results are never mixed or overwritten)")
    return result


def run_seeds(output: Path, task: str, seeds: Sequence[int], identity: Mapping[str, str], recipe: dict[str, Any],
              finetune: Callable[[int], dict[str, Any]], line: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """Each seed's run of ``task``: kept from an earlier run, or ``finetune(seed)`` written to its
    file as soon as it ends (an interrupted evaluation goes on from there). Every kept run is
    checked before anything trains: a refusal must not come after hours."""
    kept_runs = {seed: kept(output, task, seed, identity, recipe) for seed in seeds}
    done = []
    for seed in seeds:
        result = kept_runs[seed]
        if result is not None:
            print(f"{line(result)}: kept from an earlier run", flush=True)
        else:
            result = {**finetune(seed), **identity, "recipe": recipe}
            (output / task).mkdir(parents=True, exist_ok=True)
            atomic_write(seed_file(output, task, seed), json.dumps(result, indent=2) + "\n")
            print(line(result), flush=True)
        done.append(result)
    return done


def write_report(output: Path, report: dict[str, Any], markdown: str) -> None:
    """``results.json`` and ``results.md``, the table printed too."""
    atomic_write(output / "results.json", json.dumps(report, indent=2) + "\n")
    atomic_write(output / "results.md", markdown)
    print(markdown, end="")


def recipe_summary(r: Mapping[str, Any]) -> str:
    """A recipe's settings as a results table's heading names them."""
    epochs = f"{r['epochs']:g} epoch{'' if r['epochs'] == 1 else 's'}"
    return (f"lr {r['learning_rate']:g}, batch {r['batch_size']}, {epochs}, warm-up {r['warmup_ratio']:g}, "
            f"weight decay {r['weight_decay']:g}")


def figures(per_seed: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per figure: the median, min and max over the seeds' runs."""
    return {key: {"median": statistics.median(s[key] for s in per_seed), "min": min(s[key] for s in per_seed),
                  "max": max(s[key] for s in per_seed)} for key in per_seed[0]}


def stage_args(command: str, add_arguments: Callable[[argparse.ArgumentParser], None], values: Any, model: Path,
               output: Path, kinds: Mapping[str, type | tuple[type, ...]], lists: Sequence[str] = ()) -> argparse.Namespace:
    """A phase plan's ``"evaluate": {COMMAND: {...}}`` as the command's arguments: ``data``
    required, the keys of ``kinds`` as the flags of those names (typed as given; those in
    ``lists`` a list of strings, joined by commas); the model and output come from the plan."""
    where = f"phase plan: evaluate.{command}"
    if not isinstance(values, dict) or not isinstance(values.get("data"), str):
        raise ConfigError(f'{where} must be an object with "data" (the {command} data folder)')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(model), "--data", values["data"], "--output", str(output),
                              "--no-progress"])
    allowed = {"data", *kinds, *lists}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    for key, value in values.items():
        if key in lists:
            if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                raise ConfigError(f"{where}.{key} must be a list of names")
            value = ",".join(value)
        elif key == "data":
            value = Path(value)
        elif not isinstance(value, kinds[key]) or isinstance(value, bool):
            kind = ("an integer" if kinds[key] is int else "a number" if isinstance(kinds[key], tuple)
                    else "a string")
            raise ConfigError(f"{where}.{key} must be {kind}, got {value!r}")
        setattr(args, key, value)
    return args


def ours_or_empty(output: Path, tasks: str | Sequence[str], what: str) -> None:
    """An --output that exists must be empty or an earlier evaluation of ``tasks``: its files
    are rewritten, and another folder's files of those names are not ours to replace."""
    tasks = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    if not output.is_dir() or not any(output.iterdir()):
        return
    earlier = any((output / name).is_dir() for name in tasks)
    try:
        results = output / "results.json"
        earlier = earlier and (not results.is_file() or json.loads(results.read_text()).get("task") in tasks)
    except (OSError, ValueError, AttributeError):
        earlier = False
    if not earlier:
        raise UserError(f"--output {output} exists and holds no {what} results; give a new or empty folder")


# What transformers makes a tokenizer of: a fast one's file, WordPiece's vocabulary (BERT),
# byte-level BPE's (with merges.txt), SentencePiece's model.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model")


def check_tokenizer(model: Path, fast_because: str | None = None):
    """``model``'s tokenizer, checked: it loads, it is a fast one where ``fast_because`` says what
    needs it, and it has a padding token (every batch is padded to its longest example)."""
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise UserError(f"--model {model}: no tokenizer to load ({str(e).splitlines()[0]})") from None
    if fast_because and not getattr(tokenizer, "is_fast", False):
        raise UserError(f"--model {model}: its tokenizer ({type(tokenizer).__name__}) is not a fast one; "
                        f"{fast_because} (save one with tokenizer.json in the folder)")
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise UserError(f"--model {model}: its tokenizer has no padding token, which batches of examples of "
                        "several lengths need; name one (pad_token) in its tokenizer_config.json")
    return tokenizer


def check_length(model: Path, length: int) -> None:
    """``length`` tokens (the recipe's, never the model's own limit: ModernBERT's 8,192 positions
    are far more than a task needs) fit the positions the model has (``max_position_embeddings``
    in its config.json: BERT's 512), where it names them."""
    try:
        limit = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"--model {model}: config.json is unreadable ({e})") from None
    if isinstance(limit, int) and not isinstance(limit, bool) and length > limit:
        raise UserError(f"max_seq_length {length} (--max-seq-length or the recipe's): the model has {limit} "
                        f"positions (max_position_embeddings in {model / 'config.json'}); give a length up to it")


def check_inputs(args: argparse.Namespace, ours_or_empty: Callable[[Path], None], *, model_exists: bool) -> None:
    """What every evaluation command checks first: ``--seeds``, the model folder (unless a phase
    plan is still to make it), the data folder, and an ``--output`` it may write
    (``ours_or_empty``: an earlier evaluation of its own, or nothing)."""
    from bert_ds.config import check_writable

    if args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    if model_exists and not (args.model / "config.json").is_file():
        from bert_ds.checkpoint import store

        run = store.run_checkpoints(args.model).is_dir()  # a training run's folder: the command to export it
        how = (f"its newest checkpoint with python -m bert_ds.checkpoint.export {args.model} {args.model / 'hf'}"
               if run else "a checkpoint with python -m bert_ds.checkpoint.export")
        raise UserError(f"--model {args.model}: not a Hugging Face model folder (no config.json); export {how}")
    if model_exists and not any((args.model / name).is_file() for name in TOKENIZER_FILES):
        # transformers would make a tokenizer of the special tokens alone, and fine-tune on [UNK]s
        raise UserError(f"--model {args.model}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); copy in the "
                        "tokenizer the model was trained with")
    if not args.data.is_dir():
        raise UserError(f"--data {args.data}: {'not a folder' if args.data.exists() else 'no such folder'}")
    check_writable(args.output, "--output", folder=True)
    ours_or_empty(args.output)
