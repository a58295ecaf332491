"""One attention layer's kernel time on one rank (plan/step_time.py's attention terms): the measured rates by
kernel and length (plan/card_rates.py), scaled to head_dim 256 where measured there, a model with sinks at its own
measured points, a sliding-window layer as its block path runs it, and the fastest installed kernel for a shape.
Torch-free."""

from __future__ import annotations

import math

from .card_rates import H200, Rates
from .inputs import ModelShape, Settings


def attention_flops_forward(shape: ModelShape, s: Settings) -> float:
    """One layer's causal attention forward on one rank: 2 x L^2 x heads/sp x d per sequence (x the packed
    rows' attention_fraction: their documents' sum(l_i^2) / L^2)."""
    length = s.padded_length
    return 2.0 * s.micro_batch * length * length * (shape.heads // s.sp_size) * shape.head_dim * s.attention_fraction


def _interpolate(pts, length: int) -> tuple[float, float, bool]:
    """(forward, backward TFLOP/s, extrapolated?) at a length from (length, forward, backward) points,
    log-interpolated, held constant past them."""
    if length <= pts[0][0] or length >= pts[-1][0]:
        p = pts[0] if length <= pts[0][0] else pts[-1]
        return p[1], p[2], length != p[0]
    for (l0, f0, b0), (l1, f1, b1) in zip(pts, pts[1:]):
        if l0 <= length <= l1:
            w = (math.log(length) - math.log(l0)) / (math.log(l1) - math.log(l0))
            return f0 + w * (f1 - f0), b0 + w * (b1 - b0), False
    raise AssertionError("unreachable")


def _rate(kernel: str, length: int, r: Rates = H200) -> tuple[float, float, bool]:
    """(forward, backward TFLOP/s, extrapolated?) of a kernel at a length on r's card, log-interpolated."""
    return _interpolate(r.KERNEL_RATES[kernel], length)


def sinks_measured(shape: ModelShape, kernel: str, r: Rates) -> bool:
    """Whether this model's full layers are timed at the measured sink-attention rates (gpt-oss's sinks widen the
    head by a column: attention/kernels.sink_attention)."""
    return shape.family.attention_sinks and kernel in r.SINK_RATES


def _layer_rate(shape: ModelShape, kernel: str, length: int, r: Rates) -> tuple[float, float, bool]:
    """(forward, backward TFLOP/s, extrapolated?) of one full-attention layer's kernel for this model."""
    if sinks_measured(shape, kernel, r):
        return _interpolate(r.SINK_RATES[kernel], length)
    fwd, bwd, extra = _rate(kernel, length, r)
    scale = head_dim_scale(kernel, shape.head_dim, length, r)
    return fwd * scale, bwd * scale, extra


def head_dim_scale(kernel: str, head_dim: int, length: int, r: Rates = H200) -> float:
    """The kernel's measured forward+backward rate at head_dim 256 over its head-dim-128 points' at the same
    length (1.0 where no 256 rate is measured): the 128 points scaled by it give the 256 kernel's time."""
    if head_dim != 256 or kernel not in r.HD256_RATES:
        return 1.0
    pts = r.HD256_RATES[kernel]
    at = min(max(length, pts[0][0]), pts[-1][0])  # held constant past the measured lengths
    r256 = next(r0 + (math.log(at) - math.log(l0)) / (math.log(l1) - math.log(l0)) * (r1 - r0)
                for (l0, r0), (l1, r1) in zip(pts, pts[1:]) if l0 <= at <= l1)
    fwd, bwd, _ = _rate(kernel, at, r)
    return r256 / (3.5 / (1.0 / fwd + 2.5 / bwd))  # backward = 2.5 forwards of FLOPs


def attention_seconds(shape: ModelShape, s: Settings, r: Rates = H200) -> tuple[float, float, bool]:
    """(forward, backward seconds of one layer's kernel, extrapolated?); the stand-in costs nothing."""
    if s.attn_implementation not in r.KERNEL_RATES:
        return 0.0, 0.0, False
    fwd_tf, bwd_tf, extra = _layer_rate(shape, s.attn_implementation, s.padded_length, r)
    flops = attention_flops_forward(shape, s)
    return flops / (fwd_tf * 1e12), 2.5 * flops / (bwd_tf * 1e12), extra


def windowed_seconds(shape: ModelShape, s: Settings, r: Rates = H200) -> tuple[float, float, bool]:
    """(forward, backward seconds, measured at this window?) of one sliding-window layer's attention on one rank:
    attention/windowed.py's blocks, each window of queries against the 2 x window keys before its end (and the
    sink); FLOPs 4 x tokens x heads/sp x keys x width, backward 2.5x. At the block path's measured rate where its
    window was measured, else at the planned kernel's full-attention rate (larger blocks: an optimistic guess)."""
    sink = shape.family.attention_sinks
    width = -(-(shape.head_dim + 1) // 8) * 8 if sink else shape.head_dim
    keys = 2 * shape.sliding_window + int(sink)
    flops = 4.0 * s.micro_batch * s.padded_length * (shape.heads // s.sp_size) * keys * width
    window, fwd_tf, bwd_tf = r.WINDOW_BLOCK_TFLOPS
    measured = shape.sliding_window == window
    if not measured:
        fwd_tf, bwd_tf, _ = _layer_rate(shape, s.attn_implementation, s.padded_length, r)
    return flops / (fwd_tf * 1e12), 2.5 * flops / (bwd_tf * 1e12), measured


def fastest_attention(shape: ModelShape, length: int, sp_size: int, installed: tuple[str, ...],
                      r: Rates = H200) -> str | None:
    """Of the installed attention kernels with measured rates on r's card, the one whose forward + backward
    takes least at this length and head size (the first listed wins a tie: installed is fastest-first); None if
    none is measured."""
    timed = [k for k in installed if k in r.KERNEL_RATES]
    if not timed:
        return None

    def seconds(kernel: str) -> float:
        fwd, bwd, _ = _layer_rate(shape, kernel, length, r)
        return 1.0 / fwd + 2.5 / bwd  # per FLOP of forward, the backward 2.5 forwards
    return min(timed, key=seconds)
