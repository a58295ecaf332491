"""The per-position loss plot, produced by a real CPU training run (2 SP ranks)."""

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, job_failure, run_job, train_command, train_env


@pytest.mark.slow
def test_per_position_loss_png_from_a_training_run(tmp_path):
    out = tmp_path / "run"
    cmd = train_command(2, ["--max_length", "1024", "--max_steps", "2", "--plot_per_position_loss", "true",
                            "--save_strategy", "no", "--output_dir", str(out)])
    # faulthandler: a rank that dies from a signal (SIGSEGV, SIGABRT) prints its Python stack before it goes
    res = run_job(cmd, timeout=JOB_TIMEOUT_S, env=dict(train_env(), PYTHONFAULTHANDLER="1"))
    assert res.returncode == 0, job_failure(res)
    png = out / "per_position_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "final").exists()  # save_strategy no: no checkpoint, no export
