"""The longest sequence that fits at all, by a memory-only search (`plan` prints it next to the plan).
The run's own settings are decided by plan/resolve.py: the fastest predicted step that fits.

Cost order (cheapest first): nothing < GPU-resident levers (MLP tiles: recompute, no transfers) <
offload (checkpoint copies over PCIe, then optimizer states on the host) < fewer checkpoints
(checkpoint_every c: one more forward for c-1 of every c layers, up to a quarter more compute). So the
search takes the smallest c, then optimizer offload only when nothing fits without it, then the
fewest offloaded layers for which some tile count fits, with the fewest tiles for that count.
Settings fixed by the user (an int or true/false rather than auto) are kept as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import ConfigError
from .fastest_fit import EVERY_CHOICES, MAX_TILES
from .memory import MemoryEstimate, ModelShape, Settings, estimate, local_tokens, saved_layer_count


@dataclass(frozen=True)
class Hardware:
    """What the run gets: GPUs in all, per-GPU memory (GiB), host RAM per host (GiB)."""

    gpus: int
    gpu_memory_gb: float
    host_memory_gb: float
    gpus_per_host: int | None = None  # None: all GPUs on one host

    def check(self) -> None:
        if self.gpus < 1:
            raise ConfigError(f"--gpus must be >= 1, got {self.gpus}")
        if not self.gpu_memory_gb > 0 or not self.host_memory_gb > 0:
            raise ConfigError(f"--gpu_memory_gb and --host_memory_gb must be > 0, got {self.gpu_memory_gb} "
                              f"and {self.host_memory_gb}")
        if self.gpus_per_host is not None and (self.gpus_per_host < 1 or self.gpus % self.gpus_per_host):
            raise ConfigError(f"--gpus_per_host {self.gpus_per_host} must divide --gpus {self.gpus}")


@dataclass(frozen=True)
class Choice:
    """The chosen settings and their estimate; fits False when nothing in the search space fits."""

    settings: Settings
    estimate: MemoryEstimate
    fits: bool


def _tile_candidates(shape: ModelShape, s: Settings) -> list[int]:
    return list(range(1, max(1, min(MAX_TILES, local_tokens(s))) + 1))


def _fits(e: MemoryEstimate, hw: Hardware) -> bool:
    return e.fits(hw.gpu_memory_gb, hw.host_memory_gb)


def _shortfall(e: MemoryEstimate, hw: Hardware) -> int:
    """Bytes missing on the GPU plus bytes missing on the host (0 when it fits)."""
    return (max(0, e.gpu_required - int(hw.gpu_memory_gb * 2**30))
            + max(0, e.host_per_host - int(hw.host_memory_gb * 2**30)))


def _fewest_tiles(shape: ModelShape, s: Settings, hw: Hardware, choices: list[int]) -> MemoryEstimate | None:
    """The estimate with the fewest tiles that fits (choices ascending, the last one known to fit).
    Untiled is tried on its own; from 2 tiles on, memory only falls as tiles grow, so bisect."""
    if len(choices) == 1:
        return None
    first = estimate(shape, replace(s, tiled_mlp=choices[0]))
    if _fits(first, hw):
        return first
    lo, hi = 1, len(choices) - 1  # choices[lo] untested or failing, choices[hi] fits
    best = None
    while lo < hi:
        mid = (lo + hi) // 2
        e = estimate(shape, replace(s, tiled_mlp=choices[mid]))
        if _fits(e, hw):
            hi, best = mid, e
        else:
            lo = mid + 1
    return best if best is not None and best.settings.tiled_mlp == choices[hi] else \
        estimate(shape, replace(s, tiled_mlp=choices[hi]))


def choose_settings(shape: ModelShape, base: Settings, hw: Hardware, *, offload_layers: int | None = None,
                    tiles: int | None = None, offload_optimizer: bool | None = None,
                    every: int | None = None) -> Choice:
    """The cheapest settings that fit, starting from `base` (layout, loss, kernel...).

    offload_layers / tiles / offload_optimizer / every (checkpoint_every): None = search ("auto"), else
    fixed. When nothing fits, the returned Choice has fits=False and holds the settings that came
    closest (the fewest bytes missing).
    """
    hw.check()
    base = replace(base, gpus_per_host=hw.gpus_per_host or hw.gpus)
    opt_choices = [False, True] if offload_optimizer is None else [offload_optimizer]
    if base.zero_stage != 3:
        opt_choices = [False]
    every_choices = [c for c in EVERY_CHOICES if c <= shape.layers] if every is None else [every]
    if not base.gradient_checkpointing:
        every_choices = [1]
    tile_choices = _tile_candidates(shape, base) if tiles is None else [tiles]
    last: Choice | None = None
    for c in every_choices:
        saved = saved_layer_count(shape, c)
        if offload_layers is not None and offload_layers > saved and every is None and c > 1:
            continue  # a thinning the search tries keeps fewer inputs than the fixed offload asks for
        layer_choices = list(range(saved + 1)) if offload_layers is None else [offload_layers]
        if not base.gradient_checkpointing:
            layer_choices = [0]
        for opt in opt_choices:
            for k in layer_choices:
                s0 = replace(base, offload_optimizer=opt, activation_offload=k, checkpoint_every=c)
                # GPU memory falls as tiles grow; host memory does not depend on them: test the most tiles first
                most = estimate(shape, replace(s0, tiled_mlp=tile_choices[-1]))
                if last is None or _shortfall(most, hw) < _shortfall(last.estimate, hw):
                    last = Choice(most.settings, most, False)  # the closest miss so far
                if not _fits(most, hw):
                    if most.host_per_host > hw.host_memory_gb * 2**30:
                        break  # more offloaded layers only need more host memory
                    continue
                e = _fewest_tiles(shape, s0, hw, tile_choices) or most
                return Choice(e.settings, e, True)
    assert last is not None
    return last


def largest_max_length(shape: ModelShape, base: Settings, hw: Hardware, *, unit: int | None = None,
                       offload_layers: int | None = None, tiles: int | None = None,
                       offload_optimizer: bool | None = None, every: int | None = None,
                       limit: int = 1 << 27) -> tuple[int, Choice | None]:
    """The longest max_length (a multiple of `unit`, default 1024 x sp) for which some settings fit,
    and those settings. (0, None) when not even one unit fits. Memory grows with the length, so the
    answer is found by doubling, then bisecting over multiples of the unit."""
    unit = unit or 1024 * base.sp
    if base.pad_to_multiple_of:
        unit = math.lcm(unit, base.pad_to_multiple_of)

    def at(n: int) -> Choice:
        return choose_settings(shape, replace(base, max_length=n * unit), hw, offload_layers=offload_layers,
                               tiles=tiles, offload_optimizer=offload_optimizer, every=every)

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
