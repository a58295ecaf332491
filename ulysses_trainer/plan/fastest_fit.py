"""The search behind every `auto`: of the settings that fit the GPU and host memory, the one with the
shortest predicted step (checkpoint thinning, optimizer placement, MLP tiles, offloaded inputs, kept
attention outputs). Torch-free; plan/resolve.py checks the levers and calls it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from ..names import default_mlp_tiles
from .inputs import ModelShape, Settings, Zero3Knobs, local_tokens, saved_layer_count
from .memory import GIB, MemoryEstimate, estimate

EVERY_CHOICES = (1, 2, 3, 4, 6, 9, 12)  # checkpoint_every values the search tries, cheapest first
# offload is not charged in the step time, so a plan that ties on time takes more inputs to the host until the
# GPU need is under this share of the budget (where the host has room): the fewest that fit left 0.5% headroom
GPU_HEADROOM = 0.92
MAX_TILES = 64  # beyond this a tile is a few thousand rows and the MLP term is negligible


@dataclass(frozen=True)
class Fixed:
    """The levers the user fixed (None = auto, to be searched)."""

    offload: int | Literal["all"] | None  # offloaded layer inputs; "all": every layer that keeps one
    keep: int | None
    tiles: int | None
    every: int | None
    optimizer_offload: bool | None

    def offload_for(self, saved: int) -> int | None:
        """The fixed offload count where `saved` layers keep an input (None: auto)."""
        return saved if self.offload == "all" else self.offload


def shortfall(e: MemoryEstimate, gpu_gb: float, host_gb: float) -> tuple[int, int]:
    return max(0, e.gpu_required - int(gpu_gb * GIB)), max(0, e.host_per_host - int(host_gb * GIB))


@dataclass
class _Search:
    shape: ModelShape
    base: Settings
    gpu_gb: float
    host_gb: float
    knobs: dict[bool, Zero3Knobs]  # per optimizer placement (an added offload shrinks the sub-groups)
    closest: MemoryEstimate | None = None

    def est(self, **kw: Any) -> MemoryEstimate:
        e = estimate(self.shape, replace(self.base, **kw))
        if self.closest is None or sum(shortfall(e, self.gpu_gb, self.host_gb)) < \
                sum(shortfall(self.closest, self.gpu_gb, self.host_gb)):
            self.closest = e
        return e

    def fits(self, e: MemoryEstimate) -> bool:
        return e.fits(self.gpu_gb, self.host_gb)

    def fewest_offloaded(self, fixed: int | None, saved: int, **kw: Any) -> MemoryEstimate | None:
        """The estimate with the fewest offloaded inputs that fits (GPU memory falls and host memory grows
        with each one: the fewest that fit the GPU are the best chance for the host), or None."""
        if fixed is not None:
            e = self.est(activation_offload=fixed, **kw)
            return e if self.fits(e) else None
        lo, hi = 0, saved
        e_hi = self.est(activation_offload=hi, **kw)
        if e_hi.gpu_required > self.gpu_gb * GIB:
            return None
        while lo < hi:  # invariant: hi fits the GPU
            mid = (lo + hi) // 2
            e = self.est(activation_offload=mid, **kw)
            if e.gpu_required <= self.gpu_gb * GIB:
                hi, e_hi = mid, e
            else:
                lo = mid + 1
        return e_hi if self.fits(e_hi) else None

    def most_kept(self, lo: int, hi: int, ok) -> int:
        """The largest k in [lo, hi] with ok(k), given ok(lo) (ok is monotone: more kept, more memory)."""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


def _candidates(sr: _Search, fx: Fixed, keep_max: int, every: int, opt: bool, tiles: int) -> list[MemoryEstimate]:
    """The settings worth timing at one (checkpoint_every, optimizer placement, tiles): the fewest offloaded
    inputs for no kept outputs plus as many kept outputs as fit without more offload, and the most kept
    outputs that fit with any offload (time is near linear in both, so the best lies at one of the ends)."""
    saved = saved_layer_count(sr.shape, every)
    fixed = fx.offload_for(saved)
    if fixed is not None and fixed > saved:
        return []  # a thinning that keeps fewer inputs than the fixed offload asks for
    kw = {"checkpoint_every": every, "offload_optimizer": opt, "tiled_mlp": tiles, "zero3": sr.knobs[opt]}
    if fx.keep is not None:
        e = sr.fewest_offloaded(fixed, saved, kept_attention_layers=fx.keep, **kw)
        return [e] if e is not None else []
    base = sr.fewest_offloaded(fixed, saved, kept_attention_layers=0, **kw)
    if base is None:
        return []
    a0 = base.settings.activation_offload
    k_lo = sr.most_kept(0, keep_max, lambda k: sr.fits(sr.est(activation_offload=a0, kept_attention_layers=k, **kw)))
    k_hi = sr.most_kept(k_lo, keep_max, lambda k: sr.fewest_offloaded(fixed, saved, kept_attention_layers=k,
                                                                      **kw) is not None)
    out = [sr.est(activation_offload=a0, kept_attention_layers=k_lo, **kw)]
    if k_hi > k_lo:
        out.append(sr.fewest_offloaded(fixed, saved, kept_attention_layers=k_hi, **kw))
    return out


def search_fastest(shape: ModelShape, base: Settings, fx: Fixed, keep_max: int, gpu_gb: float, host_gb: float,
            knobs: dict[bool, Zero3Knobs], time_of) -> tuple[MemoryEstimate, bool, dict[bool, tuple]]:
    """(the fastest estimate that fits, True) or (the closest miss, False); and the best per optimizer placement.

    checkpoint_every is tried cheapest first and the search stops at the first value where anything fits:
    rebuilding a layer runs its whole forward again, which costs more than the kept attention output or the
    offload the freed memory could buy. Tiles: the shape rule (`default_mlp_tiles`), more only when that is
    what it takes to fit (they are a memory lever; at 256K the tiled MLP measured no slower)."""
    sr = _Search(shape, base, gpu_gb, host_gb, knobs)
    everies = [fx.every] if fx.every is not None else [c for c in EVERY_CHOICES if c <= shape.layers]
    opts = [fx.optimizer_offload] if fx.optimizer_offload is not None else [False, True]
    rule = default_mlp_tiles(local_tokens(base), shape.mlp_row_width)
    if fx.tiles is not None:
        ladder = [fx.tiles]
    else:
        top = max(1, min(MAX_TILES, local_tokens(base)))
        ladder = sorted({min(rule, top)} | {t for t in (2, 4, 8, 16, 32, 64) if rule < t <= top})
    best: dict[bool, tuple[float, MemoryEstimate]] = {}
    for every in everies:
        for opt in opts:
            for tiles in ladder:
                found = _candidates(sr, fx, keep_max, every, opt, tiles)
                for e in found:
                    key = (time_of(e.settings), e.settings.activation_offload)
                    if opt not in best or key < (best[opt][0], best[opt][1].settings.activation_offload):
                        best[opt] = (key[0], e)
                if found:
                    break
        if best:
            break
    if not best:
        assert sr.closest is not None
        return sr.closest, False, {}
    winner = min(best.values(), key=lambda te: (te[0], te[1].settings.offload_optimizer))
    return winner[1], True, best


def with_headroom(shape: ModelShape, chosen: MemoryEstimate, gpu_gb: float, host_gb: float) -> MemoryEstimate:
    """`chosen` with the fewest more offloaded inputs that bring the GPU need under GPU_HEADROOM of the
    budget, or as many more as the host holds: the same predicted step, less risk of running out."""
    s, saved = chosen.settings, saved_layer_count(shape, chosen.settings.checkpoint_every)
    best = chosen
    for a in range(s.activation_offload + 1, saved + 1):
        if best.gpu_required <= GPU_HEADROOM * gpu_gb * GIB:
            break
        e = estimate(shape, replace(s, activation_offload=a))
        if not e.fits(gpu_gb, host_gb):
            break
        best = e
    return best


