"""Rules the test suite itself keeps, checked on its source.

A test knob (CACHECTL_TEST_*) read inside a test or fixture never takes effect: the autouse
``isolated_home`` fixture (conftest.py) clears every CACHECTL_* variable before each test
runs. Knobs are read once, at import, as conftest.py does for its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _knob_reads_in_functions(source: str) -> list[tuple[int, str]]:
    """(line, name) of each CACHECTL_TEST_* variable read inside a function body."""
    found: list[tuple[int, str]] = []

    def knob(node: ast.AST) -> str | None:
        is_str = isinstance(node, ast.Constant) and isinstance(node.value, str)
        return node.value if is_str and node.value.startswith("CACHECTL_TEST_") else None

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            name = None
            if isinstance(node, ast.Call) and node.args:
                f = node.func
                reads = isinstance(f, ast.Attribute) and (
                    (f.attr == "get" and is_environ(f.value)) or f.attr == "getenv"
                )
                name = knob(node.args[0]) if reads else None
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                name = knob(node.slice) if is_environ(node.value) else None
            if name:
                found.append((node.lineno, name))
    return found


def test_knob_rule_finds_a_read_inside_a_test() -> None:
    source = (
        "import os\n"
        "X = os.environ.get('CACHECTL_TEST_OK')\n"
        "def test_a():\n"
        "    return os.environ.get('CACHECTL_TEST_NO_CHROMIUM'), os.environ['CACHECTL_TEST_B']\n"
    )
    assert _knob_reads_in_functions(source) == [
        (4, "CACHECTL_TEST_NO_CHROMIUM"),
        (4, "CACHECTL_TEST_B"),
    ]


def test_no_test_knob_is_read_inside_a_test_or_fixture() -> None:
    offenders = [
        f"{path.name}:{line}: {name}"
        for path in sorted(TESTS.glob("*.py"))
        for line, name in _knob_reads_in_functions(path.read_text())
    ]
    assert not offenders, (
        "read these at import (isolated_home clears CACHECTL_* before each test): "
        + ", ".join(offenders)
    )
