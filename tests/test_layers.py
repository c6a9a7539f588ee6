"""The import rules of bert_ds: layers point one way.

``LAYERS`` and ``SAME_LAYER`` below are the one definition of the rules; every other check
here is derived from them. Every ``.py`` file under ``bert_ds/`` is parsed (never imported),
following the links ``bert_ds/kernels``, ``bert_ds/data_tools`` and ``bert_ds/ds_configs`` to
the top-level folders, and every import counts: at module level, inside functions and
classes, under ``try``, and ``importlib.import_module("<literal>")``. The rules:

1. Layers: a module may import its own group, any group of a lower layer, and of its own
   layer only the groups ``SAME_LAYER`` names. So ``bert_ds.base`` imports nothing of bert_ds,
   ``bert_ds.kernels`` and ``bert_ds.data_tools`` import only ``bert_ds.base`` and themselves.
   An import written only for the type checker (under ``if TYPE_CHECKING:``) counts here too:
   naming a higher layer in a signature is still a dependency on it.
2. Bare names: nothing imports the top-level names ``kernels``, ``data_tools``, ``ds_configs``
   (they are installed only as ``bert_ds.kernels`` etc.). Checked in ``tests/``,
   ``examples/`` and ``benchmarks/`` as well, where a bare name would import a second copy
   of a module beside the installed one.
3. No import cycle among the modules of bert_ds (``bert_ds.kernels`` included, where the
   loader, the dispatch and the self-check once imported each other), function-level imports
   included. Imports under ``if TYPE_CHECKING:`` are exempt: they never run. An import names
   the module it imports (``from bert_ds.kernels import speed`` is an edge to
   ``bert_ds.kernels.speed``, not to the package); that Python runs a package's
   ``__init__`` before its modules is not counted as an edge.

4. Model families: each is a folder under ``bert_ds/model/`` (a package holding
   ``FAMILY``), and only its own modules and the one table, ``bert_ds.model.families``,
   import from it; the rest of bert_ds asks the table. Nor does a module outside the family
   folders compare something named ``arch`` with a family's name, or key a table by one
   (``{"modernbert": ...}``, ``x["bert"]``): what differs by family is in its record.

Every finding is one line: ``FILE:LINE: IMPORTER imports TARGET: RULE``.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The layers, lowest first. The root package's __init__ sits at the bottom: every import of a
# bert_ds module runs it first, so it may import nothing (or the base would import it too).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("bert_ds", "bert_ds.base"),  # errors and exit codes, atomic writes, folder locks
    ("bert_ds.kernels", "bert_ds.data_tools", "bert_ds.ds_configs"),  # the top-level folders
    ("bert_ds.config", "bert_ds.model", "bert_ds.loader", "bert_ds.optim", "bert_ds.zero"),  # the library
    ("bert_ds.checkpoint",),  # checkpoints, resume, export, import of weights
    ("bert_ds.eval",),  # downstream evaluation of exports (below train: a plan may end with it)
    ("bert_ds.train",),  # the training command and loop
    ("bert_ds.tools",),  # commands around the system
)
# Within a layer, who may import whom (nothing else), so the library reads bottom up: model <-
# config <- loader, zero <- optim <- config. The model knows nothing of training (the training config
# holds the model's own ModelConfig); the loader builds batches in the model's layout
# (model/padding.py); bert_ds.zero is the one door to DeepSpeed's internals and imports
# nothing of bert_ds, so the optimizer's builders may bind LAMB (pure math) to ZeRO's
# partitions through it; the loader and the optimizer do not know each other.
SAME_LAYER: dict[str, frozenset[str]] = {
    "bert_ds.config": frozenset({"bert_ds.model"}),
    "bert_ds.loader": frozenset({"bert_ds.config", "bert_ds.model"}),
    "bert_ds.optim": frozenset({"bert_ds.config", "bert_ds.zero"}),
    "bert_ds.zero": frozenset(),
}
BARE_NAMES = ("kernels", "data_tools", "ds_configs")
NO_CYCLES_IN = "bert_ds"  # every module, bert_ds.kernels included
OTHER_TREES = ("tests", "examples", "benchmarks")  # checked for bare names only
FAMILY_TABLE = "bert_ds.model.families"  # the one module outside the family folders that imports them


@dataclass(frozen=True)
class Import:
    path: str  # the file, relative to the repository (its real path: kernels/x.py, not bert_ds/kernels/x.py)
    line: int
    importer: str  # dotted module name
    target: str  # the module it imports
    type_only: bool  # under ``if TYPE_CHECKING:``


# --------------------------------------------------------------------------- reading the imports

def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root`` by dotted name, following links to folders."""
    modules = {}
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        parts = Path(folder).relative_to(root).parts
        for name in sorted(files):
            if name.endswith(".py"):
                stem = () if name == "__init__.py" else (name[:-3],)
                modules[".".join((package, *parts, *stem))] = Path(folder) / name
    return modules


def imports_in(source: str, path: str, module: str, known: Iterable[str]) -> list[Import]:
    """The imports of one module's source; ``known``: the module names ``from X import Y`` may name."""
    known = set(known)
    tree = ast.parse(source, filename=path)
    is_package = path.endswith("__init__.py")
    found = []
    for node, type_only in _walk(tree, type_only=False):
        for target in _targets(node, module, is_package, known):
            found.append(Import(path, node.lineno, module, target, type_only))
    return found


def _walk(node: ast.AST, type_only: bool):
    """Every node below ``node``, with whether it sits under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for part in child.body:
                yield part, True
                yield from _walk(part, True)
            for part in child.orelse:
                yield part, type_only
                yield from _walk(part, type_only)
            continue
        yield child, type_only
        yield from _walk(child, type_only)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(node, module, is_package)
        return sorted({f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names})
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    return []


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    anchor = package[: len(package) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def repository_imports() -> tuple[list[Import], list[Import]]:
    """The imports of bert_ds's modules, and those of the other trees (tests, examples, benchmarks)."""
    ours = _imports_of(module_files(REPO / "bert_ds", "bert_ds"))
    others = []
    for tree in OTHER_TREES:
        if (REPO / tree).is_dir():
            others += _imports_of(module_files(REPO / tree, tree))
    return ours, others


def _imports_of(modules: dict[str, Path]) -> list[Import]:
    found = []
    for name, path in modules.items():
        shown = str(path.resolve().relative_to(REPO))
        found += imports_in(path.read_text(encoding="utf-8"), shown, name, modules)
    return found


# --------------------------------------------------------------------------- the rules

def group_of(module: str) -> str | None:
    """The group of LAYERS a bert_ds module belongs to (the longest that prefixes it)."""
    groups = [g for layer in LAYERS for g in layer if module == g or module.startswith(g + ".")]
    return max(groups, key=len) if groups else None


def _layer(group: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def allowed(group: str) -> list[str]:
    """The groups ``group`` may import besides itself."""
    lower = [g for layer in LAYERS[: _layer(group)] for g in layer]
    return lower + sorted(SAME_LAYER.get(group, ()))


def layer_rule(group: str) -> str:
    permitted = allowed(group)
    return (f"{group} may import only itself and {', '.join(permitted)}" if permitted
            else f"{group} imports nothing of bert_ds")


def layer_violations(imports: Iterable[Import]) -> list[str]:
    problems = []
    for imp in imports:
        if imp.target != "bert_ds" and not imp.target.startswith("bert_ds."):
            continue
        source, target = group_of(imp.importer), group_of(imp.target)
        if source is None or target is None:
            unknown = imp.importer if source is None else imp.target
            problems.append(_line(imp, f"{unknown} is in no layer (add its group to LAYERS)"))
        elif target != source and target not in allowed(source):
            problems.append(_line(imp, layer_rule(source)))
    return problems


def bare_name_violations(imports: Iterable[Import]) -> list[str]:
    return [_line(imp, f"import bert_ds.{imp.target.split('.')[0]}, never the bare name")
            for imp in imports if imp.target.split(".")[0] in BARE_NAMES]


def cycle_violations(imports: Iterable[Import], package: str) -> list[str]:
    """One line per import that closes a cycle among ``package``'s modules (TYPE_CHECKING exempt)."""
    inside = [imp for imp in imports if not imp.type_only and imp.importer != imp.target
              and _within(imp.importer, package) and _within(imp.target, package)]
    graph: dict[str, set[str]] = {}
    for imp in inside:
        graph.setdefault(imp.importer, set()).add(imp.target)
    cyclic = _strongly_connected(graph)
    return [_line(imp, f"an import cycle in {package}: {' -> '.join(_cycle_through(graph, imp, cyclic))}")
            for imp in inside if cyclic.get(imp.importer) is not None
            and cyclic.get(imp.importer) == cyclic.get(imp.target)]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _strongly_connected(graph: dict[str, set[str]]) -> dict[str, int]:
    """Per module on a cycle, the number of its strongly connected component (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    component: dict[str, int] = {}

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                component.update((m, index[node]) for m in members)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return component


def _cycle_through(graph: dict[str, set[str]], imp: Import, cyclic: dict[str, int]) -> list[str]:
    """A shortest path from the import's target back to its importer, as the cycle to show."""
    paths = {imp.target: [imp.importer, imp.target]}
    frontier = [imp.target]
    while frontier:
        node = frontier.pop(0)
        if node == imp.importer:
            return paths[node]
        for succ in sorted(graph.get(node, ())):
            if succ not in paths and cyclic.get(succ) == cyclic[imp.importer]:
                paths[succ] = paths[node] + [succ]
                frontier.append(succ)
    return [imp.importer, imp.target]


def _line(imp: Import, rule: str) -> str:
    where = " (type checking only)" if imp.type_only else ""
    return f"{imp.path}:{imp.line}: {imp.importer} imports {imp.target}{where}: {rule}"


def family_folders(root: Path = REPO / "bert_ds" / "model") -> dict[str, str]:
    """Each family folder's package by its arch: the packages under ``root`` whose ``__init__``
    builds a ``FAMILY`` record, with the ``arch=`` it gives."""
    found = {}
    for init in sorted(root.glob("*/__init__.py")):
        for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "FAMILY" for t in node.targets)
                    and isinstance(node.value, ast.Call)):
                arch = next(k.value.value for k in node.value.keywords if k.arg == "arch")
                found[arch] = f"bert_ds.model.{init.parent.name}"
    return found


def family_import_violations(imports: Iterable[Import], folders: Iterable[str]) -> list[str]:
    """Imports of a family folder's modules from outside it (the table aside)."""
    folders = tuple(folders)
    problems = []
    for imp in imports:
        owner = next((f for f in folders if _within(imp.target, f)), None)
        if owner is not None and not _within(imp.importer, owner) and imp.importer != FAMILY_TABLE:
            problems.append(_line(imp, f"only {owner} itself and {FAMILY_TABLE} import a family's modules; "
                                       "ask the family's record"))
    return problems


def family_name_violations(source: str, path: str, arches: Iterable[str]) -> list[str]:
    """Where a module compares something named ``arch`` with a family's name, or keys a table or a
    lookup by one: ``FILE:LINE: names the family NAME: RULE``."""
    arches = set(arches)
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        named: list[str] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            names = [_constant(o) for o in operands if _constant(o) in arches]
            if names and any(_mentions_arch(o) for o in operands):
                named += names
        elif isinstance(node, ast.Dict):
            named += [_constant(k) for k in node.keys if _constant(k) in arches]
        elif isinstance(node, ast.Subscript) and _constant(node.slice) in arches:
            named.append(_constant(node.slice))
        found += [f"{path}:{node.lineno}: names the family {name!r}: what differs by family is in its record "
                  "(bert_ds.model.families)" for name in named]
    return found


def _constant(node: ast.AST | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def _mentions_arch(node: ast.AST) -> bool:
    """Whether an expression names an ``arch`` (a variable, attribute, key or function)."""
    for part in ast.walk(node):
        name = (part.id if isinstance(part, ast.Name) else part.attr if isinstance(part, ast.Attribute)
                else part.value if isinstance(part, ast.Constant) and isinstance(part.value, str) else "")
        if "arch" in name.lower():
            return True
    return False


# --------------------------------------------------------------------------- the tests

@pytest.fixture(scope="module")
def imports() -> tuple[list[Import], list[Import]]:
    return repository_imports()


def _report(problems: list[str]) -> str:
    return f"{len(problems)} import(s) break the layering:\n" + "\n".join(problems)


def test_the_tables_are_consistent():
    groups = [g for layer in LAYERS for g in layer]
    assert len(groups) == len(set(groups)), "a group appears in two layers"
    for group, peers in SAME_LAYER.items():
        assert all(_layer(peer) == _layer(group) and peer != group for peer in peers), group
    graph = {group: set(peers) for group, peers in SAME_LAYER.items()}
    assert not _strongly_connected(graph), "SAME_LAYER has a cycle"


def test_the_checker_reads_every_module(imports):
    ours, _ = imports
    importers = {imp.importer for imp in ours}
    for module in ("bert_ds.kernels.dispatch", "bert_ds.data_tools.build", "bert_ds.train.loop", "bert_ds.zero", "bert_ds.config"):
        assert module in importers


@pytest.mark.parametrize("layer", [group for layer in LAYERS for group in layer])
def test_each_group_imports_only_lower_layers(imports, layer):
    ours, _ = imports
    problems = layer_violations(imp for imp in ours if group_of(imp.importer) == layer)
    assert not problems, _report(problems)


def test_every_module_is_in_a_layer(imports):
    ours, _ = imports
    strays = sorted({imp.importer for imp in ours if group_of(imp.importer) is None})
    assert not strays, f"modules in no layer of LAYERS: {', '.join(strays)}"


def test_nothing_imports_the_bare_top_level_names(imports):
    ours, others = imports
    problems = bare_name_violations(ours + others)
    assert not problems, _report(problems)


def test_no_import_cycle(imports):
    ours, _ = imports
    problems = cycle_violations(ours, NO_CYCLES_IN)
    assert not problems, _report(problems)


def test_each_family_is_a_folder_the_rest_reaches_through_the_table(imports):
    ours, _ = imports
    folders = family_folders()
    assert set(folders) >= {"bert", "modernbert"}, folders
    problems = family_import_violations(ours, folders.values())
    assert not problems, _report(problems)


def test_no_module_outside_the_family_folders_names_a_family():
    folders = family_folders()
    problems = []
    for module, path in module_files(REPO / "bert_ds", "bert_ds").items():
        if module == FAMILY_TABLE or any(_within(module, f) for f in folders.values()):
            continue
        shown = str(path.resolve().relative_to(REPO))
        problems += family_name_violations(path.read_text(encoding="utf-8"), shown, folders)
    assert not problems, f"{len(problems)} place(s) name a model family:\n" + "\n".join(problems)


# --------------------------------------------------------------------------- the checker itself

KNOWN = {"bert_ds.kernels", "bert_ds.kernels.a", "bert_ds.kernels.b", "bert_ds.train", "bert_ds.train.main"}


def _planted(module: str, source: str) -> list[Import]:
    path = module.replace(".", "/") + ".py"
    return imports_in(source, path, module, KNOWN)


def test_the_checker_catches_an_upward_import_inside_a_function():
    source = "import torch\n\n\ndef f():\n    from bert_ds.train import main\n    return main\n"
    problems = layer_violations(_planted("bert_ds.kernels.a", source))
    assert problems == ["bert_ds/kernels/a.py:5: bert_ds.kernels.a imports bert_ds.train.main: "
                        "bert_ds.kernels may import only itself and bert_ds, bert_ds.base"]


def test_the_checker_catches_a_same_layer_import_the_table_does_not_allow():
    problems = layer_violations(_planted("bert_ds.model.bert", "from bert_ds.config import TrainConfig\n"))
    assert len(problems) == 1 and "bert_ds.model may import only itself and" in problems[0]
    assert layer_violations(_planted("bert_ds.config", "from bert_ds.model.bert import ModelConfig\n")) == []


def test_the_checker_catches_bare_names_and_string_imports():
    source = "import kernels.a\nimport importlib\nm = importlib.import_module('data_tools.build')\n"
    problems = bare_name_violations(_planted("tests.x", source))
    assert [p.split(":")[1] for p in problems] == ["1", "3"]


def test_the_checker_catches_a_cycle_through_a_function_level_import_but_not_a_type_only_one():
    a = "from bert_ds.kernels import b\n"
    b_runtime = "def f():\n    from bert_ds.kernels.a import X\n"
    b_typing = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bert_ds.kernels.a import X\n"
    found = _planted("bert_ds.kernels.a", a) + _planted("bert_ds.kernels.b", b_runtime)
    problems = cycle_violations(found, "bert_ds.kernels")
    assert len(problems) == 2
    assert problems[0].startswith("bert_ds/kernels/a.py:1: bert_ds.kernels.a imports bert_ds.kernels.b: ")
    assert problems[0].endswith("an import cycle in bert_ds.kernels: bert_ds.kernels.a -> bert_ds.kernels.b "
                                "-> bert_ds.kernels.a")
    assert cycle_violations(_planted("bert_ds.kernels.a", a) + _planted("bert_ds.kernels.b", b_typing),
                            "bert_ds.kernels") == []


def test_relative_imports_are_resolved():
    found = _planted("bert_ds.kernels.b", "from . import a\nfrom ..train import main\n")
    assert [imp.target for imp in found] == ["bert_ds.kernels.a", "bert_ds.train.main"]


def test_the_checker_catches_a_family_import_and_a_family_named_outside_its_folder():
    folders = ("bert_ds.model.bert", "bert_ds.model.modernbert")
    planted = _planted("bert_ds.train.cli", "from bert_ds.model.modernbert.config import ModernBertConfig\n")
    assert len(family_import_violations(planted, folders)) == 1
    inside = _planted("bert_ds.model.modernbert.hf", "from bert_ds.model.modernbert.config import ModernBertConfig\n")
    table = _planted(FAMILY_TABLE, "from bert_ds.model import modernbert\n")
    assert family_import_violations(inside + table, folders) == []
    source = ('if cfg.arch == "modernbert":\n    pass\n'
              'x = {"bert": 1}\n'
              'y = DEFAULTS["modernbert"]\n'
              'if preset_arch(p) != "bert":\n    pass\n'
              'if cfg.schedule == "bert":\n    pass\n')  # a schedule of that name is no family
    lines = [p.split(":")[1] for p in family_name_violations(source, "x.py", ("bert", "modernbert"))]
    assert lines == ["1", "3", "4", "5"]
