"""The package's parts (its subpackages and top-level modules) import each other without a loop, counting every
import, also those inside functions; and the staircase they stand on (test_lower_parts_do_not_import_higher_ones)."""

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


RUNTIME = ("attention", "levers", "parallel")


def _module_imports(part: str) -> set[str]:
    """Every module of the package that the files of `part` import (dotted, below the package)."""
    root = PKG / part
    files = root.rglob("*.py") if root.is_dir() else [root.with_suffix(".py")]
    return set().union(*(_imported_modules(path) for path in files))


def _is_family_fact(module: str) -> bool:
    """A torch-free module of families/: its own top modules (the registry, base, presets, installs) and each family
    folder's __init__ (the Family record, presets, memory and time terms); the rest of a folder is its torch side."""
    parts = module.split(".")
    return parts[0] == "families" and (len(parts) <= 2 or parts[2:] == ["__init__"])


def _family_facts() -> list[Path]:
    root = PKG / "families"
    return [*root.glob("*.py"), *root.glob("*/__init__.py")]


def test_lower_parts_do_not_import_higher_ones():
    """The staircase, bottom up: errors; the plan's vocabulary (what the config checks, the runtime code and the
    model read of it: kernel names and shape rules, the layout, the levers decoded, the ModelSetup) and the ZeRO
    JSON; the runtime code (attention, levers, parallel), which reads the vocabulary, never the planner nor a
    family; the families, each one folder: its facts torch-free (what the planner reads) and its torch side on the
    runtime code (what parallelize swaps in, its Ulysses pieces); the planner on the families' facts; the model,
    the data, the training and the commands above. A family folder holds both layers, so the runtime code must not
    reach the planner: the vocabulary sits below both, outside plan/."""
    graph = part_graph()
    for low in ("errors", "zero_json", "vocabulary"):
        assert graph.get(low, set()) <= {"errors"}, (low, graph.get(low))
    for runtime in RUNTIME:  # names and rules come from the vocabulary, not the planner; no family is named
        assert graph[runtime] <= {"errors", "messages", "vocabulary", *RUNTIME}, (runtime, graph[runtime])
    # a family's torch side stands on the runtime code, nothing of the planner, the model or the run
    assert graph["families"] <= {"errors", "vocabulary", *RUNTIME}, graph["families"]
    # the planner reads the families' facts, the vocabulary and the ZeRO JSON, nothing of the model, the data or the
    # runtime code
    assert graph["plan"] <= {"errors", "families", "vocabulary", "zero_json"}, graph["plan"]
    assert "cli" not in set().union(*(d for p, d in graph.items() if p != "cli"))  # nothing below imports a command


def test_the_planner_reads_only_the_families_torch_free_facts():
    """A family's facts import nothing of the package but errors, the plan's vocabulary (torch-free, below them) and
    other facts, and the planner imports no family module but facts: the planner never loads a torch side."""
    for path in _family_facts():
        imported = _imported_modules(path)
        assert all(m.split(".")[0] in ("errors", "vocabulary") or _is_family_fact(m) for m in imported), \
            (path, imported)
    from_plan = {m for m in _module_imports("plan") if m.split(".")[0] == "families"}
    assert from_plan and all(_is_family_fact(m) for m in from_plan), from_plan


def test_the_facts_check_sees_a_torch_side_import():
    """_is_family_fact tells a family's facts from its torch side, so a facts module (or the planner) importing a
    torch side fails the checks above."""
    text = "from ..qwen3_5 import GatedDeltaNet\n\ndef f():\n    from ..qwen3_5.modules import INSTALLS\n"
    imported = _imported_modules(PKG / "families" / "qwen3" / "__init__.py", text)
    assert imported == {"families.qwen3_5", "families.qwen3_5.modules"}
    assert [_is_family_fact(m) for m in sorted(imported)] == [True, False]
    assert _is_family_fact("families.base") and _is_family_fact("families.qwen3.__init__")
