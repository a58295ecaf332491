"""Model FLOPs and memory readings for the log (metrics.jsonl's tflops_per_gpu, mfu and peak memory keys).

The model FLOPs of a row are those of its real documents l_1..l_k (its pads left out: the kernels skip them,
parallel/sharding.py): 6 x matmul parameters x sum(l_i) (forward + backward, 2 + 4 FLOPs a weight a token) plus
6 x sum(l_i^2) x heads x head_dim x attention layers (QK^T and PV, 2 FLOPs each, causal as half of full, x3 for
forward + backward) plus, for a hybrid (Qwen3.5's Gated DeltaNet layers, linear in l), 18 x sum(l_i) x value heads x
key dim x value dim x DeltaNet layers (a token's state read-out, delta and rank-1 update, 2 x dk x dv FLOPs each, x3);
recompute not counted. tflops_per_gpu = the step's FLOPs / step seconds / GPUs; mfu = that / the
device's dense bf16 peak (DEVICE_PEAK_TFLOPS; None where the device is not in the table, e.g. a CPU run).""" 

from __future__ import annotations

import resource
import statistics
import sys

import numpy as np
import torch

from ..plan.attention_share import row_costs
from ..plan.counts import matmul_params
from ..plan.inputs import ModelShape
from ..plan.step_time import MODELLED_FROM_S, format_seconds

# dense (no sparsity) bf16 tensor-core peaks in TFLOP/s per GPU, from the vendors' datasheets; matched against
# torch.cuda.get_device_name, the first entry found in it wins (the more specific names first)
DEVICE_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4), ("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.5), ("H100", 989.4), ("H800", 989.4),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.05), ("A10G", 70.0),
)


def model_flops(shape: ModelShape, tokens: float, sum_sq: float) -> float:
    """Forward+backward model FLOPs of documents of sum(l_i) = tokens and sum(l_i^2) = sum_sq (the module
    docstring's formula)."""
    dense = 6.0 * matmul_params(shape) * tokens
    mixers = len(shape.mixer_layers)  # Gated DeltaNet layers run no l^2 attention
    # QK^T and PV: 2 matmuls x 2 FLOPs x l^2 x heads x d, halved for causal, x3 for fwd+bwd
    attn = 3 * 2 * 2 * sum_sq * shape.heads * shape.head_dim / 2 * (shape.layers - mixers)
    # the recurrence per token and value head: read-out q.S, delta S.k, update k (x) v: 3 x 2 x dk x dv, x3 fwd+bwd
    recurrence = 3 * 3 * 2 * tokens * shape.linear_v_heads * shape.linear_k_dim * shape.linear_v_dim * mixers
    return dense + attn + recurrence


def train_flops_per_sequence(config, seq_len: int) -> float:
    """Forward+backward model FLOPs for one document of seq_len tokens (3x forward), causal attention as half of
    full attention, recompute not counted."""
    return model_flops(ModelShape.from_config(config), float(seq_len), float(seq_len) ** 2)


def row_model_flops(shape: ModelShape, ds) -> np.ndarray:
    """Model FLOPs of each row of a data/sequences.SequenceDataset: its real documents only."""
    tokens, squares = row_costs(ds)
    return model_flops(shape, tokens, squares)


def device_peak_tflops(device: torch.device | str) -> tuple[float, str] | None:
    """(dense bf16 peak TFLOP/s, the device's name) of a CUDA device in DEVICE_PEAK_TFLOPS; None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next(((peak, name) for key, peak in DEVICE_PEAK_TFLOPS if key in name), None)


def throughput(flops: float, seconds: float, gpus: int, peak: tuple[float, str] | None) -> dict[str, float | None]:
    """metrics.jsonl's tflops_per_gpu and mfu for a step of `flops` model FLOPs."""
    per_gpu = flops / seconds / gpus / 1e12
    return {"tflops_per_gpu": per_gpu, "mfu": per_gpu / peak[0] if peak is not None else None}


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
