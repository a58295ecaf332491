"""The package's parts (its subpackages and top-level modules) import each other without a loop, counting every
import, also those inside functions; the runtime code reads names and rules from names.py, not the planner."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ulysses_trainer"


def _imported_modules(path: Path) -> set[str]:
    """Every module of the package that `path` imports, as a dotted name below the package ("plan.resolve")."""
    rel = path.relative_to(PKG).with_suffix("").parts
    here = list(rel[:-1]) if rel[-1] != "__init__" else list(rel[:-1])  # the package a relative import starts from
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                mods = [".".join(base + [node.module])] if node.module else \
                    [".".join(base + [a.name]) for a in node.names]
            elif node.module and node.module.split(".")[0] == PKG.name:
                rest = node.module[len(PKG.name) + 1:]
                mods = [rest] if rest else [a.name for a in node.names]
            else:
                mods = []
        elif isinstance(node, ast.Import):
            mods = [a.name[len(PKG.name) + 1:] for a in node.names if a.name.startswith(PKG.name + ".")]
        else:
            mods = []
        out.update(m for m in mods if m)
    return out


def _part(module: str) -> str:
    return module.split(".")[0]


def part_graph() -> dict[str, set[str]]:
    """part -> the other parts it imports (a part: a subpackage or a top-level module; __init__ left out)."""
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("").parts
        if rel == ("__init__",):
            continue
        me = _part(".".join(rel))
        graph.setdefault(me, set()).update(p for p in map(_part, _imported_modules(path)) if p != me)
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles' members: strongly connected components of more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_a_loop():
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert loops({"a": {"b"}, "b": set()}) == []


def test_the_walker_counts_imports_inside_functions_and_relative_ones():
    graph = part_graph()
    # cli/plan.py imports the planner at the top and the calibration inside a function
    assert {"plan", "config", "probe"} <= graph["cli"]
    assert "lever_settings" in graph["plan"]  # plan/resolve.py: from ..lever_settings import Levers, decode_levers


def test_no_import_loop_between_the_packages_parts():
    graph = part_graph()
    assert len(graph) >= 12
    assert loops(graph) == [], {p: sorted(d) for p, d in graph.items()}


def test_lower_parts_do_not_import_higher_ones():
    graph = part_graph()
    for low in ("names", "layout", "errors", "model_plan"):
        assert graph.get(low, set()) <= {"errors"}, (low, graph.get(low))
    for runtime in ("attention", "levers", "parallel"):  # names and rules come from names.py, not the planner
        assert "plan" not in graph[runtime] and "config" not in graph[runtime], (runtime, graph[runtime])
    assert "cli" not in set().union(*(d for p, d in graph.items() if p != "cli"))  # nothing below imports a command
