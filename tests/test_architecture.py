"""The import graph of lipvit has no cycle (docs/architecture.md): every
module's imports, at module level and inside functions, form a directed
acyclic graph over lipvit's own modules."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import lipvit.analysis
import lipvit.certify

import lipvit

PACKAGES = (lipvit, lipvit.certify, lipvit.analysis)


def _modules() -> dict[str, Path]:
    """Every lipvit module's name and source file (the installed layout)."""
    found = {}
    for package in PACKAGES:
        found[package.__name__] = Path(package.__file__)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            spec = importlib.util.find_spec(info.name)
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                found[info.name] = Path(spec.origin)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``module → the lipvit modules it imports`` (``from package import
    submodule`` counts as importing the submodule)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0]
                    base = f"{parent}.{base}" if base else parent
                subs = [f"{base}.{a.name}" for a in node.names
                        if f"{base}.{a.name}" in modules]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of nodes (first repeated last), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    modules = _modules()
    assert "lipvit.certify.taylor.certificate" in modules  # the walk sees sub-packages
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, " → ".join(cycle)


def test_public_api_resolves():
    """Every name of ``lipvit.certify.__all__`` and ``lipvit.__all__`` imports."""
    for package in (lipvit, lipvit.certify):
        for name in package.__all__:
            assert getattr(package, name) is not None, (package.__name__, name)
