"""The longest sequence that fits at all (`plan` prints it next to the plan): the second goal of the one
search over the settings (plan/fit_search.py), memory only; the run's own settings are its first goal, the
fastest predicted step that fits (plan/resolve.py).

Cost order (cheapest first): nothing < GPU-resident levers (MLP tiles: recompute, no transfers) <
offload (checkpoint copies over PCIe, then optimizer states on the host) < fewer checkpoints
(checkpoint_every c: one more forward for c-1 of every c layers, up to a quarter more compute). So the
search takes the smallest c, then optimizer offload only when nothing fits without it, then the
fewest offloaded layers for which some tile count fits, with the fewest tiles for that count
(`fit_search.cheapest_fit`). Settings fixed by the user (an int or true/false rather than auto) are kept as given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..vocabulary.lever_settings import Levers
from .fit_search import cheapest_fit
from .inputs import ModelShape, Settings, Zero3Knobs
from .memory_record import MemoryEstimate


@dataclass(frozen=True)
class Hardware:
    """What the run gets: GPUs in all, per-GPU memory (GiB), host RAM per host (GiB)."""

    gpus: int
    gpu_memory_gb: float
    host_memory_gb: float
    gpus_per_node: int | None = None  # None: all GPUs on one host

    def check(self) -> None:
        if self.gpus < 1:
            raise ConfigError(f"--gpus must be >= 1, got {self.gpus}")
        if not self.gpu_memory_gb > 0 or not self.host_memory_gb > 0:
            raise ConfigError(f"--gpu_memory_gb and --host_memory_gb must be > 0, got {self.gpu_memory_gb} "
                              f"and {self.host_memory_gb}")
        if self.gpus_per_node is not None and (self.gpus_per_node < 1 or self.gpus % self.gpus_per_node):
            raise ConfigError(f"--gpus_per_node {self.gpus_per_node} must divide --gpus {self.gpus}")


@dataclass(frozen=True)
class Choice:
    """The chosen settings and their estimate; fits False when nothing in the search space fits."""

    settings: Settings
    estimate: MemoryEstimate
    fits: bool


def choose_settings(shape: ModelShape, base: Settings, hw: Hardware, *, activation_offload: int | None = None,
                    tiled_mlp: int | None = None, optimizer_offload: bool | None = None,
                    checkpoint_every: int | None = None, knobs: dict[bool, Zero3Knobs] | None = None) -> Choice:
    """The cheapest settings that fit, starting from `base` (layout, loss, kernel...): the cost order of
    plan/fit_search.cheapest_fit.

    activation_offload / tiled_mlp / optimizer_offload / checkpoint_every: None = search ("auto"), else
    fixed. knobs: the ZeRO-3 sizes per optimizer placement (Plan.zero.by_placement; None: the base's).
    When nothing fits, the returned Choice has fits=False and holds the settings that came closest (the
    fewest bytes missing).
    """
    hw.check()
    base = replace(base, gpus_per_node=hw.gpus_per_node or hw.gpus)
    fixed = Levers(gradient_checkpointing=base.levers.gradient_checkpointing, checkpoint_every=checkpoint_every,
                activation_offload=activation_offload, keep_attention_outputs=None, tiled_mlp=tiled_mlp,
                optimizer_offload=optimizer_offload)
    e, fits = cheapest_fit(shape, base, fixed, hw.gpu_memory_gb, hw.host_memory_gb, knobs)
    return Choice(e.settings, e, fits)


def largest_max_length(shape: ModelShape, base: Settings, hw: Hardware, *, unit: int | None = None,
                       activation_offload: int | None = None, tiled_mlp: int | None = None,
                       optimizer_offload: bool | None = None, checkpoint_every: int | None = None,
                       knobs: dict[bool, Zero3Knobs] | None = None, limit: int = 1 << 27
                       ) -> tuple[int, Choice | None]:
    """The longest max_length (a multiple of `unit`, default 1024 x sp) for which some settings fit,
    and those settings. (0, None) when not even one unit fits. Memory grows with the length, so the
    answer is found by doubling, then bisecting over multiples of the unit."""
    unit = unit or 1024 * base.sp_size
    if base.pad_to_multiple_of:
        unit = math.lcm(unit, base.pad_to_multiple_of)

    def at(n: int) -> Choice:
        return choose_settings(shape, replace(base, max_length=n * unit), hw, activation_offload=activation_offload,
                               tiled_mlp=tiled_mlp, optimizer_offload=optimizer_offload,
                               checkpoint_every=checkpoint_every, knobs=knobs)

    if not at(1).fits:
        return 0, None
    lo, hi = 1, 2
    while hi * unit <= limit and at(hi).fits:
        lo, hi = hi, hi * 2
    if hi * unit > limit:
        hi = limit // unit + 1
    while hi - lo > 1:  # invariant: lo fits, hi does not (or is past the limit)
        mid = (lo + hi) // 2
        if at(mid).fits:
            lo = mid
        else:
            hi = mid
    return lo * unit, at(lo)
