"""docs/configuration.md, generated from the code it describes.

    python -m bert_ds.tools.config_reference            # print the page
    python -m bert_ds.tools.config_reference --write    # write docs/configuration.md
    python -m bert_ds.tools.config_reference --check    # exit 1 when the page differs from the code

Design choices:
- Every figure of the page comes from the code: the flags, defaults and help texts from
  ``bert_ds.train.cli.build_parser``, the fields and their defaults from the config
  dataclasses, each field's meaning from the comment on its line in the source (the
  dataclasses carry their reasons inline), the presets from ``PRESETS``, the engine files
  from ``ds_configs/``. A test compares the page with this output, so the reference cannot
  drift from the code.
- Which flag sets which field is read from the parser's source: a flag whose default is
  ``o.lr`` (``o`` the OptimConfig defaults) sets ``optim.lr``. The few flags whose default is
  not a field's are named in ``_FLAG_FIELDS``; a test checks that each exists.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import json
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

from bert_ds.config import DS_CONFIG_DIR, DataConfig, OptimConfig, TrainConfig
from bert_ds.model.families import FAMILIES, PRESETS, family_of_preset
from bert_ds.train import cli

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# (dataclass, section name in a phase plan's JSON)
SECTIONS: tuple[tuple[type, str], ...] = (
    (TrainConfig, ""), (DataConfig, "data"), (OptimConfig, "optim"),
    *((family.config_class, "model") for family in FAMILIES.values()))

# Flags whose default is not read from a field's default in build_parser, and the fields each sets.
_FLAG_FIELDS: dict[str, tuple[str, ...]] = {
    "--data": ("data.train",),
    "--data-weights": ("data.weights",),
    "--val-data": ("data.val",),
    "--whole-word-mask": ("data.whole_word_mask",),
    "--activation-checkpointing": ("model.activation_checkpointing",),
    "--compile-layers": ("model.compile_layers",),
    "--dropout": tuple(f"model.{name}" for family in FAMILIES.values() for name in family.dropout_fields),
    "--init-from": ("init_from",),
    "--ds-config": ("ds_config",),
    "--no-tensorboard": ("tensorboard",),
    "--no-progress": ("progress",),
    # the model family's default where not given (its data_defaults)
    "--pair-task": ("data.pair_task",),
    "--layout": ("data.layout",),
    "--token-budget": ("data.token_budget",),
    "--mask-rate": ("data.mask_rate",),
}
_DEFAULTS_OF = {"DataConfig": "data.", "OptimConfig": "optim.", "TrainConfig": "", "DefaultModelConfig": "model."}


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the one on its line, after any comment lines just above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    trailing: dict[int, str] = {}  # line -> the comment after the code on it
    alone: dict[int, str] = {}  # line -> a comment line of its own
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (alone if tok.line.lstrip().startswith("#") else trailing)[tok.start[0]] = text
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line in alone:
                above.insert(0, alone[line])
                line -= 1
            out[node.target.id] = " ".join(above + [trailing.get(node.lineno, "")]).strip()
    return out


@functools.cache
def flag_fields() -> dict[str, tuple[str, ...]]:
    """flag -> the fields it sets (``section.name``; --dropout's: each family's), read from the train CLI's source: build_parser
    and the helpers it hands the defaults to under the same names (``_add_optimizer_flags(p, o)``)."""
    tree = ast.parse(inspect.getsource(cli))
    prefix: dict[str, str] = {}
    for node in ast.walk(tree):  # d, o, t, m = _Defaults(DataConfig), ...
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            for name, call in zip(node.targets[0].elts, node.value.elts, strict=True):
                if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "_Defaults":
                    prefix[name.id] = _DEFAULTS_OF[call.args[0].id]
    out = dict(_FLAG_FIELDS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if isinstance(default, ast.Attribute) and getattr(default.value, "id", None) in prefix:
                out[node.args[0].value] = (prefix[default.value.id] + default.attr,)
    return out


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(value: object) -> str:
    if value is None or value == "":
        return "none"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value) if not isinstance(value, str) else value}`"


def _type(hint: object) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " or ".join(f"`{json.dumps(v)}`" for v in typing.get_args(hint))
    text = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
    return f"`{text}`"


def flags_section() -> list[str]:
    parser = cli.build_parser()
    sets = flag_fields()
    lines = ["## Flags", "",
             "`python -m bert_ds.train` (also `bert-ds-train`, and the ARGS of `./run.sh pretrain` and "
             "`./run.sh multinode`). A flag left out takes the default shown; resuming, every model flag left "
             "out keeps the checkpoint's value.", ""]
    for group in parser._action_groups:  # argparse keeps no public list of groups
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS
                   and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        if group.title not in ("options", "optional arguments"):
            lines += [f"{group.title.capitalize()}:", ""]
        lines += ["| flag | default | sets | meaning |", "|---|---|---|---|"]
        for a in actions:
            flag = ", ".join(f"`{o}`" for o in a.option_strings)
            value = "required" if a.required else ("off" if a.nargs == 0 and a.default is not None else _default(a.default))
            choices = f" ({', '.join(map(str, a.choices))})" if a.choices else ""
            fields = ", ".join(f"`{field}`" for field in sets.get(a.option_strings[0], ()))
            lines.append(f"| {flag} | {value} | {fields} | {_cell(a.help)}{choices} |")
        lines.append("")
    return lines


def dataclass_section(cls: type, section: str) -> list[str]:
    comments = field_comments(cls)
    by_field = {field: flag for flag, fields in flag_fields().items() for field in fields}
    key = f"`{section}`" if section else "the top level"
    lines = [f"## {cls.__name__}", "", f"In a phase plan: {key}.", "",
             "| field | type | default | flag | meaning |", "|---|---|---|---|---|"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = _default(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()
            default = "see below" if dataclasses.is_dataclass(made) else _default(made)
        else:
            default = "required"
        flag = by_field.get(f"{section}.{f.name}" if section else f.name, "")
        lines.append(f"| `{f.name}` | {_cell(_type(hints[f.name]))} | {default} | {f'`{flag}`' if flag else ''} "
                     f"| {_cell(comments.get(f.name, ''))} |")
    return lines + [""]


def preset_parameters(name: str, vocab_size: int | None = None) -> int:
    """Parameters of the preset's pretraining model (its family's vocabulary by default), counted
    on the meta device (nothing allocated)."""
    from bert_ds.model.build import meta_model
    from bert_ds.model.families import model_preset

    vocab_size = vocab_size or family_of_preset(name).published_vocab_size
    return sum(p.numel() for p in meta_model(model_preset(name, vocab_size)).parameters())


def presets_section() -> list[str]:
    lines = ["## Presets", "",
             "`--preset NAME`; in a phase plan `\"model\": {\"preset\": NAME, ...field overrides}`. Parameters of "
             "the pretraining model with its heads, at its family's published vocabulary ("
             + ", ".join(f"{f.name} {f.published_vocab_size:,}" for f in FAMILIES.values())
             + "; the decoder is tied to the token embedding). A preset's family sets the data defaults its flags "
             "leave out: " + "; ".join(f"{f.arch}: " + ", ".join(f"`{k}` {_default(v)}" for k, v in f.data_defaults.items())
                                       for f in FAMILIES.values()) + ".", "",
             "| preset | family | layers | hidden | heads | FFN | parameters |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, sizes in PRESETS.items():
        lines.append(f"| `{name}` | {family_of_preset(name).arch} | {sizes['num_layers']} | {sizes['hidden_size']} "
                     f"| {sizes['num_heads']} | {sizes['intermediate_size']} | {preset_parameters(name) / 1e6:.1f}M |")
    return lines + [""]


def ds_configs_section() -> list[str]:
    lines = ["## DeepSpeed configs", "",
             "`--ds-config NAME` (a file below, from `ds_configs/`) or a path to your own JSON. They set the "
             "engine only; batch sizes, clipping, the optimizer and the schedule come from the flags above, "
             "and a JSON that sets them is refused.", "",
             "| file | ZeRO stage | precision | other settings |", "|---|---:|---|---|"]
    for path in sorted(DS_CONFIG_DIR.glob("*.json")):
        ds = json.loads(path.read_text())
        zero = ds.get("zero_optimization", {})
        precision = "bf16" if ds.get("bf16", {}).get("enabled") else "fp16" if ds.get("fp16", {}).get("enabled") else "fp32"
        rest = {k: v for k, v in zero.items() if k != "stage"}
        rest.update({k: v for k, v in ds.items() if k not in ("zero_optimization", "bf16", "fp16")})
        rest.update({f"fp16.{k}": v for k, v in ds.get("fp16", {}).items() if k != "enabled"})
        other = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in rest.items())
        lines.append(f"| `{path.name}` | {zero.get('stage', 0)} | {precision} | {other} |")
    return lines + [""]


def page() -> str:
    lines = ["# Configuration reference", "",
             "<!-- Generated by `python -m bert_ds.tools.config_reference --write` from the code; "
             "do not edit by hand (tests/test_docs.py fails when it differs). -->", "",
             "Every setting of a training run, as the code defines it. A run is set by the flags of "
             "`python -m bert_ds.train`; a phase plan of `python -m bert_ds.train.phases` (see "
             "[Training](training.md)) uses the field names of the dataclasses below, which is also what a "
             "checkpoint's `train_config.json` records. Each value is checked when the configuration is built, "
             "so a bad one stops the run in one `error:` line before anything starts.", "",
             "- [Flags](#flags)", "- [TrainConfig](#trainconfig)", "- [DataConfig](#dataconfig)",
             "- [OptimConfig](#optimconfig)",
             *(f"- [{f.config_class.__name__}](#{f.config_class.__name__.lower()}) ({f.name})" for f in FAMILIES.values()),
             "- [Presets](#presets)",
             "- [DeepSpeed configs](#deepspeed-configs)", ""]
    lines += flags_section()
    for cls, section in SECTIONS:
        lines += dataclass_section(cls, section)
    lines += presets_section() + ds_configs_section()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bert_ds.tools.config_reference", description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(PAGE.parents[1])}")
    what.add_argument("--check", action="store_true", help="exit 1 when the page differs from the code")
    args = p.parse_args(argv)
    text = page()
    if args.write:
        PAGE.parent.mkdir(exist_ok=True)
        PAGE.write_text(text)
        print(f"wrote {PAGE}")
    elif args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"error: {PAGE} differs from the code; run python -m bert_ds.tools.config_reference --write",
                  file=sys.stderr)
            return 1
        print(f"ok: {PAGE} matches the code")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
