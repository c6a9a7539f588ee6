"""A fine-tuning recipe: a JSON file in ``bert_ds/recipes/glue/``, ``squad/``, ``ner/`` or ``retrieval/`` (by
name) or anywhere, typed and checked, with per-task overrides (``"per_task": {"rte":
{"batch_size": 16}}``; SQuAD's tasks are ``squad`` and ``squad_v2``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bert_ds.base.errors import ConfigError, require

RECIPES = Path(__file__).resolve().parent.parent / "recipes" / "glue"
SQUAD_RECIPES = RECIPES.parent / "squad"
NER_RECIPES = RECIPES.parent / "ner"
RETRIEVAL_RECIPES = RECIPES.parent / "retrieval"
DEFAULT = "bert_paper"
_TUNABLE = ("learning_rate", "batch_size", "epochs", "warmup_ratio", "weight_decay", "max_seq_length")


@dataclass(frozen=True)
class Recipe:
    name: str
    learning_rate: float
    batch_size: int
    epochs: float
    warmup_ratio: float  # of the run's steps, linear from 0, then linear decay to 0
    weight_decay: float  # decoupled (AdamW), not on biases and LayerNorm weights
    max_seq_length: int  # longer examples are truncated (the longer text of a pair first)
    description: str = ""
    per_task: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = f"recipe {self.name}: "
        require(isinstance(self.learning_rate, (int, float)) and 0 < self.learning_rate < 1, f"{p}learning_rate",
                f"must be in (0, 1), got {self.learning_rate!r}")
        require(isinstance(self.batch_size, int) and self.batch_size >= 1, f"{p}batch_size",
                f"must be a positive integer, got {self.batch_size!r}")
        require(isinstance(self.epochs, (int, float)) and self.epochs > 0, f"{p}epochs",
                f"must be positive, got {self.epochs!r}")
        require(isinstance(self.warmup_ratio, (int, float)) and 0 <= self.warmup_ratio < 1, f"{p}warmup_ratio",
                f"must be in [0, 1), got {self.warmup_ratio!r}")
        require(isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0, f"{p}weight_decay",
                f"must be >= 0, got {self.weight_decay!r}")
        require(isinstance(self.max_seq_length, int) and 8 <= self.max_seq_length <= 8192, f"{p}max_seq_length",
                f"must be an integer in [8, 8192], got {self.max_seq_length!r}")
        for task, overrides in self.per_task.items():
            unknown = set(overrides) - set(_TUNABLE) if isinstance(overrides, dict) else {"(not an object)"}
            require(not unknown, f"{p}per_task.{task}", f"unknown key(s) {', '.join(sorted(unknown))}; "
                    f"allowed: {', '.join(_TUNABLE)}")

    def for_task(self, task: str) -> Recipe:
        """The recipe with ``task``'s overrides applied (and checked)."""
        return dataclasses.replace(self, per_task={}, **self.per_task.get(task, {}))

    def with_overrides(self, **values: Any) -> Recipe:
        """Command-line overrides (None: keep the recipe's); they win over per-task ones too."""
        given = {k: v for k, v in values.items() if v is not None}
        per_task = {task: {k: v for k, v in o.items() if k not in given} for task, o in self.per_task.items()}
        return dataclasses.replace(self, per_task=per_task, **given)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load(name_or_path: str, folder: Path = RECIPES) -> Recipe:
    """A recipe by name (``bert_paper``: ``FOLDER/bert_paper.json``, GLUE's by default) or path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = folder / f"{name_or_path}.json"
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        known = ", ".join(sorted(p.stem for p in folder.glob("*.json")))
        raise ConfigError(f"--recipe {name_or_path}: no such recipe file (built in: {known})") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"--recipe {path}: unreadable ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--recipe {path}: not a JSON object")
    fields = {f.name for f in dataclasses.fields(Recipe)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"--recipe {path}: unknown key(s) {', '.join(unknown)}")
    missing = sorted(f.name for f in dataclasses.fields(Recipe) if f.name not in values
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ConfigError(f"--recipe {path}: missing key(s) {', '.join(missing)}")
    return Recipe(**values)
