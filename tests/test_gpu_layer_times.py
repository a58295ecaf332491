"""`rehearse --layer_times` on a GPU (train/layer_times.py): the reference recipe's rank at 2 of its 36 layers
(Qwen3-8B, 1,048,576 tokens, sp=8: each layer's attention sees the whole sequence for 4 query heads over 1 KV
head), cuDNN pinned. The spans add up to the step within 2%, and each layer's forward holds its attention's
forward: at least the same kernel's forward timed alone on the same shape in this process (less a 10% allowance
for the two timings' spread). This checks the timer, not a speed: both times come from one card seconds apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import JOB_TIMEOUT_S, train_env

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "launch" / "recipes" / "reference_8gpu_1m.yaml"
LENGTH, SP, HEADS, KV_HEADS, HEAD_DIM = 1_048_576, 8, 32, 8, 128  # Qwen3-8B's heads; a rank has 4 over 1

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _attention_forward_s() -> float:
    """The trainer's cuDNN attention forward alone on one rank's shape after the all-to-all, median of 3."""
    from ulysses_trainer.attention.grouped import BACKENDS, grouped_attention

    g = torch.Generator("cuda").manual_seed(0)
    r = HEADS // SP
    q = torch.randn(1, LENGTH, r, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, LENGTH, 1, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = []
    with torch.no_grad():
        for _ in range(4):  # the first compiles / warms up
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            grouped_attention(q, k, v, HEAD_DIM ** -0.5, BACKENDS["cudnn"])
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1000.0)
    return sorted(times[1:])[1]


def test_layer_times_add_up_and_show_attention(tmp_path):
    out = tmp_path / "r.json"
    layers = 2
    init = json.dumps({"num_hidden_layers": layers,
                       "rope_parameters": {"rope_type": "yarn", "factor": 4, "rope_theta": 1000000.0}})
    cmd = [sys.executable, "-m", "ulysses_trainer", "rehearse", "--config", str(RECIPE), "--gpus", str(SP),
           "--host_memory_gb", "560", "--model_init_kwargs", init, "--attn_implementation", "sdpa",
           "--keep_attention_outputs", str(layers), "--activation_offload", "0", "--optimizer_offload", "false",
           "--bf16", "true", "--save_strategy", "no", "--steps", "2", "--warmup_length", "8192",
           "--layer_times", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    t = json.loads(out.read_text())["layer_times"]
    print(json.dumps(t))
    assert None not in t["forward_s"] + t["recompute_s"] + t["backward_s"][1:]
    assert abs(t["unaccounted_s"]) <= 0.02 * t["step_s"], t
    alone = _attention_forward_s()
    print(f"attention forward alone {alone:.3f} s; layer forwards {t['forward_s']}")
    assert min(t["forward_s"]) >= 0.9 * alone, (t["forward_s"], alone)
    # the recompute reuses the kept attention outputs (keep_attention_outputs = every layer): no attention in it
    assert max(t["recompute_s"]) < min(t["forward_s"]), t
    # the same spans on the host's clock: the host queues ahead, so none is negative and the step's is no longer
    host = t["host"]
    assert len(host["forward_s"]) == len(t["forward_s"]) and min(host["forward_s"]) >= 0, host
    assert 0 < host["step_s"] <= t["step_s"] * 1.02, (host["step_s"], t["step_s"])
