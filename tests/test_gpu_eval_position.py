"""The eval loss by position and the recall probe on a GPU, bf16, through the real command: Qwen3-0.6B stretched
with YaRN (factor auto: 131,072 / 40,960) on the synthetic data, one evaluation after two steps.

It checks what the CPU tests cannot: the buckets past the native window hold every position of a 131,072-token
row, the probe places facts at every distance up to it, and the plot is drawn with the native window marked.
The curves are printed (`pytest -s`) for the record; with the preset's random weights they sit near
ln(151,936) = 11.93 nats and recall nothing (a pretrained checkpoint: docs/evaluation.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.dist_utils import JOB_TIMEOUT_S, train_command, train_env

ROOT = Path(__file__).resolve().parent.parent
LENGTH = 131_072

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_qwen3_0_6b_yarn_131k_eval_by_position_and_recall(tmp_path):
    out = tmp_path / "run"
    cmd = train_command(1, ["--model_name_or_path", "qwen3-0.6b", "--max_length", str(LENGTH),
                            "--model_init_kwargs", '{"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}',
                            "--max_steps", "2", "--eval_steps", "2", "--eval_recall_probe", "true",
                            "--max_eval_samples", "1", "--save_strategy", "no", "--output_dir", str(out)])
    proc = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ev = next(r for r in rows if "eval_loss" in r)
    pos, recall = ev["eval_loss_by_position"], ev["eval_recall_by_distance"]
    for lo, hi, loss, n, acc, facts in zip(pos["edges"], pos["edges"][1:], pos["loss"], pos["tokens"],
                                           recall["accuracy"], recall["facts"]):
        print(f"[{lo:>6}, {hi:>6}): loss {loss:.4f} over {n:>6} tokens; recall {acc:.3f} of {facts} facts")
    assert pos["edges"][-1] == LENGTH and len(pos["edges"]) == 12  # 128 .. 65,536 doubling, then 131,072
    assert pos["tokens"] == [127] + [hi - lo for lo, hi in zip(pos["edges"][1:-1], pos["edges"][2:])]
    assert all(loss is not None and 0 < loss < 20 for loss in pos["loss"])
    assert all(f > 0 for f in recall["facts"])  # facts at every distance, past the native window too
    assert (out / "eval_loss_by_position.png").read_bytes()[:4] == b"\x89PNG"
