"""A run directory through the trainer's rank entry (2 CPU ranks): the export is ready for generation, a second
run into it is refused untouched, a resume into a model of another size is refused before anything is
written, and overwrite_output_dir replaces the previous run instead of appending to it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, train_env
from tests.tiny_checkpoint import write_checkpoint, write_documents
from tests.warm_ranks import run_trainer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], ranks: int) -> subprocess.CompletedProcess:
    """2 ranks as the launcher starts them (forks of tests/warm_ranks.py's server), or the real script, 1 process."""
    if ranks == 2:
        return run_trainer(2, args, timeout=JOB_TIMEOUT_S)
    return subprocess.run([sys.executable, "launch/train.py", *args], cwd=ROOT, env=train_env(),
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_output_dir_reuse_resume_size_and_overwrite(tmp_path):
    model = write_checkpoint(tmp_path / "model")
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=40, words_per_doc=31)
    common = ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32",
              "--bf16", "false"]
    out = tmp_path / "run"
    first = _run(common + ["--max_steps", "3", "--save_steps", "2", "--output_dir", str(out)], 2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _steps(out) == [1, 2, 3]
    # the export generates with a KV cache (training ran without one)
    assert json.loads((out / "final" / "config.json").read_text())["use_cache"] is True
    assert json.loads((out / "final" / "generation_config.json").read_text())["use_cache"] is True
    # epoch: 40 documents of 32 tokens make 40 rows, 20 steps per pass (dp 1 x batch 1 ... sp 2 share a row)
    epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == pytest.approx([s / 40 for s in (1, 2, 3)], rel=0.15)
    before = _tree(out)

    again = _run(common + ["--max_steps", "2", "--output_dir", str(out)], 1)
    assert again.returncode == 2, again.stderr[-3000:]
    assert len(_errors(again)) == 1 and re.search(
        r"output_dir .*run holds a previous run \(checkpoint-2, checkpoint-3, config\.json, ds_config\.json, final, "
        r"\.\.\.\); "
        r"resume it with resume_from_checkpoint true, set overwrite_output_dir true", _errors(again)[0])
    assert _tree(out) == before

    bigger = write_checkpoint(tmp_path / "bigger", hidden_size=128, num_hidden_layers=3)
    elsewhere = tmp_path / "bigger_run"
    resumed = _run(["--model_name_or_path", str(bigger)] + common[2:] +
                   ["--resume_from_checkpoint", str(out / "checkpoint-2"), "--output_dir", str(elsewhere)], 1)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert len(_errors(resumed)) == 1 and re.search(
        r"checkpoint-2 holds a model of hidden 64, 2 layers, .* but this run builds hidden 128, 3 layers",
        _errors(resumed)[0])
    assert not elsewhere.exists()  # no config.json written first
    assert _tree(out) == before

    over = _run(common + ["--max_steps", "2", "--overwrite_output_dir", "true", "--output_dir", str(out)], 2)
    assert over.returncode == 0, over.stderr[-3000:]
    assert _steps(out) == [1, 2]  # the old rows are gone, not appended to
    assert not (out / "checkpoint-3").exists() and (out / "latest").read_text().strip() == "checkpoint-2"
