"""Through the real command (one CPU rank, the tiny local checkpoint): TRL's epoch strategies, logging_first_step,
run_name and save_only_model, and the refused resume from a weights-only checkpoint.

The data makes 10 sequences and a step takes 4 (batch 1 x accumulation 4), so with num_train_epochs 2 the run
trains ceil(2 x 10 / 4) = 5 steps and the epochs end at steps 3 (rows 8-11 pass 10) and 5 (rows 16-19 pass 20).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S
from tests.tiny_checkpoint import write_checkpoint, write_documents
from tests.warm_ranks import run_bare

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return run_bare(args, timeout=JOB_TIMEOUT_S)  # `python launch/train.py ARGS`, forked (tests/warm_ranks.py)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategies")
    model = write_checkpoint(root / "model")
    docs = write_documents(root / "docs.jsonl", num_docs=20, words_per_doc=15, seed=3)
    evals = write_documents(root / "eval.jsonl", num_docs=6, words_per_doc=15, seed=4)
    out = root / "out"
    common = ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32",
              "--bf16", "false", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4",
              "--output_dir", str(out)]
    proc = _run(common + ["--num_train_epochs", "2", "--logging_strategy", "epoch", "--logging_first_step", "true",
                          "--save_strategy", "epoch", "--save_only_model", "true", "--eval_strategy", "epoch",
                          "--eval_dataset_name", str(evals), "--run_name", "first-try", "--report_to",
                          "tensorboard" if _has("tensorboard") else "none"])
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    resumed = _run(common + ["--num_train_epochs", "3", "--resume_from_checkpoint", "true"])
    return {"out": out, "proc": proc, "resumed": resumed}


def _has(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_epoch_strategies_and_logging_first_step(run):
    out = run["out"]
    assert json.loads((out / "config.json").read_text())["data"]["train"]["sequences"] == 10
    rows = _rows(out)
    assert [r["step"] for r in rows if "loss" in r] == [1, 3, 5]  # the first step, then each epoch end
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 5]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-5"]


def test_run_name_is_the_first_line_and_the_tensorboard_run(run):
    lines = [ln for ln in run["proc"].stdout.splitlines() if ln.startswith("[ulysses_trainer]")]
    assert lines[0] == "[ulysses_trainer] run first-try"
    if _has("tensorboard"):
        assert list((run["out"] / "runs" / "first-try").glob("events.out.tfevents.*"))


def test_save_only_model_writes_loadable_weights_without_optimizer_state(run):
    from transformers import AutoModelForCausalLM

    ckpt = run["out"] / "checkpoint-3"
    assert not (ckpt / "ds").exists() and (ckpt / "weights_only").is_file()
    assert not list(ckpt.rglob("*optim_states*"))
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model.config.num_hidden_layers == 2


def test_resume_from_a_weights_only_checkpoint_is_refused_with_the_reason(run):
    proc = run["resumed"]
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-2000:])
    assert "written with save_only_model true" in proc.stderr and "no optimizer or scheduler state" in proc.stderr
