"""An installed package works without a checkout: the ZeRO JSONs, the planner's measured tables and the training
entry point are package data or modules, and `auto` decides the same in a checkout and in an installed wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, job_failure, train_env
from tests.tiny_checkpoint import write_checkpoint, write_documents
from ulysses_trainer.config import DEFAULT_DS_CONFIG, PACKAGE_DIR, REPO_ROOT
from ulysses_trainer.ds_config import resolve_ds_path
from ulysses_trainer.plan.comm_model import DEFAULT_COMM_FILE, load_bandwidth

RECIPE = REPO_ROOT / "launch" / "recipes" / "reference_8gpu_1m.yaml"
PLAN_ARGS = ["plan", "--config", str(RECIPE), "--gpus", "8", "--gpu_memory_gb", "140", "--host_memory_gb", "1000",
             "--json"]


@pytest.mark.parametrize("name", ["zero3.json", "zero3_offload.json"])
def test_the_packages_zero_jsons_are_the_checkouts(name):
    checkout = REPO_ROOT / "ds_configs" / name
    if not checkout.is_file():
        pytest.skip("not a checkout")
    assert (PACKAGE_DIR / "ds_configs" / name).read_bytes() == checkout.read_bytes()


def test_the_packages_bandwidth_table_is_the_measured_file():
    measured = REPO_ROOT / "benchmarks" / "results" / Path(DEFAULT_COMM_FILE).name
    if not measured.is_file():
        pytest.skip("not a checkout")
    assert Path(DEFAULT_COMM_FILE).parent == PACKAGE_DIR / "plan"
    assert Path(DEFAULT_COMM_FILE).read_bytes() == measured.read_bytes()
    bw = load_bandwidth(DEFAULT_COMM_FILE)  # named the same wherever the package lies
    assert bw.source.startswith("measured: ulysses_trainer/plan/comm_bandwidth_h200_x2.json (NVIDIA H200"), bw.source


def test_shipped_zero_json_names_resolve_to_the_package_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_ds_path(DEFAULT_DS_CONFIG) == PACKAGE_DIR / "ds_configs" / "zero3.json"
    assert resolve_ds_path("ds_configs/zero3_offload.json") == PACKAGE_DIR / "ds_configs" / "zero3_offload.json"
    own = tmp_path / "ds_configs" / "zero3.json"  # the working directory's own file comes first
    own.parent.mkdir()
    own.write_text("{}")
    assert resolve_ds_path(DEFAULT_DS_CONFIG).resolve() == own


def _installed(tmp: Path) -> Path:
    """A wheel built from a copy of the package's sources (nothing else of the checkout), installed into a fresh
    folder with pip --target."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    shutil.copytree(REPO_ROOT / "ulysses_trainer", src / "ulysses_trainer",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "wheel"), str(src)],
                   check=True, cwd=tmp, timeout=JOB_TIMEOUT_S)
    target = tmp / "target"
    wheel = next((tmp / "wheel").glob("ulysses_trainer-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp, timeout=JOB_TIMEOUT_S)
    return target


@pytest.mark.slow
def test_an_installed_wheel_trains_plans_and_prepares_data_from_any_directory(tmp_path):
    target = _installed(tmp_path)
    assert (target / "ulysses_trainer" / "ds_configs" / "zero3.json").is_file()
    assert not (target / "launch").exists() and not (target / "ds_configs").exists()
    away = tmp_path / "elsewhere"  # no checkout here or above
    away.mkdir()
    env = train_env()
    env["PYTHONPATH"] = str(target)  # the venv's site-packages give the dependencies
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    script = target / "bin" / "ulysses-trainer"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "ulysses_trainer"]

    def run(*args: str, cwd: Path = away, environ: dict = env) -> subprocess.CompletedProcess:
        return subprocess.run([*command, *args], cwd=cwd, env=environ, capture_output=True, text=True,
                              timeout=JOB_TIMEOUT_S)

    where = subprocess.run([sys.executable, "-c", "import ulysses_trainer; print(ulysses_trainer.__file__)"],
                           cwd=away, env=env, capture_output=True, text=True)
    assert where.stdout.strip() == str(target / "ulysses_trainer" / "__init__.py"), where.stdout + where.stderr

    ckpt = write_checkpoint(tmp_path / "ckpt")
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=8, words_per_doc=31)
    out = tmp_path / "out"
    trained = run("train", "--num_gpus", "1", "--model_name_or_path", str(ckpt), "--dataset_name", str(docs),
                  "--max_length", "32", "--max_steps", "1", "--output_dir", str(out))
    assert trained.returncode == 0, job_failure(trained)
    assert (out / "final" / "config.json").is_file()
    assert "loss" in json.loads((out / "metrics.jsonl").read_text().splitlines()[0])

    data = run("data", "--model_name_or_path", str(ckpt), "--dataset_name", str(docs), "--max_length", "32")
    assert data.returncode == 0, data.stderr[-3000:]
    assert run("rehearse", "--help").returncode == 0

    # auto decides the same: the plan from the wheel equals the checkout's, every field
    planned = run(*PLAN_ARGS)
    assert planned.returncode == 0, planned.stderr[-3000:]
    checkout_env = dict(env, PYTHONPATH=str(REPO_ROOT))
    in_checkout = subprocess.run([sys.executable, "-m", "ulysses_trainer", *PLAN_ARGS], cwd=REPO_ROOT,
                                 env=checkout_env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert in_checkout.returncode == 0, in_checkout.stderr[-3000:]
    assert json.loads(planned.stdout) == json.loads(in_checkout.stdout)
    assert "communication modelled (measured bandwidth" in planned.stdout  # the package's table, not a guess
