"""A failed multi-rank job explains itself: the rank that died first and how, and whether the kernel's OOM
killer ended a process while it ran (the launched tests assert with `job_failure`)."""

import subprocess
import sys

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, free_port, job_failure, run_job, train_env

RANK1_DIES = """
import os, signal, time
from ulysses_trainer.parallel.init import init_distributed
init_distributed("gloo")
if int(os.environ["RANK"]) == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
time.sleep(120)  # rank 0 waits (no collective that could fail first): the launcher sees rank 1's death alone
"""


def test_report_keeps_the_first_error_and_the_oom_count():
    log = "\n".join(["noise"] * 50 + ["rank 1: RuntimeError: the cause"] + ["x"] * 2000
                    + ["rank 0: RuntimeError: Connection closed by peer"])
    res = subprocess.CompletedProcess(["deepspeed", "launch/train.py"], 1, stdout="", stderr=log)
    res.oom_kills = 1
    text = job_failure(res)
    assert "RuntimeError: the cause" in text  # far above the tail, still shown
    assert "OOM kills while it ran: 1" in text and "MiB available" in text
    assert text.startswith("deepspeed launch/train.py exited 1")


@pytest.mark.slow
def test_a_killed_rank_is_named_by_the_launcher_line(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(RANK1_DIES)
    deepspeed = [sys.executable, "-m", "deepspeed.launcher.runner"]
    res = run_job([*deepspeed, "--master_port", str(free_port()), "--num_gpus", "2", str(script)],
                  timeout=JOB_TIMEOUT_S, env=train_env())
    assert res.returncode != 0
    text = job_failure(res)
    assert "exits with return code = -9" in text, text  # SIGKILL: the rank did not fail, it was killed
    assert res.oom_kills in (0, None)  # a kill by hand is not counted as an OOM kill
