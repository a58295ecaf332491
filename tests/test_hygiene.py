"""Source rules checked by reading the source: where torch.distributed is used, one definition per
constant, no reaching into the Trainer's private members, no citations of files the repository does not ship;
and the fast tier's no-process guard."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ulysses_trainer"
PARALLEL = PACKAGE / "parallel"


def _sources(*dirs: str, exts=(".py",)):
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*")):
            if path.suffix in exts and path.is_file():
                yield path, path.read_text()


def test_only_parallel_touches_torch_distributed():
    pattern = re.compile(r"torch\.distributed|from torch import distributed")
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p, text in _sources("ulysses_trainer")
                 if PARALLEL not in p.parents
                 for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not offenders, f"move these into ulysses_trainer/parallel/: {offenders}"


def test_the_package_calls_no_collective_whose_deprecation_it_silences():
    """parallel/integrations.py hides torch's deprecation notice for these two collectives as DeepSpeed's: a call
    of ours would be hidden with it, so there is none (torch's own names for them are all_gather_single and
    reduce_scatter_single)."""
    pattern = re.compile(r"\b(all_gather_into_tensor|reduce_scatter_tensor)\s*\(")
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p, text in _sources("ulysses_trainer")
                 for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders


def test_ignore_index_is_defined_once():
    defs = [p.relative_to(ROOT) for p, text in _sources("ulysses_trainer")
            if re.search(r"^IGNORE_INDEX\s*=", text, re.M)]
    assert [str(d) for d in defs] == ["ulysses_trainer/parallel/sharding.py"]


def test_the_shard_scope_is_the_packages_one_context_variable():
    """The blocks transformers' layers call with the hidden states alone read the shard from one scope
    (parallel/sharding.shard_scope, docs/design.md says why): no other module keeps a ContextVar, and only
    sharding.py touches the variable itself (the rest read shard_in_scope / mlp_output_unused)."""
    holders = [str(p.relative_to(ROOT)) for p, text in _sources("ulysses_trainer") if "ContextVar" in text]
    assert holders == ["ulysses_trainer/parallel/sharding.py"], holders
    readers = [str(p.relative_to(ROOT)) for p, text in _sources("ulysses_trainer", "benchmarks") if "_IN_SCOPE" in text]
    assert readers == ["ulysses_trainer/parallel/sharding.py"], readers


def test_gib_is_defined_once():
    defs = [f"{p.relative_to(ROOT)}:{n}" for p, text in _sources("ulysses_trainer", "benchmarks", "tests")
            for n, line in enumerate(text.splitlines(), 1) if re.match(r"GIB\s*=", line)]
    assert len(defs) == 1, f"import GIB from where it is defined: {defs}"


def test_nothing_reaches_into_the_trainers_private_members():
    """The rehearsal and the benchmarks drive a step through the Trainer's public surface (micro_batches,
    shard_rows, train_step, ...), so the trainer's internals stay its own."""
    pattern = re.compile(r"\btrainer\._\w")
    found = [f"{p.relative_to(ROOT)}:{n}" for p, text in _sources("ulysses_trainer", "benchmarks", "tests")
             if p != Path(__file__).resolve()
             for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not found, f"give the Trainer a public method instead: {found}"


def test_code_and_docs_cite_no_file_outside_the_repository():
    pattern = re.compile(r"CONTRACT\.md|DEVELOPERS|\.\./shared|offline-gpu")
    dirs = ("ulysses_trainer", "tests", "benchmarks", "launch", "ds_configs", "docs")
    exts = (".py", ".md", ".sh", ".yaml", ".json")
    found = [f"{p.relative_to(ROOT)}:{n}" for p, text in _sources(*dirs, exts=exts)
             if "results" not in p.parts and p != Path(__file__).resolve()
             for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    found += [f"README.md:{n}" for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
              if pattern.search(line)]
    assert not found, f"state the rule instead of citing a file the repository does not ship: {found}"


def test_the_fast_tier_refuses_to_start_a_process():
    with pytest.raises(AssertionError, match="mark it @pytest.mark.slow"):
        subprocess.run(["true"])


# each of these settings has one name from the config to the kernel: sp_size, world_size, dp_size,
# gpus_per_node and ranks_per_node; the left-hand spellings are second names a review would flag
SECOND_NAMES = {"sp": "sp_size", "world": "world_size", "dp": "dp_size", "gpus_per_host": "gpus_per_node",
                "ranks_per_host": "ranks_per_node"}


def _second_name_fields(tree: ast.AST) -> list[tuple[str, int, str]]:
    """(class, line, name) of each dataclass field or property of a second name in a parsed module."""
    found = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        is_dataclass = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)
        for node in cls.body:
            if is_dataclass and isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                name = node.target.id
            elif isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "property" for d in node.decorator_list):
                name = node.name
            else:
                continue
            if name in SECOND_NAMES:
                found.append((cls.name, node.lineno, name))
    return found


def test_settings_have_one_name_in_every_dataclass():
    offenders = [f"{p.relative_to(ROOT)}:{line} {cls}.{name} (use {SECOND_NAMES[name]})"
                 for p, text in _sources("ulysses_trainer") for cls, line, name in _second_name_fields(ast.parse(text))]
    assert not offenders, f"a setting under a second name: {offenders}"


def test_the_second_name_scan_sees_a_field_and_a_property():
    src = ("from dataclasses import dataclass\n@dataclass\nclass L:\n    sp: int\n    dp: int\n"
           "class M:\n    @property\n    def gpus_per_host(self):\n        return 8\n")
    assert [(c, n) for c, _, n in _second_name_fields(ast.parse(src))] == [("L", "sp"), ("L", "dp"),
                                                                            ("M", "gpus_per_host")]
