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
    res = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=600)
    # on failure show every rank's error lines, not only the tail (the first rank to fail is the cause; the
    # other one only reports the lost peer)
    log = res.stdout + res.stderr
    errors = [line for line in log.splitlines() if re.search(r"Error|error:|Traceback|exits with|warning:", line)]
    assert res.returncode == 0, "\n".join(errors[-40:]) + "\n----\n" + log[-4000:]
    png = out / "per_position_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "final").exists()  # save_strategy no: no checkpoint, no export
