"""cli/deepspeed_hook.py picks out the `deepspeed` command's runner and per-node launcher of this trainer, and
nothing else; torch finds it through the installed package's entry point."""

from importlib.metadata import entry_points
from pathlib import Path

from ulysses_trainer.cli.deepspeed_hook import launch_role
from ulysses_trainer.cli.node_launcher import how_it_ended

ROOT = Path(__file__).resolve().parent.parent
PY = "/venv/bin/python3"
SCRIPT = str(ROOT / "launch" / "train.py")


def test_the_entry_point_is_installed():
    names = {e.value for e in entry_points(group="torch.backends")}
    assert "ulysses_trainer.cli.deepspeed_hook:install" in names, \
        "the package's torch.backends entry point is not registered here: reinstall (pip install -e .)"


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
