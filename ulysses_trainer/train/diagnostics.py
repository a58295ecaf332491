"""Diagnostics a run can write as PNG: loss along the sequence, and GPU memory over one step.

- Per-position loss: per-token NLL computed chunk by chunk (never the [L, V] logits), averaged in
  log-spaced position bins, with the unigram entropy of the sequence's own tokens as a reference
  line: a model that has learnt nothing beyond token frequencies sits on that line, and a model that
  uses long context falls further below it the further it reads.
- Memory timeline: torch's CUDA allocator history around one step, allocated bytes over time, with
  the peak marked. The curve is rebuilt from alloc / free events, so its peak equals what
  torch.cuda.max_memory_allocated reports for the same span.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..levers.chunked_loss import softcapped
from ..parallel.sharding import IGNORE_INDEX
from ..vocabulary.names import GIB

# --------------------------------------------------------------------------------------------
# Per-position loss


@torch.no_grad()
def per_token_losses(hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int = 256,
                     logits_scaling: float = 1.0, softcap: float | None = None) -> Tensor:
    """fp32 NLL of every position, NaN where the label is ignored; labels' shape.

    hidden [..., H] (the final-norm output), weight [V, H] (lm_head), labels [...] already shifted.
    Logits exist for `chunk` rows at a time, in the weight's dtype then fp32, as in the chunked loss (divided by
    logits_scaling, as the model's head does: Granite; then soft-capped where `softcap` is given: Gemma).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    h2d = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)  # [..., H] -> [N, H]
    y = labels.reshape(-1).to(hidden.device)  # [...] -> [N]
    out = torch.full((h2d.shape[0],), float("nan"), dtype=torch.float32, device=hidden.device)
    for s in range(0, h2d.shape[0], chunk):
        e = min(s + chunk, h2d.shape[0])
        logits = torch.mm(h2d[s:e], weight.t()).float()  # [c, V]
        if logits_scaling != 1.0:
            logits.div_(logits_scaling)
        logits = softcapped(logits, softcap)
        yc = y[s:e]
        valid = yc != IGNORE_INDEX
        tgt = logits.gather(1, torch.where(valid, yc, 0).unsqueeze(1)).squeeze(1)  # [c]
        nll = torch.logsumexp(logits, dim=-1) - tgt
        out[s:e] = torch.where(valid, nll, torch.full_like(nll, float("nan")))
    return out.view(labels.shape)


def unigram_entropy(tokens: Tensor) -> float:
    """Entropy (nats) of the token frequencies in `tokens`, ignoring IGNORE_INDEX."""
    t = tokens.reshape(-1)
    t = t[t != IGNORE_INDEX]
    if t.numel() == 0:
        return float("nan")
    _, counts = torch.unique(t, return_counts=True)
    p = counts.double() / counts.sum()
    return float(-(p * p.log()).sum())


@dataclass
class PositionBins:
    """Log-spaced position bins: [lo, hi) over 1-based positions, mean loss and valid count in each."""

    lo: list[int]
    hi: list[int]
    mean: list[float]
    count: list[int]

    @property
    def center(self) -> list[float]:
        """Geometric centre of each bin's positions (where it is drawn on the log axis)."""
        return [math.sqrt(a * (b - 1)) if b - 1 > a else float(a) for a, b in zip(self.lo, self.hi)]


def position_bins(losses: Tensor, num_bins: int = 32) -> PositionBins:
    """Mean of the non-NaN losses in log-spaced bins of 1-based position; bins with no valid loss
    are dropped. Edges are whole positions, so short sequences get fewer, unit-wide bins at the start."""
    x = losses.detach().reshape(-1).double().cpu()
    n = x.numel()
    if n == 0:
        return PositionBins([], [], [], [])
    raw = torch.logspace(0, math.log10(n + 1), num_bins + 1, dtype=torch.float64)
    edges = sorted({int(round(v)) for v in raw.tolist()} | {1, n + 1})
    lo, hi, mean, count = [], [], [], []
    for a, b in zip(edges[:-1], edges[1:]):
        seg = x[a - 1:b - 1]  # positions a .. b-1
        ok = ~torch.isnan(seg)
        k = int(ok.sum())
        if k:
            lo.append(a)
            hi.append(b)
            mean.append(float(seg[ok].mean()))
            count.append(k)
    return PositionBins(lo, hi, mean, count)


def plot_per_position_loss(losses: Tensor, path: str, targets: Tensor | None = None, num_bins: int = 32,
                           title: str | None = None, label: str = "model") -> PositionBins:
    """Write a PNG of binned mean loss vs position (log x), with the unigram-entropy line of `targets`
    (the sequence's label tokens; omitted when None). Returns the bins that were drawn."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    bins = position_bins(losses, num_bins)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(bins.center, bins.mean, marker="o", ms=3, lw=1.5, label=label)
    if targets is not None:
        h = unigram_entropy(targets)
        if math.isfinite(h):
            ax.axhline(h, color="grey", ls="--", lw=1, label=f"unigram entropy ({h:.2f} nats)")
    ax.set_xscale("log")
    ax.set_xlabel("position in sequence (tokens)")
    ax.set_ylabel("mean loss in bin (nats)")
    ax.set_title(title or f"Per-position loss, {losses.numel():,} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return bins


# --------------------------------------------------------------------------------------------
# GPU memory timeline


def allocated_curve(trace: Sequence[dict], end_allocated: int) -> tuple[list[float], list[int], bool]:
    """(times in s from the first event, allocated bytes before the first event and after each one,
    whether the times are real; without them the x values are event numbers).

    An allocation counts from its "alloc" event to its "free_requested" event (when torch's
    allocated-bytes statistic drops). The starting level is recovered from the level at the end, so a
    ring buffer that dropped early events still gives the right level for the events it kept.
    """
    deltas = []
    for ev in trace:
        if ev["action"] == "alloc":
            deltas.append(ev["size"])
        elif ev["action"] == "free_requested":
            deltas.append(-ev["size"])
        else:
            deltas.append(0)
    level = end_allocated - sum(deltas)
    has_time = bool(trace) and all("time_us" in ev for ev in trace)
    t0 = trace[0]["time_us"] if has_time else 0
    times, levels = [0.0], [level]
    for i, (ev, d) in enumerate(zip(trace, deltas)):
        level += d
        times.append((ev["time_us"] - t0) / 1e6 if has_time else float(i + 1))
        levels.append(level)
    return times, levels, has_time


@dataclass
class MemoryTimeline:
    """Filled when the `memory_timeline` block exits."""

    path: str
    times: list[float] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    peak_bytes: int = 0  # from the trace
    peak_time: float = 0.0
    torch_peak_bytes: int = 0  # torch.cuda.max_memory_allocated over the block
    start_bytes: int = 0
    truncated: bool = False  # the history ring buffer overflowed: early events are missing


def plot_memory_timeline(tl: MemoryTimeline, title: str | None = None, time_unit: str = "s") -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    ax.plot(tl.times, [b / GIB for b in tl.allocated], lw=1)
    ax.fill_between(tl.times, [b / GIB for b in tl.allocated], alpha=0.15)
    ax.plot([tl.peak_time], [tl.peak_bytes / GIB], "rv")
    ax.annotate(f"peak {tl.peak_bytes / GIB:.2f} GiB", (tl.peak_time, tl.peak_bytes / GIB),
                textcoords="offset points", xytext=(8, 6), color="red")
    ax.set_xlabel(f"time ({time_unit})" if time_unit == "s" else "allocator event")
    ax.set_ylabel("allocated GPU memory (GiB)")
    ax.set_ylim(bottom=0, top=tl.peak_bytes / GIB * 1.12 + 1e-9)
    ax.set_title(title or "GPU memory over one training step")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(tl.path)), exist_ok=True)
    fig.savefig(tl.path)
    plt.close(fig)


@contextlib.contextmanager
def memory_timeline(path: str, device: torch.device | int | None = None, max_entries: int = 2_000_000,
                    title: str | None = None, stacks: bool = False) -> Iterator[MemoryTimeline]:
    """Record the CUDA allocator's history over the block (one training step) and write a PNG of
    allocated memory over time with the peak annotated. `stacks=True` also keeps Python stacks per
    allocation (slower; for finding what holds the peak with torch.cuda.memory._snapshot)."""
    if not torch.cuda.is_available():
        raise RuntimeError("memory_timeline needs a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index or 0)
    tl = MemoryTimeline(path=path)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    tl.start_bytes = torch.cuda.memory_allocated(dev)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc" if stacks else None,
                                             stacks="python", max_entries=max_entries)
    try:
        yield tl
        torch.cuda.synchronize(dev)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][dev.index]
    tl.truncated = len(trace) >= max_entries
    tl.torch_peak_bytes = torch.cuda.max_memory_allocated(dev)
    times, levels, has_time = allocated_curve(trace, torch.cuda.memory_allocated(dev))
    tl.times, tl.allocated = times, levels
    i = max(range(len(levels)), key=levels.__getitem__)
    tl.peak_bytes, tl.peak_time = levels[i], times[i]
    plot_memory_timeline(tl, title, "s" if has_time else "event")
