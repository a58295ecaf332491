"""The package's parts (its subpackages and top-level modules) import each other without a loop, counting every
import, also those inside functions. The plan sits below the model and the runtime code: its vocabulary (names,
layout, lever_settings, model_plan) is what they read, and it imports nothing above the model families."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ulysses_trainer"


def _imported_modules(path: Path, text: str | None = None) -> set[str]:
    """Every module of the package that `path` (or `text` as if it were there) imports, as a dotted name below the
    package ("plan.resolve")."""
    rel = path.relative_to(PKG).with_suffix("").parts
    here = list(rel[:-1]) if rel[-1] != "__init__" else list(rel[:-1])  # the package a relative import starts from
    out = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
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
    assert "families" in graph["plan"]  # plan/inputs.py: from ..families import Family, LayerDims, MlpRun, family


def test_no_import_loop_between_the_packages_parts():
    graph = part_graph()
    assert len(graph) >= 12
    assert loops(graph) == [], {p: sorted(d) for p, d in graph.items()}


# the plan's vocabulary: what the runtime code, the config's checks and the model read of the plan
VOCABULARY = ("plan.names", "plan.layout", "plan.lever_settings", "plan.model_plan")


def _module_imports(part: str) -> set[str]:
    """Every module of the package that the files of `part` import (dotted, below the package)."""
    root = PKG / part
    files = root.rglob("*.py") if root.is_dir() else [root.with_suffix(".py")]
    return set().union(*(_imported_modules(path) for path in files))


def test_lower_parts_do_not_import_higher_ones():
    graph = part_graph()
    for low in ("errors", "families", "zero_json"):
        assert graph.get(low, set()) <= {"errors"}, (low, graph.get(low))
    # the planner reads the families' facts and the ZeRO JSON, nothing of the model, the data or the runtime code
    assert graph["plan"] <= {"errors", "families", "zero_json"}, graph["plan"]
    for module in VOCABULARY:  # the vocabulary imports nothing of the package but errors
        path = PKG.joinpath(*module.split(".")).with_suffix(".py")
        assert {m.split(".")[0] for m in _imported_modules(path)} <= {"errors"}, (module, _imported_modules(path))
    for runtime in ("attention", "levers", "parallel"):  # names and rules come from the vocabulary, not the planner
        planned = {m for m in _module_imports(runtime) if _part(m) == "plan"}
        assert planned <= set(VOCABULARY) and "config" not in graph[runtime], (runtime, planned, graph[runtime])
    assert "cli" not in set().union(*(d for p, d in graph.items() if p != "cli"))  # nothing below imports a command


def test_the_vocabulary_check_sees_a_planner_import():
    """_imported_modules names the plan module a runtime file imports (inside a function too), so a runtime file
    that imported the planner would fail the check above."""
    text = "from ..plan.names import GIB\n\ndef f():\n    from ..plan.resolve import resolve_plan\n"
    planned = _imported_modules(PKG / "parallel" / "new_module.py", text)
    assert planned == {"plan.names", "plan.resolve"} and not planned <= set(VOCABULARY)
