"""The per-position loss plot, produced by a real CPU training run (2 SP ranks)."""

import os
import re
import subprocess

import pytest

from tests.dist_utils import train_command, train_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_per_position_loss_png_from_a_training_run(tmp_path):
    out = tmp_path / "run"
    cmd = train_command(2, ["--max_length", "1024", "--max_steps", "2", "--plot_per_position_loss", "true",
                            "--save_strategy", "no", "--output_dir", str(out)])
    # faulthandler: a rank that dies from a signal (SIGSEGV, SIGABRT) prints its Python stack before it goes
    env = dict(train_env(), PYTHONFAULTHANDLER="1")
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # on failure show every rank's error lines, not only the tail (the first rank to fail is the cause; the
    # other one only reports the lost peer), native deaths included (the launcher's "exits with return code
    # = -9" for a kill, "terminate called" / "Fatal Python error" for an abort or a crash)
    log = res.stdout + res.stderr
    errors = [line for line in log.splitlines()
              if re.search(r"Error|error:|Traceback|exits with|warning:|terminate called|Fatal Python", line)]
    shown = errors if len(errors) <= 40 else errors[:20] + ["..."] + errors[-20:]  # the first failure is the cause
    assert res.returncode == 0, "\n".join(shown) + "\n----\n" + log[-4000:]
    png = out / "per_position_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "final").exists()  # save_strategy no: no checkpoint, no export
