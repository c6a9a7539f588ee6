"""No function in the packages is longer than :data:`MAX_LINES`: a function that does not fit
on one screen is split into named steps (README, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

MAX_LINES = 80  # a screen: def line to last line, docstring and comments included
PACKAGES = ("bert_ds", "data_tools", "kernels")  # bert_ds's links to the other two are not followed twice


def long_functions(source: str, path: str, limit: int = MAX_LINES) -> list[str]:
    """``path:line: name is N lines`` for every function or method in ``source`` over ``limit``."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{path}:{node.lineno}: {node.name} is {lines} lines (at most {limit})")
    return found


def _package_files() -> list[Path]:
    files = []
    for package in PACKAGES:
        files += [p for p in sorted((REPO / package).rglob("*.py")) if not any(part.startswith(".") for part in p.parts)]
    return files


def test_no_function_is_longer_than_a_screen():
    files = _package_files()
    assert len(files) > 50 and any(p.name == "loop.py" for p in files)  # the walk found the packages
    problems = [problem for path in files
                for problem in long_functions(path.read_text(), str(path.relative_to(REPO)))]
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    source = f"class A:\n    def ok(self):\n        pass\n\n    def long(self):\n{body.replace('    ', '        ')}\n"
    assert long_functions(source, "planted.py") == [
        f"planted.py:5: long is {MAX_LINES + 1} lines (at most {MAX_LINES})"]
