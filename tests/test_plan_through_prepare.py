"""`ulysses-trainer plan --json` prints the plan the trainer runs: for every recipe (and the embedded default),
the plan the trainer resolves through `prepare` (its own probe, ZeRO JSON, model shape and data) equals the
printed one field by field, bf16 included. Both sides see one stand-in machine through the probe seam
(ulysses_trainer/probe.py: `local_gpus`, `installed_kernels`, `host_memory`; docs/testing.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ulysses_trainer import probe
from ulysses_trainer.__main__ import main as cli_main
from ulysses_trainer.cli.argv import load_config
from ulysses_trainer.plan.attention_share import AttentionShare
from ulysses_trainer.train.prepare import prepare

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "launch" / "recipes").glob("*.yaml"))
HOST_GB = 4096.0  # room for the CPU's own host check (prepare refuses a plan the host cannot hold)


@pytest.fixture
def stand_in_h200(monkeypatch):
    """Eight H200s with bf16, sdpa and the torch norms, and a large host: what both sides probe."""
    monkeypatch.setattr(probe, "local_gpus", lambda index=0: probe.LocalGpus(8, 139.8, "NVIDIA H200", True))
    monkeypatch.setattr(probe, "installed_kernels", lambda: (("sdpa",), ("torch",)))
    monkeypatch.setattr(probe, "host_memory", lambda given: (given, "host_memory_gb") if given is not None
                        else (HOST_GB, "detected on this machine"))


def _printed_plan(argv: list[str], capsys) -> dict:
    rc = cli_main(["plan", *argv, "--json"])
    out = capsys.readouterr().out
    out = out[out.index("{\n") if not out.startswith("{") else 0:]  # DeepSpeed's first import logs its accelerator
    plan = json.loads(out)["plan"]
    assert rc == (0 if plan["fits"] else 1)
    assert "auto" not in json.dumps({k: v for k, v in plan.items() if k not in ("decided", "notes")})  # all decided
    return plan


def _prepared_plan(argv: list[str], gpus: int, tmp_path: Path) -> dict:
    cfg = load_config([*argv, "--output_dir", str(tmp_path / "out")])
    run = prepare(cfg, gpus, training=False)  # the rehearsal's preparation: no output_dir written
    assert run.machine.gpu_memory_gb == 139.8  # the stand-in, not this CPU machine
    return json.loads(json.dumps(run.resolved.to_dict()))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_plan_json_is_the_plan_prepare_resolves(recipe, stand_in_h200, capsys, tmp_path):
    argv = ["--config", str(recipe)]
    gpus = load_config(argv).sp_size or 1  # what `plan` plans for without --gpus
    printed = _printed_plan(argv, capsys)
    trained = _prepared_plan(argv, gpus, tmp_path)
    assert printed == trained
    assert printed["bf16"] is True  # bf16 true or auto on GPUs that take it


def test_plan_json_is_the_plan_prepare_resolves_for_the_default(stand_in_h200, capsys, tmp_path, monkeypatch):
    """The embedded default (no recipe); and bf16 auto follows the probed GPU on both sides."""
    printed = _printed_plan(["--max_length", "4096"], capsys)
    assert printed == _prepared_plan([], 1, tmp_path) and printed["bf16"] is True
    monkeypatch.setattr(probe, "local_gpus", lambda index=0: probe.LocalGpus(1, 139.8, "a GPU without bf16", False))
    printed = _printed_plan(["--max_length", "4096"], capsys)
    assert printed == _prepared_plan([], 1, tmp_path) and printed["bf16"] is False


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_plan_and_trainer_time_the_same_rows_for_max_steps(steps, stand_in_h200, capsys, tmp_path):
    """`plan --max_steps N` and the trainer's startup plan time attention from one data share: the rows of the
    trainer's first N steps, in its order, of all the sequences it builds (not a shorter read packed otherwise)."""
    from ulysses_trainer.data.order import trained_rows

    argv = ["--config", str(ROOT / "launch" / "recipes" / "one_gpu_4b_sessions.yaml"), "--max_steps", str(steps)]
    printed = _printed_plan(argv, capsys)
    cfg = load_config([*argv, "--output_dir", str(tmp_path / "out")])
    run = prepare(cfg, 1, training=False)
    assert printed == json.loads(json.dumps(run.resolved.to_dict()))
    rows = trained_rows(cfg.seed, len(run.train_data), 1, steps)
    assert run.attention.rows == steps and printed["attention_from"] == "data"
    assert printed["attention_fraction"] == pytest.approx(AttentionShare.of(run.train_data, rows).mean, rel=1e-12)


@pytest.mark.parametrize("recipe", ["one_gpu_4b_sessions", "one_gpu_4b_long"])
def test_prepare_searches_once_and_checks_one_digest(recipe, stand_in_h200, tmp_path, monkeypatch, capsys):
    """prepare() runs the plan's lever search once, packed rows timed from the data too: the refusals before the
    tokenizing read that search without the data's share (memory does not depend on it), the plan after the data
    times the same settings with it. One digest check: the plan the run starts from. `plan` makes the same calls."""
    from ulysses_trainer.plan import fit_search, resolve
    from ulysses_trainer.train import prepare as prepare_module

    searches, digests = [], []
    search, check = fit_search.Search, prepare_module.check_same_plan
    monkeypatch.setattr(fit_search, "Search", lambda *a, **k: searches.append(1) or search(*a, **k))
    monkeypatch.setattr(prepare_module, "check_same_plan", lambda plan, when: digests.append(when) or check(plan, when))
    cfg = load_config(["--config", str(ROOT / "launch" / "recipes" / f"{recipe}.yaml"), "--max_steps", "2",
                       "--output_dir", str(tmp_path / "out")])
    run = prepare(cfg, 1, training=False)
    packed = recipe == "one_gpu_4b_sessions"
    assert run.resolved.attention_from == ("data" if packed else "")
    assert len(searches) == 1  # was 2 with packed rows: the plan searched again with the data's share
    assert digests == ["after the data is read" if packed else "before the model is built"]
    monkeypatch.setattr(fit_search, "Search", search)  # the longest max_length `plan` reports builds its own
    found = resolve.search_fits
    monkeypatch.setattr(resolve, "search_fits", lambda *a, **k: searches.append(1) or found(*a, **k))
    searches.clear()
    assert _printed_plan(["--config", str(ROOT / "launch" / "recipes" / f"{recipe}.yaml"), "--max_steps", "2"],
                         capsys) == json.loads(json.dumps(run.resolved.to_dict()))
    assert len(searches) == 1  # the plan's one search
