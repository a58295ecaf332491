"""Through the real command (`python launch/train.py`, one CPU rank, a tiny local checkpoint): save_total_limit
with and without a resume, a 4-step run resumed to 6 trains what a straight 6-step run trains, the logged loss
is the mean over the logging interval (console, metrics.jsonl, TensorBoard), and overwrite_output_dir removes
what the trainer wrote and nothing else.

  four      4 steps, a checkpoint every step, save_total_limit 2, TensorBoard
  resumed   four resumed (latest) with max_steps 6
  six       6 steps straight, logged every step, no checkpoint, verify_sp false (four and over: auto, on)
  interval  six's run logged every 4 steps
  over      overwrite_output_dir over resumed's directory, 2 steps, save_total_limit 1
"""

from __future__ import annotations

import ast
import json
import random
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.dist_utils import JOB_TIMEOUT_S
from tests.tiny_checkpoint import WORDS, write_checkpoint
from tests.warm_ranks import run_bare

pytestmark = pytest.mark.slow
pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard")

ROOT = Path(__file__).resolve().parent.parent
MARKER = "ulysses_trainer_checkpoint"


def _documents(path: Path, num_docs: int, seed: int = 1) -> Path:
    """Documents of 5-40 words: packed rows hold different numbers of document starts (untrained tokens), so
    the steps train different numbers of tokens."""
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))})
                            + "\n" for _ in range(num_docs)))
    return path


def _run(args: list[str]) -> subprocess.CompletedProcess:
    proc = run_bare(args, timeout=JOB_TIMEOUT_S)  # `python launch/train.py ARGS`, forked (tests/warm_ranks.py)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def _rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda n: (not n[11:].isdigit(), n))


def _events(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "runs"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _log_lines(stdout: str) -> list[dict]:
    return [ast.literal_eval(m) for m in re.findall(r"\{'loss': [^{}]*\}", stdout)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_runs")
    model = write_checkpoint(root / "model")
    docs = _documents(root / "docs.jsonl", num_docs=60)
    common = ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32",
              "--packing", "true", "--bf16", "false", "--seed", "7", "--learning_rate", "1e-3",
              "--lr_scheduler_type", "constant", "--per_device_train_batch_size", "1",
              "--gradient_accumulation_steps", "2"]
    out = root / "run"
    (out / "checkpoint-best").mkdir(parents=True)  # the user's: not a run of ours, never deleted
    (out / "checkpoint-best" / "keep.txt").write_text("mine")
    saving = ["--save_steps", "1", "--save_total_limit", "2", "--report_to", "tensorboard", "--output_dir", str(out)]
    got = {"root": root, "out": out}
    got["four_proc"] = _run(common + ["--max_steps", "4"] + saving)  # verify_sp auto: on at the first start
    got["four"] = {"checkpoints": _checkpoints(out), "rows": _rows(out), "latest": (out / "latest").read_text(),
                   "markers": [(out / c / MARKER).is_file() for c in _checkpoints(out) if c[11:].isdigit()]}
    got["resumed_proc"] = _run(common + ["--max_steps", "6", "--resume_from_checkpoint", "true"] + saving)
    got["resumed"] = {"checkpoints": _checkpoints(out), "rows": _rows(out), "latest": (out / "latest").read_text(),
                      "events": _events(out)}
    six, interval = root / "six", root / "interval"
    got["six_proc"] = _run(common + ["--max_steps", "6", "--save_strategy", "no", "--verify_sp", "false",
                                     "--output_dir", str(six)])
    got["six"] = _rows(six)
    got["interval_proc"] = _run(common + ["--max_steps", "6", "--save_strategy", "no", "--logging_steps", "4",
                                          "--report_to", "tensorboard", "--output_dir", str(interval)])
    got["interval"], got["interval_events"] = _rows(interval), _events(interval)
    (out / "runs" / "notes.txt").write_text("mine too")
    _run(common + ["--max_steps", "2", "--save_steps", "1", "--save_total_limit", "1", "--overwrite_output_dir",
                   "true", "--report_to", "tensorboard", "--output_dir", str(out)])
    got["over"] = {"checkpoints": _checkpoints(out), "rows": _rows(out), "events": _events(out)}
    return got


def test_save_total_limit_keeps_the_newest_across_a_resume(runs):
    four, resumed = runs["four"], runs["resumed"]
    assert four["checkpoints"] == ["checkpoint-3", "checkpoint-4", "checkpoint-best"]
    assert four["latest"].strip() == "checkpoint-4" and four["markers"] == [True, True]
    # the resumed run counts the checkpoints written before it: 3 and 4 go once 5 and 6 exist
    assert resumed["checkpoints"] == ["checkpoint-5", "checkpoint-6", "checkpoint-best"]
    assert resumed["latest"].strip() == "checkpoint-6"
    assert (runs["out"] / "checkpoint-best" / "keep.txt").read_text() == "mine"


def test_a_run_extended_on_resume_trains_what_the_straight_run_trains(runs):
    resumed, six = runs["resumed"]["rows"], runs["six"]
    assert [r["step"] for r in resumed] == [r["step"] for r in six] == [1, 2, 3, 4, 5, 6]
    # fp32 on CPU, constant learning rate: the same sequences in the same order give bitwise equal losses
    for a, b in zip(resumed, six):
        assert (a["loss"], a["grad_norm"], a["num_tokens"], a["num_loss_tokens"]) == \
            (b["loss"], b["grad_norm"], b["num_tokens"], b["num_loss_tokens"]), (a, b)
    assert "the data order continues where it stopped" in runs["resumed_proc"].stdout


def test_verify_sp_runs_at_the_first_start_only_and_changes_no_loss(runs):
    # four: auto at its first start (the check ran); resumed: auto at resume (it did not); six: false. Six's rows
    # equal the resumed run's bitwise (above), so the first step's loss is the same with the check on and off
    said = [line for line in runs["four_proc"].stdout.splitlines() + runs["four_proc"].stderr.splitlines()
            if "verify_sp:" in line]
    assert len(said) == 1 and re.search(r"verify_sp: loss \S+ vs \S+, grad norm \S+ vs \S+ .* s$", said[0]), said
    for name in ("resumed_proc", "six_proc"):
        assert "verify_sp" not in runs[name].stdout + runs[name].stderr, name
    assert json.dumps(runs["resumed"]["rows"][0]["loss"]) == json.dumps(runs["six"][0]["loss"])


def test_logged_loss_is_the_mean_over_the_logging_interval(runs):
    six, interval = runs["six"], runs["interval"]
    tokens = np.diff([0] + [r["num_loss_tokens"] for r in six])
    assert len(set(tokens.tolist())) > 1  # the steps train different numbers of tokens: the weights matter
    assert [r["step"] for r in interval] == [4, 6]  # every 4 steps, and the last step
    for row, steps in zip(interval, ([0, 1, 2, 3], [4, 5])):
        mean = sum(six[i]["loss"] for i in steps) / len(steps)  # HF's: the step losses' plain mean
        assert row["loss"] == pytest.approx(mean, rel=1e-12)
        weighted = sum(six[i]["loss"] * tokens[i] for i in steps) / sum(tokens[i] for i in steps)
        assert row["token_weighted_loss"] == pytest.approx(weighted, rel=1e-12)
        assert row["loss"] != pytest.approx(six[steps[-1]]["loss"], rel=1e-9)  # not the last step's
        last = six[steps[-1]]
        assert (row["grad_norm"], row["num_loss_tokens"]) == (last["grad_norm"], last["num_loss_tokens"])
    shown = _log_lines(runs["interval_proc"].stdout)
    assert [s["loss"] for s in shown] == [round(r["loss"], 4) for r in interval]
    events = runs["interval_events"]["train/loss"]
    assert [s for s, _ in events] == [4, 6]
    assert [v for _, v in events] == pytest.approx([r["loss"] for r in interval], rel=1e-6)  # float32


def test_overwrite_removes_what_the_trainer_wrote_and_nothing_else(runs):
    out, over = runs["out"], runs["over"]
    assert [s for s, _ in runs["resumed"]["events"]["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert over["checkpoints"] == ["checkpoint-2", "checkpoint-best"]
    assert [r["step"] for r in over["rows"]] == [1, 2]
    # the old run's curve is gone: TensorBoard shows the new run's steps only
    loss = over["events"]["train/loss"]
    assert [s for s, _ in loss] == [1, 2]
    assert [v for _, v in loss] == pytest.approx([r["loss"] for r in over["rows"]], rel=1e-6)
    assert (out / "checkpoint-best" / "keep.txt").read_text() == "mine"
    assert (out / "runs" / "notes.txt").read_text() == "mine too"
    assert (out / "final").is_dir() and (out / "latest").read_text().strip() == "checkpoint-2"
