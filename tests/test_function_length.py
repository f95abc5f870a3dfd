"""Function length: no function of the save, format and restore paths runs past 80 lines.

A function's length is its body from the line after its docstring (or from its first line,
``def`` included, when it has none) to its last line. A longer one is split into named steps.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MAX_LINES = 80
PACKAGE = Path(__file__).resolve().parent.parent / "dcp_datastates"
CHECKED = ("save", "format", "restore")


def _length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the end of ``node``'s docstring (else its first line) to its last line."""
    first = node.body[0]
    has_doc = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    start = (first.end_lineno or first.lineno) + 1 if has_doc else node.lineno
    end = node.end_lineno or node.lineno
    return end - start + 1


def _too_long(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(PACKAGE.parent)
    return [
        f"{rel}:{node.lineno} {node.name}: {n} lines"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (n := _length(node)) > MAX_LINES
    ]


def _modules() -> list[Path]:
    return sorted(p for sub in CHECKED for p in (PACKAGE / sub).rglob("*.py"))


def test_modules_found() -> None:
    names = {p.parent.name for p in _modules()}
    assert names == set(CHECKED), names


@pytest.mark.parametrize("sub", CHECKED)
def test_no_function_over_80_lines(sub: str) -> None:
    """Every function under ``dcp_datastates/<sub>/`` is at most 80 lines long (see the module
    docstring); the failure names each file, function and length."""
    long = [line for p in sorted((PACKAGE / sub).rglob("*.py")) for line in _too_long(p)]
    assert not long, f"functions over {MAX_LINES} lines (split them into named steps):\n" + (
        "\n".join(long)
    )
