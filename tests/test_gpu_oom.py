"""A real out-of-memory error on a GPU through the real command (docs/reliability.md): a small model at a
sequence length far too long for the device with every lever pinned to its most memory-hungry value and
allow_over_plan true (else the run is refused up front). One `error:` line, exit 1, no traceback, nothing saved.
Cheap: the run dies in the first forward, seconds after the engine is built."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, train_command, train_env

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_a_real_oom_is_one_line_and_exit_1(tmp_path):
    # qwen3-0.6b without checkpointing keeps every layer's activations: the plan needs ~371 GiB at 262,144 tokens;
    # YaRN takes the positions past the model's 40,960 (without it the run is refused for positions, exit 2)
    length = 262_144
    out = tmp_path / "run"
    yarn = '{"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}'
    args = ["--model_name_or_path", "qwen3-0.6b", "--max_length", str(length), "--max_steps", "1", "--bf16", "true",
            "--model_init_kwargs", yarn,
            "--gradient_checkpointing", "false", "--tiled_mlp", "false", "--optimizer_offload", "false",
            "--allow_over_plan", "true", "--save_strategy", "no", "--output_dir", str(out)]
    proc = subprocess.run(train_command(1, args), cwd=ROOT, env=train_env(), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert re.fullmatch(r"error: out of GPU memory at step 1 \([a-z ]+(, layer \d+)?\): the device had [\d.]+ GiB "
                        r"and torch had allocated up to [\d.]+ GiB; the plan predicted [\d.]+ GiB peak allocated .*; "
                        r"for a plan that fits run: ulysses-trainer plan --gpus 1 .*--max_length \d+ .*"
                        r"--allow_over_plan true.*", errors[0]), errors[0]
    for lever in ("--gradient_checkpointing", "--tiled_mlp", "--optimizer_offload"):
        assert lever not in errors[0]  # the pinned levers are left to the plan's search
    assert not list(out.glob("checkpoint-*")) and not (out / "final").exists()
