"""Faults through the real command (`deepspeed --num_gpus 2 launch/train.py`, CPU, fp32, sp 2):

- a rank SIGKILLed while a checkpoint is being written: the previous checkpoint and `latest` stay
  intact, and resuming from them reproduces the uninterrupted run's losses bitwise;
- SIGTERM to every rank, as a cluster scheduler sends it: exit 0 with a checkpoint at the step
  boundary, and the resumed run reproduces the uninterrupted run's losses bitwise;
- a step with a NaN gradient (a checkpoint whose weights overflow on one word, tests/tiny_checkpoint.py):
  nan_policy=stop exits 1 without saving it; nan_policy=skip leaves parameters and optimizer state
  bitwise as they were, logs a warning, and trains on.

Each run costs ~20-30 s of start-up on a 2-core machine; the uninterrupted reference is shared.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch

from tests.dist_utils import JOB_TIMEOUT_S, start_job, train_command, train_env
from tests.held_rank import has_pending, held_env, is_stopped, wait_for
from tests.tiny_checkpoint import write_checkpoint, write_documents
from tests.warm_ranks import run_trainer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
# the tiny preset (real vocabulary: a checkpoint is ~110 MB, so a save takes a visible moment)
ARGS = ["--max_length", "64", "--max_steps", str(STEPS), "--learning_rate", "1e-3", "--bf16", "false",
        "--seed", "3"]
ROW_KEYS = ("step", "loss", "grad_norm", "learning_rate", "num_tokens")




def _start(args: list[str], out: Path, env: dict | None = None) -> subprocess.Popen:
    """The real command in its own session (so the test can signal exactly its processes)."""
    return start_job(train_command(2, [*args, "--output_dir", str(out)]), open(f"{out}.log", "a"), env or train_env())


def _finish(p: subprocess.Popen, out: Path, timeout: float = JOB_TIMEOUT_S) -> tuple[int, str]:
    try:
        rc = p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return rc, Path(f"{out}.log").read_text()


def _run(args: list[str], out: Path) -> tuple[int, str]:
    """A job the test only reads once it ended (no signal, no held rank): its ranks are forks of the preloaded
    server of tests/warm_ranks.py, as in the other tests that compare runs."""
    proc = run_trainer(2, [*args, "--output_dir", str(out)], timeout=JOB_TIMEOUT_S)
    return proc.returncode, proc.stdout + proc.stderr


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(out: Path) -> list[tuple]:
    return [tuple(r[k] for k in ROW_KEYS) for r in _rows(out) if "loss" in r]


def _ranks(p: subprocess.Popen) -> dict[int, psutil.Process]:
    """rank -> process (the launcher starts them as `python -u launch/train.py --local_rank=N ...`)."""
    ranks = {}
    for q in psutil.Process(p.pid).children(recursive=True):
        try:
            arg = next((a for a in q.cmdline() if a.startswith("--local_rank=")), None)
        except psutil.Error:  # ended since it was listed (e.g. DeepSpeed's lscpu and numactl queries)
            continue
        if arg:
            ranks[int(arg.split("=")[1])] = q
    return ranks


def _held(p: subprocess.Popen, rank: int = 0) -> psutil.Process:
    """The rank, once it has stopped itself at the point held_env named (an event, not a delay)."""
    def stopped():
        proc = _ranks(p).get(rank)
        return proc is not None and is_stopped(proc.pid)
    wait_for(stopped, p, f"rank {rank} held")
    return _ranks(p)[rank]


def _latest(out: Path) -> str:
    return (out / "latest").read_text().strip()


def _complete(ckpt: Path, world_size: int = 2) -> bool:
    """Every rank's ZeRO shards are in the checkpoint and load."""
    for r in range(world_size):
        for kind in ("model_states", "optim_states"):
            f = ckpt / "ds" / f"zero_pp_rank_{r}_mp_rank_00_{kind}.pt"
            if not f.is_file():
                return False
            torch.load(f, map_location="cpu", weights_only=False)
    return True


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple]:
    """The uninterrupted run's logged rows."""
    out = tmp_path_factory.mktemp("faults") / "reference"
    rc, log = _run(ARGS, out)
    assert rc == 0, log[-4000:]
    rows = _losses(out)
    assert [r[0] for r in rows] == list(range(1, STEPS + 1))
    return rows


def test_rank_killed_during_save_keeps_previous_checkpoint_and_resume_is_exact(reference, tmp_path):
    out = tmp_path / "run"
    frozen = 4  # checkpoint-2 exists by then
    # rank 0 holds itself in the save of step 4, its shards written, where it would next write the tag pointer and
    # then rename the directory and move `latest`; SIGKILL it there
    p = _start(ARGS + ["--save_steps", "2"], out, held_env(tmp_path, f".tmp-checkpoint-{frozen}/latest"))
    rank0 = _held(p)
    assert (out / f".tmp-checkpoint-{frozen}").is_dir() and not (out / f"checkpoint-{frozen}").exists()
    rank0.kill()  # rank 1 waits in the save's closing all-reduce, alone
    rc, log = _finish(p, out)
    assert rc != 0

    previous = f"checkpoint-{frozen - 2}"
    assert _latest(out) == previous  # `latest` never moved to the interrupted save
    assert not (out / f"checkpoint-{frozen}").exists()
    assert (out / f".tmp-checkpoint-{frozen}").is_dir()  # the interrupted save, left aside
    assert _complete(out / previous)

    rc, log = _run(ARGS + ["--save_steps", "2", "--resume_from_checkpoint", "true"], out)
    assert rc == 0, log[-4000:]
    assert f"resumed from {out / previous} at step {frozen - 2}" in log
    assert _losses(out) == reference  # every step once, bitwise equal to the uninterrupted run
    assert not list(out.glob(".tmp-checkpoint-*"))  # the stale save was replaced
    assert _latest(out) == f"checkpoint-{STEPS}" and _complete(out / f"checkpoint-{STEPS}")
    assert (out / "final" / "model.safetensors").is_file()


def test_sigterm_to_every_rank_saves_at_the_step_boundary_and_resume_is_exact(reference, tmp_path):
    out = tmp_path / "run"
    # rank 0 holds itself as it opens metrics.jsonl for step 2's row: the signal lands at a known step
    p = _start(ARGS, out, held_env(tmp_path, "metrics.jsonl", nth=2))
    _held(p)
    ranks = _ranks(p)
    assert sorted(ranks) == [0, 1]
    for proc in ranks.values():  # what a scheduler does: every rank, not the launcher
        proc.send_signal(signal.SIGTERM)
    wait_for(lambda: has_pending(ranks[0].pid, signal.SIGTERM), p, "SIGTERM pending on the held rank 0")
    ranks[0].resume()  # SIGCONT: rank 0 takes the signal, writes step 2's row and reaches the step's all-reduce
    rc, log = _finish(p, out)
    assert rc == 0, log[-4000:]

    stopped = _rows(out)[-1]["step"]
    assert stopped == 2
    assert _latest(out) == f"checkpoint-{stopped}" and _complete(out / f"checkpoint-{stopped}")
    assert log.count(f"stop signal: saved step {stopped}, exiting") == 1
    assert not (out / "final").exists()  # a stop is not the end of training

    rc, log = _run(ARGS + ["--resume_from_checkpoint", "true"], out)
    assert rc == 0, log[-4000:]
    assert _losses(out) == reference


def test_sigterm_with_save_strategy_no_says_not_saved(tmp_path):
    out = tmp_path / "run"
    p = _start(ARGS + ["--save_strategy", "no", "--max_steps", "200"], out)
    wait_for(lambda: len(_rows(out)) >= 1, p, "step 1")
    for proc in _ranks(p).values():
        proc.send_signal(signal.SIGTERM)
    rc, log = _finish(p, out)
    assert rc == 0, log[-4000:]
    stopped = _rows(out)[-1]["step"]
    assert log.count(f"stop signal: stopped at step {stopped}, not saved (save_strategy no)") == 1, log[-3000:]
    assert "saved step" not in log
    assert not list(out.glob("checkpoint-*")) and not (out / "final").exists()


# ---------------------------------------------------------------- NaN
NAN_ARGS = ["--max_length", "32", "--gradient_accumulation_steps", "2", "--max_steps", "6", "--save_steps", "1",
            "--learning_rate", "1e-2", "--bf16", "false"]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> list[str]:
    """A checkpoint whose gradient is NaN on any step that sees the word POISON, and 12 documents of
    32 tokens (one sequence each, 2 per step); document 0 holds the word, once."""
    d = tmp_path_factory.mktemp("poisoned")
    model = write_checkpoint(d / "model", poison=True)
    docs = write_documents(d / "docs.jsonl", num_docs=12, words_per_doc=31, poison_doc=0)
    return ["--model_name_or_path", str(model), "--dataset_name", str(docs)]


def _optimizer_tensors(ckpt: Path, rank: int) -> dict[str, torch.Tensor]:
    """This rank's fp32 parameter partition and Adam state (moments and step count)."""
    sd = torch.load(ckpt / "ds" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", map_location="cpu",
                    weights_only=False)["optimizer_state_dict"]
    out = {f"fp32_flat_groups.{i}": t for i, t in enumerate(sd["fp32_flat_groups"])}
    for pid, state in sd["optimizer_state_dict"]["state"].items():
        out.update({f"state.{pid}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    return out


def _engine_counters(ckpt: Path) -> dict:
    sd = torch.load(ckpt / "ds" / "zero_pp_rank_0_mp_rank_00_model_states.pt", map_location="cpu",
                    weights_only=False)
    return {"skipped_steps": sd["skipped_steps"], "step": sd["step"]}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_nan_policy_stop_exits_1_without_saving_the_step(poisoned, tmp_path):
    out = tmp_path / "stop"
    rc, log = _run(poisoned + NAN_ARGS + ["--nan_policy", "stop"], out)
    assert rc == 1, log[-4000:]
    errors = [line for line in log.splitlines() if line.startswith(("error:", "(rank"))]
    assert len(errors) == 1, errors  # printed once, not per rank
    bad = len(_rows(out)) + 1  # the step that failed was never logged
    assert errors[0].startswith(f"error: step {bad}: loss ")
    assert "stopping without saving (nan_policy=stop; the last checkpoint is intact)" in errors[0]
    assert 1 < bad < 6
    assert _latest(out) == f"checkpoint-{bad - 1}" and _complete(out / f"checkpoint-{bad - 1}")
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == [f"checkpoint-{s}" for s in range(1, bad)]
    assert not (out / "final").exists()
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in _rows(out))


def test_nan_policy_skip_leaves_the_state_bitwise_unchanged_and_trains_on(poisoned, tmp_path):
    out = tmp_path / "skip"
    rc, log = _run(poisoned + NAN_ARGS + ["--nan_policy", "skip"], out)
    assert rc == 0, log[-4000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 7))  # the step counter moves on
    bad = [r["step"] for r in rows if not math.isfinite(r["grad_norm"])]
    assert len(bad) == 1 and 1 < bad[0] < 6, rows  # the one step that sees the word, mid-run
    k = bad[0]
    assert all(math.isfinite(r["loss"]) for r in rows)  # this weight breaks the gradient, not the loss
    warnings = [line for line in log.splitlines() if "update skipped (nan_policy=skip)" in line]
    assert len(warnings) == 1 and f"warning: step {k}: " in warnings[0]
    # the data position advances with the step counter: every step's tokens are counted
    assert [r["num_tokens"] for r in rows] == [64 * s for s in range(1, 7)]
    # the schedule follows the step counter (linear decay from 1e-2 to 0 over 6 steps)
    assert [r["learning_rate"] for r in rows] == pytest.approx([1e-2 * (6 - s) / 6 for s in range(1, 7)],
                                                               rel=1e-12)

    before, after, next_ = (out / f"checkpoint-{s}" for s in (k - 1, k, k + 1))
    for rank in (0, 1):
        a, b, c = (_optimizer_tensors(x, rank) for x in (before, after, next_))
        assert a.keys() == b.keys() and len(a) == 4
        assert all(_same_bits(a[n], b[n]) for n in a), [n for n in a if not _same_bits(a[n], b[n])]
        assert not _same_bits(b["fp32_flat_groups.0"], c["fp32_flat_groups.0"])  # training went on
        assert all(torch.isfinite(t).all() for t in c.values())
    assert _engine_counters(before)["skipped_steps"] == 0
    assert _engine_counters(after) == {"skipped_steps": 1, "step": k}

    # The state the run went on from is exactly the saved one: resuming from checkpoint-k gives the
    # same later steps, bitwise.
    resumed = tmp_path / "resumed"
    rc, log = _run(poisoned + NAN_ARGS + ["--nan_policy", "skip", "--resume_from_checkpoint", str(after)],
                   resumed)
    assert rc == 0, log[-4000:]
    assert _losses(resumed) == _losses(out)[k:]


def test_a_rank_killed_mid_run_is_named_by_the_survivor_and_the_job_exits_1(tmp_path):
    """SIGKILL to rank 1 (what the kernel's OOM killer does) while rank 0 holds itself at step 3's row: rank 0 says
    in one line which rank died and how, the job exits 1 (not DeepSpeed's 247), and checkpoint-2 stays `latest`."""
    out = tmp_path / "run"
    p = _start(ARGS + ["--save_steps", "2"], out, held_env(tmp_path, "metrics.jsonl", nth=3))
    rank0 = _held(p)
    rank1 = _ranks(p)[1]
    rank1.kill()
    wait_for(lambda: not rank1.is_running() or rank1.status() == psutil.STATUS_ZOMBIE, p, "rank 1 gone")
    rank0.resume()  # its next collective finds the peer gone
    rc, log = _finish(p, out)
    assert rc == 1, log[-4000:]
    said = [line for line in log.splitlines() if "rank 1 was killed" in line]
    assert said == ["error: rank 1 was killed by signal 9 (SIGKILL); this rank stops too (the last checkpoint, "
                    "checkpoint-2, is intact)"], log[-4000:]
    assert "Traceback" not in log and "Connection reset" not in log and "exits with return code" not in log
    assert _latest(out) == "checkpoint-2" and _complete(out / "checkpoint-2")
    assert not (out / "checkpoint-4").exists() and not (out / "final").exists()
