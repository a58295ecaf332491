"""Ctrl-C under the README's own command, `deepspeed --num_gpus 2 launch/train.py` (CPU, gloo), sent as a terminal
sends it: SIGINT to the job's whole process group (DeepSpeed's runner, its per-node launcher and the ranks). In the
runner's first seconds (its interpreter importing torch: only the installed .pth file's handler is in place), at
start-up (the rank processes exist, their interpreters still starting) and during training (rank 0 held as it
writes step 1's row until the signal is pending there): exit 130, one line, no traceback from any process (the
runner's KeyboardInterrupt included), nothing half-written. One launched run per phase; the first seconds' runs
end within a second."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.dist_utils import JOB_TIMEOUT_S, start_job, train_command, train_env
from tests.held_rank import blocks, catches, has_pending, held_env, is_stopped, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--max_length", "64", "--max_steps", "10", "--bf16", "false"]


def _start(out: Path, env: dict) -> subprocess.Popen:
    return start_job(train_command(2, [*ARGS, "--output_dir", str(out)]), open(f"{out}.log", "w"), env)


def _finish(p: subprocess.Popen, out: Path) -> tuple[int, str]:
    try:
        rc = p.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return rc, Path(f"{out}.log").read_text()


def _ranks(p: subprocess.Popen) -> dict[int, psutil.Process]:
    out = {}
    for q in psutil.Process(p.pid).children(recursive=True):
        try:
            arg = next((a for a in q.cmdline() if a.startswith("--local_rank=")), None)
        except psutil.Error:
            continue
        if arg:
            out[int(arg.split("=")[1])] = q
    return out


def _clean(log: str) -> None:
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "Exception ignored" not in log, log[-4000:]


@pytest.mark.parametrize("after_s", [0.0, 0.2, 0.5, 1.0])
def test_ctrl_c_while_the_command_imports_torch_says_one_line_and_exits_130(tmp_path, after_s):
    """From the moment the .pth file's handler is in place (SIGTERM caught: Python's own start catches only
    SIGINT), at once and later in the runner's import of torch (on a fast machine the last may reach the ranks)."""
    out = tmp_path / "run"
    p = _start(out, train_env())
    # the entry point blocks both once torch is imported: reached without the start-up handler, it was not there
    wait_for(lambda: catches(p.pid, signal.SIGTERM) or blocks(p.pid, signal.SIGINT), p, "the runner's handler")
    assert catches(p.pid, signal.SIGTERM), "the start-up handler did not act: reinstall (pip install -e .)"
    time.sleep(after_s)
    os.killpg(p.pid, signal.SIGINT)
    rc, log = _finish(p, out)
    assert rc == 130, log[-4000:]
    assert log.count("interrupted before training: nothing written") == 1, log[-4000:]
    _clean(log)
    assert not out.exists()


def test_ctrl_c_while_the_ranks_start_says_one_line_and_exits_130(tmp_path):
    out = tmp_path / "run"
    p = _start(out, train_env())
    wait_for(lambda: len(_ranks(p)) == 2, p, "the rank processes")
    os.killpg(p.pid, signal.SIGINT)
    rc, log = _finish(p, out)
    assert rc == 130, log[-4000:]
    assert log.count("interrupted before training: nothing written") == 1, log[-4000:]
    _clean(log)
    assert not out.exists()


def test_ctrl_c_during_training_saves_at_the_step_boundary_and_exits_130(tmp_path):
    out = tmp_path / "run"
    p = _start(out, held_env(tmp_path, "metrics.jsonl"))
    wait_for(lambda: 0 in _ranks(p) and is_stopped(_ranks(p)[0].pid), p, "rank 0 held at step 1's row")
    rank0 = _ranks(p)[0]
    os.killpg(p.pid, signal.SIGINT)
    wait_for(lambda: has_pending(rank0.pid, signal.SIGINT), p, "the Ctrl-C pending on rank 0")
    rank0.resume()
    rc, log = _finish(p, out)
    assert rc == 130, log[-4000:]
    assert log.count("interrupted: saving at the next step boundary") == 1, log[-4000:]
    assert log.count("stop signal: saved step 1, exiting") == 1, log[-4000:]
    _clean(log)
    assert (out / "latest").read_text().strip() == "checkpoint-1" and not list(out.glob(".tmp-*"))
    for r in (0, 1):  # the checkpoint is whole: every rank's shards load
        for kind in ("model_states", "optim_states"):
            torch.load(out / "checkpoint-1" / "ds" / f"zero_pp_rank_{r}_mp_rank_00_{kind}.pt", map_location="cpu",
                       weights_only=False)
    # the ZeRO JSON the engine ran: every "auto" filled, and said once at start
    ran = json.loads((out / "ds_config.json").read_text())
    assert "auto" not in json.dumps(ran) and ran["train_batch_size"] == 2 and ran["bf16"]["enabled"] is False
    assert log.count("ZeRO config ds_configs/zero3.json, filled: train_batch_size 2, ") == 1, log[-4000:]
