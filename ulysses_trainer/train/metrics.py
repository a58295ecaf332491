"""Model FLOPs and memory readings for the log (metrics.jsonl's tflops_per_gpu and peak memory keys)."""

from __future__ import annotations

import resource
import statistics
import sys

import torch

from ..plan.inputs import ModelShape, matmul_params
from ..plan.step_time import MODELLED_FROM_S, format_seconds


def train_flops_per_sequence(config, seq_len: int) -> float:
    """Forward+backward model FLOPs for one sequence (3x forward), causal attention as half of full
    attention, recompute not counted."""
    shape = ModelShape.from_config(config)
    dense = 6.0 * matmul_params(shape) * seq_len
    # QK^T and PV: 2 matmuls x 2 FLOPs x L^2 x heads x d, halved for causal, x3 for fwd+bwd
    attn = 3 * 2 * 2 * seq_len**2 * shape.heads * shape.head_dim / 2 * shape.layers
    return dense + attn


def peak_gpu_mem_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def peak_host_mem_gb() -> float:
    """Peak resident set size of this process."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 2**20 if sys.platform != "darwin" else kb / 2**30


def steady_step_s(step_times: list[float]) -> float:
    """The step the plan predicts, from a run's step times: the median of the steps after the first.

    The first step also compiles and autotunes, and on a small model the second still warms up (the slowest of
    six in every run of benchmarks/results/gpu_tests/steps_0.6b/: 18.1 s against a steady 14.8 s for Qwen3-0.6B
    at 131,072 tokens; 0.5% over for Qwen3-4B): the median outvotes it from three steps after the first on."""
    return statistics.median(step_times[1:] or step_times)


def predicted_vs_measured(pred_s: float, pred_peak_gb: float, step_times: list[float], peak_gb: float) -> str:
    """The end-of-run line: the plan's step time and GPU peak next to what the run measured (steady_step_s);
    with fewer than three steps after the first it says that the figure may include the warm-up."""
    steady = step_times[1:] or step_times
    measured = steady_step_s(step_times)
    which = f"median of {len(steady)} step(s){' after the first' if len(step_times) > 1 else ''}"
    if len(steady) < 3:
        which += ", which may include the warm-up (3 or more show the steady step)"
    # under MODELLED_FROM_S the fixed per-step costs the model leaves out dominate: a ratio would mislead
    versus = (f"{(measured - pred_s) / pred_s:+.1%}, {which}" if pred_s >= MODELLED_FROM_S else
              f"{which}; no comparison under {MODELLED_FROM_S:g} s, where fixed per-step costs dominate")
    return (f"predicted vs measured: step {format_seconds(pred_s)} s vs {format_seconds(measured)} s "
            f"({versus}); peak GPU {pred_peak_gb:.1f} GiB vs {peak_gb:.1f} GiB allocated "
            f"({(peak_gb - pred_peak_gb) / pred_peak_gb:+.1%})")
