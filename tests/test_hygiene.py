"""Source rules checked by reading the source: where torch.distributed is used, one definition per
constant, no reaching into the Trainer's private members, no citations of files the repository does not ship;
and the fast tier's no-process guard."""

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


def test_ignore_index_is_defined_once():
    defs = [p.relative_to(ROOT) for p, text in _sources("ulysses_trainer")
            if re.search(r"^IGNORE_INDEX\s*=", text, re.M)]
    assert [str(d) for d in defs] == ["ulysses_trainer/parallel/sharding.py"]


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
