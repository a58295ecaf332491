"""The README's commands, in the order it gives them, on a fresh copy of the checkout with an empty HOME:
each runs, or (a GPU recipe on this CPU machine) is refused up front with one line naming the host memory
it would need; none collides with an earlier one's output; the main job prints the losses the README shows."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, free_port, train_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
REFUSED = re.compile(r"^error: the plan needs [\d.]+ GiB of host memory on this CPU machine", re.M)


def readme_commands() -> list[str]:
    """The `deepspeed ...` and `ulysses-trainer ...` lines of the README's code blocks, comments cut."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)
    lines = [line.split("  #", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(("deepspeed ", "ulysses-trainer "))]


def _fresh_copy(dest: Path) -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def _my_books(path: Path) -> None:
    """The user's own file the README's example trains on: records with a `body` field, about 9K tokens."""
    with path.open("w") as f:
        for i in range(24):
            words = " ".join(f"page{i} line{j % 53} of the book" for j in range(80))
            f.write(json.dumps({"title": f"book {i}", "body": words}) + "\n")


def test_readme_commands_run_in_order_on_a_fresh_checkout(tmp_path):
    commands = readme_commands()
    assert commands[0] == "deepspeed --num_gpus 2 launch/train.py", commands  # the main job comes first
    repo, home = tmp_path / "repo", tmp_path / "home"
    home.mkdir()
    _fresh_copy(repo)
    _my_books(repo / "my_books.jsonl")
    bin_dir = os.path.dirname(sys.executable)
    env = dict(train_env(), HOME=str(home), PYTHONPATH=str(repo), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    ran, refused = [], []
    for cmd in commands:
        outputs_before = set((repo / "out").glob("*")) if (repo / "out").exists() else set()
        argv = shlex.split(cmd)  # as a shell reads it: a quoted --model_init_kwargs is one argument
        if argv[0] == "deepspeed":  # as written, on a free port: DeepSpeed's default (29500) may be another job's
            argv[1:1] = ["--master_port", str(free_port())]
        proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        said = proc.stdout + proc.stderr
        if proc.returncode == 2 and REFUSED.search(proc.stderr):  # a GPU recipe on this machine: up front
            assert len(re.findall(r"^error:", proc.stderr, re.M)) == 1 and "Traceback" not in said, said[-3000:]
            new = set((repo / "out").glob("*")) - outputs_before if (repo / "out").exists() else set()
            assert not new, f"{cmd}: refused but wrote {new}"
            if "--out" in cmd.split():  # nor the result file it names
                assert not (repo / cmd.split()[cmd.split().index("--out") + 1]).exists(), cmd
            refused.append(cmd)
            continue
        assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{said[-3000:]}"
        ran.append(cmd)
        if cmd == commands[0]:  # the README shows what the main job prints
            shown = re.findall(r"^\{'loss'.*\}$", (ROOT / "README.md").read_text(), re.M)
            assert shown and all(line in proc.stdout for line in shown), proc.stdout[-3000:]
    # only the multi-GPU recipes are too big for a CPU machine; everything else ran
    assert refused and all("--config launch/recipes/" in c and "cpu_default" not in c for c in refused), refused
    assert any("my_books" in c for c in ran) and any("own_loop" in c for c in ran) and len(ran) >= 7, ran
    assert (repo / "out" / "default" / "final").is_dir() and (repo / "out" / "my_books" / "final").is_dir()
