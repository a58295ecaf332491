"""The per-position loss plot, the eval rows' loss by position and the recall probe, from one real CPU training run
(2 SP ranks as the launcher starts them, forked from tests/warm_ranks.py's server; ZeRO-3)."""

import json

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, job_failure, train_env
from tests.warm_ranks import run_trainer

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("position") / "run"
    args = ["--max_length", "1024", "--max_steps", "2", "--plot_per_position_loss", "true",
            "--eval_steps", "2", "--eval_recall_probe", "true", "--bf16", "false",
            "--save_strategy", "no", "--output_dir", str(out)]
    # faulthandler: a rank that dies from a signal (SIGSEGV, SIGABRT) prints its Python stack before it goes
    res = run_trainer(2, args, timeout=JOB_TIMEOUT_S, env=dict(train_env(), PYTHONFAULTHANDLER="1"))
    assert res.returncode == 0, job_failure(res)
    return out, res


@pytest.mark.slow
def test_per_position_loss_png_from_a_training_run(run):
    out, _ = run
    assert (out / "per_position_loss.png").read_bytes()[:8] == PNG
    assert not (out / "final").exists()  # save_strategy no: no checkpoint, no export


@pytest.mark.slow
def test_eval_rows_carry_the_loss_by_position_and_the_recall_probe_and_the_plot_is_written(run):
    out, res = run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2]
    assert not any("eval_loss_by_position" in r or "eval_recall" in r for r in rows if "loss" in r)  # eval rows only
    ev = evals[0]
    pos = ev["eval_loss_by_position"]
    assert pos["edges"] == [0, 128, 256, 512, 1024]
    # the 2 synthetic eval rows of 1,024 tokens: 1,023 targets each, at positions 1 .. 1,023
    assert pos["tokens"] == [2 * 127, 2 * 128, 2 * 256, 2 * 512]
    mean = sum(lo * n for lo, n in zip(pos["loss"], pos["tokens"])) / sum(pos["tokens"])
    assert abs(mean - ev["eval_loss"]) <= 1e-9 * ev["eval_loss"]  # eval_loss is the buckets' total
    recall = ev["eval_recall_by_distance"]
    assert recall["edges"] == pos["edges"] and all(n > 0 for n in recall["facts"])  # facts at every distance
    assert all(0.0 <= a <= 1.0 for a in recall["accuracy"]) and 0.0 <= ev["eval_recall"] <= 1.0
    assert "'eval_recall'" in res.stdout  # beside eval_loss on the eval line
    assert (out / "eval_loss_by_position.png").read_bytes()[:8] == PNG
