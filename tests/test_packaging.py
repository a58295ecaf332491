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


def test_the_packages_recipes_are_the_checkouts_and_ship_as_package_data():
    checkout = REPO_ROOT / "launch" / "recipes"
    if not checkout.is_dir():
        pytest.skip("not a checkout")
    shipped = {f.name: f.read_bytes() for f in (PACKAGE_DIR / "recipes").glob("*.yaml")}
    ours = {f.name: f.read_bytes() for f in checkout.glob("*.yaml")}
    differ = sorted(n for n in set(shipped) | set(ours) if shipped.get(n) != ours.get(n))
    assert not differ, f"copy launch/recipes/{{{','.join(differ)}}} to ulysses_trainer/recipes/ (the package's copies)"
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    patterns = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert all(any(Path("recipes", name).match(p) for p in patterns["ulysses_trainer"]) for name in shipped)


def test_a_recipe_named_as_the_readme_does_resolves_outside_a_checkout(tmp_path, monkeypatch):
    from ulysses_trainer.config.load import read_recipe, resolve_recipe
    from ulysses_trainer.errors import ConfigError

    monkeypatch.chdir(tmp_path)  # no launch/recipes/ here
    ref = PACKAGE_DIR / "recipes" / "reference_8gpu_1m.yaml"
    for name in ("launch/recipes/reference_8gpu_1m.yaml", "reference_8gpu_1m.yaml", "reference_8gpu_1m"):
        assert resolve_recipe(name) == ref
    assert read_recipe("launch/recipes/one_gpu_4b_long.yaml")["model_name_or_path"] == "qwen3-4b"
    own = tmp_path / "launch" / "recipes" / "reference_8gpu_1m.yaml"  # the working directory's own file first
    own.parent.mkdir(parents=True)
    own.write_text("max_length: 64\n")
    assert read_recipe("launch/recipes/reference_8gpu_1m.yaml") == {"max_length": 64}
    with pytest.raises(ConfigError, match=r"recipe 'nope' not found; .*a shipped recipe by name \(agent_sessions_1m, "):
        read_recipe("nope")


def test_plan_calibrate_outside_a_checkout_says_what_it_lacks(tmp_path, monkeypatch, capsys):
    from ulysses_trainer.__main__ import main as cli_main
    from ulysses_trainer.cli import plan as plan_cli
    from ulysses_trainer.plan.calibration import load_calibration

    if not (REPO_ROOT / "benchmarks" / "results").is_dir():
        pytest.skip("not a checkout")
    monkeypatch.chdir(REPO_ROOT)
    assert cli_main(["plan", "calibrate", "--json"]) == 0
    in_checkout = capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan_cli, "REPO_ROOT", tmp_path)  # as installed: no benchmarks/results beside the package
    assert cli_main(["plan", "calibrate", "--json"]) == 0
    installed = capsys.readouterr()
    assert len(json.loads(installed.out)) == len(load_calibration()) < len(json.loads(in_checkout.out))
    assert "note: no benchmarks/results here" in installed.err and "note:" not in in_checkout.err
    assert "run it in a checkout of the repository or pass --results_dir" in installed.err
    assert cli_main(["plan", "calibrate", "--results_dir", str(tmp_path / "nope")]) == 2


def test_a_built_wheel_leaves_no_untracked_build_folder():
    """`pip wheel .` writes build/ (setuptools' staging) beside the sources; dist/ is `python -m build`'s."""
    ignore = REPO_ROOT / ".gitignore"
    if not ignore.is_file():
        pytest.skip("not a checkout")
    assert {"/build/", "/dist/"} <= set(ignore.read_text().splitlines())


def _installed(tmp: Path) -> Path:
    """A wheel built from a copy of the package's sources (nothing else of the checkout), installed into a fresh
    folder with pip --target."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
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
    assert (target / "ulysses_trainer" / "recipes" / "reference_8gpu_1m.yaml").is_file()
    assert not (target / "launch").exists() and not (target / "ds_configs").exists()
    assert (target / "00-ulysses_trainer-runner.pth").is_file()  # beside the package: site-packages once installed
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
    # the README's commands name launch/recipes/...: the package's copies answer them from any directory
    readme = run(*["launch/recipes/reference_8gpu_1m.yaml" if a == str(RECIPE) else a for a in PLAN_ARGS])
    assert readme.returncode == 0, readme.stderr[-3000:]
    assert json.loads(readme.stdout) == json.loads(planned.stdout)


# modules tests import-or-skip that the README's install leaves out on purpose, and why
NOT_INSTALLED = {"liger_kernel": "its CUDA kernels: the GPU tests", "wandb": "an optional reporter (an account)"}


def test_the_readmes_install_brings_every_module_a_test_skips_without():
    """CI (.ci/run) runs the README's install: the tests that import-or-skip a module (TRL's comparisons among them)
    run there, except those NOT_INSTALLED names."""
    import re

    try:
        import tomllib
    except ModuleNotFoundError:
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    install = (REPO_ROOT / "README.md").read_text().split("```bash\n", 1)[1].splitlines()[0]
    extras = re.search(r'-e "\.\[([\w,]+)\]"', install).group(1).split(",")
    wanted = [*project["dependencies"], *(d for e in extras for d in project["optional-dependencies"][e])]
    installed = {re.split(r"[<>=!~\[; ]", d)[0].lower().replace("-", "_") for d in wanted}
    skipped = {m.split(".")[0] for p in (REPO_ROOT / "tests").glob("*.py")
               for m in re.findall(r'importorskip\(\s*"([\w.]+)"', p.read_text())}
    assert "trl" in skipped and {m for m in skipped if m.lower() not in installed} == set(NOT_INSTALLED)
