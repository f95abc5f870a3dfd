"""The package's import graph: no cycles, and knowledge flowing one way between its folders.

Every import counts, those inside functions and under ``if TYPE_CHECKING:`` included: a cycle
that only type checking sees still ties two modules' designs together. The layers, lowest first:

* the base: ``errors``, ``config``, ``engine`` (and the native ``_core``), ``runtime/``;
* ``storage/`` (where bytes go), then ``format/`` (what a checkpoint directory holds);
* ``restore/`` (readers) and ``lifecycle/`` (retention, tiers), each on the layers below;
* ``save/`` (the StorageWriter and its save path), on all of the above;
* the top: ``integrations/``, ``cli``, the package's ``__init__``.

A module may import its own folder and any lower layer, never a higher one or a sibling layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "dcp_datastates"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

BASE = {"errors", "config", "engine", "_core", "runtime"}
# folder (or base module) -> the folders it may import besides itself
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "storage": {"base"},
    "format": {"base", "storage"},
    "restore": {"base", "storage", "format"},
    "lifecycle": {"base", "storage", "format"},
    "save": {"base", "storage", "format", "restore", "lifecycle"},
}


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (under ``root``) by dotted name; a native module (known by its
    ``.pyi`` stub) maps to its stub."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi"):
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.setdefault(".".join([package, *parts]), path)
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path], package: str) -> set[str]:
    """The package's modules that module ``name`` imports, wherever the import statement is."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # "from . import x" names a module where x is one, else the package itself
            targets = [
                f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in modules and t.startswith(package + "."):
                t = t.rsplit(".", 1)[0]  # a name inside a module, or the native module
            if t in modules and t != name:
                found.add(t)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {
        name: imports_of(name, path, modules, package) if path.suffix == ".py" else set()
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as the list of its modules (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def layer_of(name: str, package: str) -> str | None:
    """The layer of module ``name``: a folder of ALLOWED, "base", or None for the top."""
    parts = name.split(".")[1:]
    if not parts:
        return None
    head = parts[0]
    if head in BASE:
        return "base"
    if head in ALLOWED and len(parts) > 1:
        return head
    return None


def layering_violations(graph: dict[str, set[str]], package: str) -> list[str]:
    out = []
    for name, targets in sorted(graph.items()):
        layer = layer_of(name, package)
        if layer is None:
            continue
        for t in sorted(targets):
            tl = layer_of(t, package)
            if tl != layer and (tl is None or tl not in ALLOWED[layer]):
                out.append(f"{name} ({layer}) imports {t} ({tl or 'top'})")
    return out


def test_no_import_cycle() -> None:
    graph = import_graph(ROOT, PACKAGE)
    assert len(graph) > 40, sorted(graph)  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_folders_import_one_way() -> None:
    graph = import_graph(ROOT, PACKAGE)
    assert layering_violations(graph, PACKAGE) == []


def test_every_module_sits_in_a_layer_or_on_top() -> None:
    """A new top-level module is a decision: the base and the top are listed here."""
    top_level = {n.split(".")[1] for n in import_graph(ROOT, PACKAGE) if n.count(".") == 1}
    assert top_level <= BASE | set(ALLOWED) | {"integrations", "cli", "__main__"}, top_level


def write_package(tmp: Path, files: dict[str, str]) -> Path:
    root = tmp / "pkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


@pytest.mark.parametrize(
    "files, cycle",
    [
        ({"__init__.py": "", "a.py": "from . import b\n", "b.py": "from .a import x\n"},
         ["pkg.a", "pkg.b", "pkg.a"]),
        (  # only type checking sees it, inside a folder, through a relative parent import
            {"__init__.py": "", "save/__init__.py": "", "format/__init__.py": "",
             "save/w.py": "from ..format.f import y\n",
             "format/f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from ..save.w import W\n"},
            ["pkg.format.f", "pkg.save.w", "pkg.format.f"],
        ),
        ({"__init__.py": "", "a.py": "def f():\n    import pkg.b\n", "b.py": "import pkg.a\n"},
         ["pkg.a", "pkg.b", "pkg.a"]),
        ({"__init__.py": "", "a.py": "from . import b\n", "b.py": "import os\n"}, None),
    ],
)
def test_the_check_finds_cycles(
    tmp_path: Path, files: dict[str, str], cycle: list[str] | None
) -> None:
    root = write_package(tmp_path, files)
    assert find_cycle(import_graph(root, "pkg")) == cycle


def test_the_check_finds_an_upward_import(tmp_path: Path) -> None:
    root = write_package(tmp_path, {
        "__init__.py": "", "format/__init__.py": "", "save/__init__.py": "",
        "format/f.py": "def g():\n    from ..save.w import W\n", "save/w.py": "",
    })
    assert layering_violations(import_graph(root, "pkg"), "pkg") == [
        "pkg.format.f (format) imports pkg.save.w (save)"
    ]
