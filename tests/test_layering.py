"""The package's layering, read from the source: no import cycle inside scape_core (late imports
inside functions count; ``if TYPE_CHECKING:`` blocks do not), the core imports torch and the
standard library only, and the adapters never import each other."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth, outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from scape_core import wire`
    return found


def _graph(package: str) -> dict[str, set[str]]:
    modules = {f"{package}.{p.stem}": p for p in (ROOT / package).glob("*.py") if p.stem != "__init__"}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a list of modules, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_scape_core_has_no_import_cycle():
    graph = _graph("scape_core")
    assert {"scape_core.state", "scape_core.checkpoint", "scape_core.selection"} <= set(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_scape_core_imports_torch_and_the_standard_library_only():
    for path in (ROOT / "scape_core").glob("*.py"):
        outside = {m.split(".")[0] for m in _imports(path)} - {"scape_core", "torch", "__future__"}
        assert outside <= set(sys.stdlib_module_names), (path.name, outside - set(sys.stdlib_module_names))


def test_the_adapters_do_not_import_each_other():
    for package, other in (("lightning_scape", "accelerate_scape"), ("accelerate_scape", "lightning_scape")):
        for path in (ROOT / package).glob("*.py"):
            assert not any(m.split(".")[0] == other for m in _imports(path)), path
