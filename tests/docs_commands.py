"""The commands of README.md and docs/*.md, read out of their ```bash blocks.

A command is recognised by how it starts (``python -m``, ``torchrun``, ``deepspeed``,
``srun``/``mpirun``, the ``bert-ds-*`` scripts, ``./run.sh``, a script under
``examples/`` or ``benchmarks/``); :func:`target` says which ``--help`` answers for it and
which ``--flags`` it uses. A line that starts like one of ours but cannot be read is an
error, so no command goes unchecked.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN_MARK = "<!-- docs-test: run -->"  # before a ```bash block: the docs test runs it end to end
OUTPUT_MARK = "<!-- docs-test: output -->"  # before a ```text block: what the last command above it prints

SCRIPTS = {"bert-ds-train": "bert_ds.train", "bert-ds-data": "bert_ds.data_tools",
           "bert-ds-export": "bert_ds.checkpoint.export", "bert-ds-eval": "bert_ds.eval"}
PYTHONS = ("python", "python3", ".venv/bin/python", "$VENV/bin/python")
NOT_OURS = ("pip", "venv", "pytest", "ruff")  # python -m X of other projects
LAUNCHERS = ("srun", "mpirun", "mpiexec")  # [opts] python -m MODULE ...
# ./run.sh modes whose ARGS go to a module (plot's first argument is the run folder)
RUN_SH_MODULES = {"pretrain": "bert_ds.train", "multinode": "bert_ds.train", "bench": "bert_ds.tools.bench",
                  "plot": "bert_ds.tools.plot"}


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence
    text: str
    runnable: bool


@dataclass
class Command:
    where: str  # file:line
    argv: list[str]


@dataclass
class Target:
    """What answers ``--help`` for a command, and the flags the command gives it."""

    help_argv: tuple[str, ...]  # e.g. ("-m", "bert_ds.data_tools", "build"), or ("./run.sh",)
    flags: list[str] = field(default_factory=list)
    run_sh_mode: str | None = None


def blocks(path: Path, text: str | None = None) -> list[Block]:
    text = path.read_text(encoding="utf-8") if text is None else text
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start = i
            runnable = i > 0 and lines[i - 1].strip() == RUN_MARK
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            out.append(Block(path, start + 1, "\n".join(body), runnable))
        i += 1
    return out


@dataclass
class Shown:
    """A ```text block marked as the output of the last command of the ```bash block above it."""

    where: str  # file:line of the ```text fence
    argv: list[str]  # the command it is the output of
    text: str


def shown_outputs(path: Path, text: str | None = None) -> list[Shown]:
    """Every marked output block of ``path``; a mark with no ```text block after it, or no
    command above it, is an error."""
    text = path.read_text(encoding="utf-8") if text is None else text
    lines, bash, out = text.splitlines(), blocks(path, text), []
    for i, line in enumerate(lines):
        if line.strip() != OUTPUT_MARK:
            continue
        above = [b for b in bash if b.line < i + 1]
        ran = commands(above[-1]) if above else []
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```text" or not ran:
            raise ValueError(f"{path.name}:{i + 1}: {OUTPUT_MARK} must come between a ```bash block and a ```text "
                             "block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), len(lines))
        out.append(Shown(f"{path.name}:{i + 2}", ran[-1].argv, "\n".join(lines[i + 2:end])))
    return out


# What may differ between a shown output and a run of its command: figures and absolute paths;
# a [list] of figures may be longer, and a line repeated (one per seed) may come more often. A
# number inside a word (v1.1, F1, seed1) is a name, not a figure: it must match.
_PATH = re.compile(r"(?<![\w.])/(?:[\w.@+-]+/)*[\w.@+-]+")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?(?!\w|\.\d)")


def shape(text: str) -> list[str]:
    """``text``'s lines with numbers and paths masked, blank lines and repeats in a row dropped."""
    out: list[str] = []
    for line in text.splitlines():
        line = _NUMBER.sub("N", _PATH.sub("PATH", line))
        line = " ".join(re.sub(r"\[N(?:, N)+\]", "[N]", line).split())
        if line and (not out or out[-1] != line):
            out.append(line)
    return out


def unshown(printed: str, shown: str) -> list[str]:
    """The lines of ``shown`` (masked by :func:`shape`) that ``printed`` lacks, in order: a
    shown output may leave lines out, not add or reorder them."""
    printed_lines, at, missing = shape(printed), 0, []
    for line in shape(shown):
        try:
            at = printed_lines.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


def commands(block: Block) -> list[Command]:
    """Each logical line (backslash continuations joined, here-documents skipped), cut at
    ``&&``, ``||``, ``;`` and ``|``, comments removed."""
    out, lines, i = [], block.text.splitlines(), 0
    while i < len(lines):
        number, line = block.line + 1 + i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i]
        i += 1
        heredoc = re.search(r"<<-?\s*'?(\w+)'?", line)
        if heredoc:  # cat > file <<'EOF' ... EOF: data, not commands
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        part: list[str] = []
        for tok in list(lexer) + [";"]:
            if set(tok) <= set(";&|"):
                if part:
                    out.append(Command(f"{block.path.name}:{number}", part))
                part = []
            else:
                part.append(tok)
    return out


def _flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def _after_python(argv: list[str]) -> Target | None:
    """``python -m MODULE ARGS`` or ``python examples/x.py ARGS``."""
    if len(argv) >= 3 and argv[1] == "-m":
        if argv[2] in ("torch.distributed.run", "torchrun"):
            return _module_at(argv, argv.index("-m", 3)) if "-m" in argv[3:] else None
        return _module(argv[2], argv[3:])
    if len(argv) >= 2 and re.fullmatch(r"(examples|benchmarks)/\w+\.py", argv[1]):
        return Target((argv[1],), _flags(argv[2:]))
    return None


def _module_at(argv: list[str], i: int) -> Target:
    """argv[i] is ``-m`` or ``--module``, argv[i + 1] the module."""
    return _module(argv[i + 1], argv[i + 2:])


def _module(module: str, rest: list[str]) -> Target:
    """``module`` run with ``rest``; a subcommand comes first for the modules that have them."""
    if module in ("bert_ds.data_tools", "bert_ds.eval") and rest and not rest[0].startswith("-"):
        return Target(("-m", module, rest[0]), _flags(rest[1:]))
    return Target(("-m", module), _flags(rest))


def target(argv: list[str]) -> Target | None:
    """What to check for ``argv``; None for a command that is not ours (cat, sbatch, pip ...).
    Raises ValueError for a command that starts like ours and cannot be read."""
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):  # NGPU=8 ./run.sh ...
        argv = argv[1:]
    if not argv:
        return None
    head = argv[0]
    if head in PYTHONS:
        if argv[1:2] == ["-c"] or (argv[1:2] == ["-m"] and argv[2:3] and argv[2] in NOT_OURS):
            return None
        found = _after_python(argv)
        if found is None:
            raise ValueError(f"cannot read the command {shlex.join(argv)!r}")
        return found
    if head in SCRIPTS:
        return _module(SCRIPTS[head], argv[1:])
    if head == "torchrun":
        if "-m" not in argv:
            raise ValueError(f"torchrun without -m MODULE: {shlex.join(argv)!r}")
        return _module_at(argv, argv.index("-m"))
    if head == "deepspeed":
        if "--module" not in argv:
            raise ValueError(f"deepspeed without --module MODULE: {shlex.join(argv)!r}")
        return _module_at(argv, argv.index("--module"))
    if head in LAUNCHERS:
        starts = [i for i, a in enumerate(argv) if a in PYTHONS or a.endswith("/python")]
        if not starts:
            raise ValueError(f"{head} without a python command: {shlex.join(argv)!r}")
        return target(["python", *argv[starts[0] + 1:]])
    if head == "./run.sh":
        mode = argv[1] if len(argv) > 1 else "main"
        args = argv[2:][1:] if mode == "plot" and argv[2:] and not argv[2].startswith("-") else argv[2:]
        module = RUN_SH_MODULES.get(mode)
        return Target(("-m", module) if module else ("./run.sh",), _flags(args) if module else [], mode)
    if head.startswith("benchmarks/") and head.endswith(".sh"):
        return Target((head,), _flags(argv[1:]))
    return None


def documented_commands(files: list[Path] | None = None) -> list[tuple[Command, Target]]:
    out = []
    for path in files or DOC_FILES:
        for block in blocks(path):
            for command in commands(block):
                found = target(command.argv)
                if found is not None:
                    out.append((command, found))
    return out


def parses_its_arguments(help_argv: tuple[str, ...]) -> bool:
    """Whether the module or script reads its command line (and so answers --help rather than
    running): checked in its source before anything is run with --help."""
    if help_argv[0] == "-m":
        return _reads_arguments(help_argv[1])
    path = REPO / help_argv[0]
    return path.exists() and ("--help" in (text := path.read_text(encoding="utf-8")) or "ArgumentParser" in text)


def _reads_arguments(module: str) -> bool:
    """The module's entry (its __main__ for a package), or the module its ``main`` comes from,
    builds an ArgumentParser."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:  # a package (a namespace package has no origin): its __main__
        path = next((Path(d) / "__main__.py" for d in spec.submodule_search_locations
                     if (Path(d) / "__main__.py").exists()), Path())
    else:
        path = Path(spec.origin)
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    if "ArgumentParser" in text:
        return True
    entry = re.search(r"^from ([\w.]+) import main$", text, re.MULTILINE)
    return entry is not None and entry.group(1) != module and _reads_arguments(entry.group(1))


def run_sh_modes() -> set[str]:
    """The modes run.sh accepts, from its own 'unknown mode' message (one definition)."""
    match = re.search(r"\(modes: ([^;)]*)", (REPO / "run.sh").read_text())
    return {m.strip() for m in match.group(1).split(",")}


def missing_flags(flags: list[str], help_text: str) -> list[str]:
    return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]


_SLUG_DROP = re.compile(r"[^\w\- ]")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return _SLUG_DROP.sub("", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of each relative Markdown link outside code."""
    out, in_code = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for match in re.finditer(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z]+:", match.group(1)):
                out.append((number, match.group(1)))
    return out
