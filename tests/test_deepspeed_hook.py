"""cli/deepspeed_hook.py picks out the `deepspeed` command's runner and per-node launcher of this trainer, and
nothing else; torch finds it through the installed package's entry point, and Python's start-up (before torch) through
the installed .pth file."""

import os
import site
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from ulysses_trainer.cli.deepspeed_hook import launch_role
from ulysses_trainer.cli.node_launcher import how_it_ended

ROOT = Path(__file__).resolve().parent.parent
PY = "/venv/bin/python3"
SCRIPT = str(ROOT / "launch" / "train.py")


def test_the_entry_point_is_installed():
    names = {e.value for e in entry_points(group="torch.backends")}
    assert "ulysses_trainer.cli.deepspeed_hook:install" in names, \
        "the package's torch.backends entry point is not registered here: reinstall (pip install -e .)"


START_PTH = "00-ulysses_trainer-runner.pth"  # setup.py writes it


def test_the_start_up_file_is_installed_and_read_before_an_editable_installs():
    found = [Path(d) / START_PTH for d in site.getsitepackages() if (Path(d) / START_PTH).is_file()]
    assert found, f"no {START_PTH} in site-packages: reinstall (pip install -e .)"
    # site reads .pth files in name order: the handler is in place before an editable install's import hook loads
    assert all(START_PTH < p.name for p in found[0].parent.glob("__editable__*.pth"))


@pytest.mark.slow
def test_the_start_up_file_acts_only_in_the_runner_of_this_trainer(tmp_path):
    fake = tmp_path / "deepspeed"  # the `deepspeed` command's name, but it says what start-up left in place
    fake.write_text("import signal, sys\n"
                    "print(signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, 'ulysses_trainer' in sys.modules,"
                    " 'ulysses_trainer.cli.deepspeed_hook' in sys.modules)\n")

    def started(*args: str, **env: str) -> list[str]:
        res = subprocess.run([sys.executable, str(fake), "--num_gpus", "2", *args], cwd=ROOT, text=True,
                             env={**os.environ, **env}, capture_output=True, timeout=60)
        assert res.returncode == 0 and not res.stderr, res.stderr
        return res.stdout.split()

    # the runner: a handler, from the hook file alone (the package, its import hook, are not loaded)
    assert started("launch/train.py", "--max_steps", "1") == ["True", "False", "True"]
    assert started("--module", "ulysses_trainer.cli.rank") == ["True", "False", "True"]
    # anything else keeps Python's start-up: another script, a multi-node runner, the hook switched off
    assert started(str(ROOT / "examples" / "own_loop.py")) == ["False", "False", "False"]
    assert started("--hostfile", "hosts", "launch/train.py") == ["False", "False", "False"]
    assert started("launch/train.py", TORCH_DEVICE_BACKEND_AUTOLOAD="0") == ["False", "False", "False"]


def test_roles():
    assert launch_role([PY, "/venv/bin/deepspeed", "--num_gpus", "2", SCRIPT, "--max_steps", "3"])[0] == "runner"
    assert launch_role([PY, "-m", "deepspeed.launcher.runner", "--module", "ulysses_trainer.cli.rank"])[0] == "runner"
    launch = [PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "--master_port=1",
              "--enable_each_rank_log=None"]
    assert launch_role([*launch, SCRIPT, "--x", "1"]) == ("node_launcher", [*launch[4:], SCRIPT, "--x", "1"])
    assert launch_role([*launch, "--module", "ulysses_trainer.cli.rank"])[0] == "node_launcher"
    # not ours: another script, an option the trainer's launcher does not implement, a multi-node runner, a rank
    assert launch_role([*launch, str(ROOT / "examples" / "own_loop.py")])[0] == ""
    assert launch_role([*launch, "--save_pid=3", SCRIPT])[0] == ""
    assert launch_role([*launch[:-1], "--enable_each_rank_log=logs", SCRIPT])[0] == ""
    assert launch_role([PY, "/venv/bin/deepspeed", "--hostfile", "hosts", SCRIPT])[0] == ""
    assert launch_role([PY, "-u", SCRIPT, "--local_rank=0"])[0] == ""
    assert launch_role([PY, "-c", "import torch"])[0] == ""


def test_how_a_rank_ended():
    assert how_it_ended(-9) == "was killed by signal 9 (SIGKILL)"
    assert how_it_ended(1) == "exited with code 1"


@pytest.mark.slow
def test_the_start_up_lines_code_leaves_no_warning(tmp_path, monkeypatch):
    """setup.py's .pth line (this checkout's, not the installed copy's) acts in the runner and leaves nothing for
    `python -W error` (-X dev) to report: no unclosed file, no warning of any kind."""
    import runpy

    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)  # setup.py's names, without building anything
    line = runpy.run_path(str(ROOT / "setup.py"))["pth_line"](str(ROOT))
    fake = tmp_path / "deepspeed"  # the runner's name, so the line runs the hook's guard_start
    fake.write_text(line + "import gc, sys; gc.collect(); print('ulysses_trainer.cli.deepspeed_hook' in sys.modules)\n")
    # -S: without site, so the installed copy of the line (which may be older) does not run before it
    cmd = [sys.executable, "-S", "-X", "dev", "-W", "error", str(fake), "--num_gpus", "2", "launch/train.py"]
    res = subprocess.run(cmd, cwd=ROOT, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
                         capture_output=True, timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (0, "True\n", ""), res.stderr
