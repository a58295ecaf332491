"""One search over the settings that fit the GPU and host memory, with two goals. Torch-free.

The candidates (`Search.rungs`, `Search.tile_ladder`): checkpoint_every cheapest first (rebuilding a layer runs
its whole forward again), then the optimizer's placement (GPU before host), the MLP tiles, the fewest offloaded
layer inputs, the kept attention outputs; a lever the user fixed takes only its value. The fit test
(`Search.est`, `Search.fits`): GPU need and host RAM per host against the budgets; the closest miss is kept.

- `search_fits` then `Fits.fastest` (what the plan runs; plan/resolve.py decodes the levers and calls it): at
  the first checkpoint_every where anything fits and the next one, per placement the first tile count where
  anything fits (and, where that is the shape rule's, the fewer counts under it that fit), the settings with the
  shortest predicted step (the search is memory only; the step time chooses among what it found).
- `cheapest_autos` (the CPU run, no GPU budget): every auto at its cheapest value.
- `cheapest_fit` (memory only; plan/longest_fit.py bisects the length over it): the first settings that fit in
  the cost order: the smallest checkpoint_every, then Adam on the GPU, then the fewest offloaded inputs, then
  the fewest tiles for that count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..vocabulary.lever_settings import Levers  # the levers bound to a model (None: searched)
from ..vocabulary.names import GIB, default_mlp_tiles
from .inputs import ModelShape, Settings, Zero3Knobs, saved_layer_count
from .memory import estimate
from .memory_record import MemoryEstimate

EVERY_CHOICES = (1, 2, 3, 4, 6, 9, 12)  # checkpoint_every values the search tries, cheapest first
# offload is not charged in the step time, so a plan that ties on time takes more inputs to the host until the
# GPU need is under this share of the budget (where the host has room): the fewest that fit left 0.5% headroom
GPU_HEADROOM = 0.92
# past this share of the host's memory a plan leaves too little for the OS, the data workers and the page cache:
# the plan searches within it where a plan fits there (plan/resolve.py, with_headroom), the notes say when none does
HOST_HEADROOM = 0.95
MAX_TILES = 64  # beyond this a tile is a few thousand rows and the MLP term is negligible


def shortfall(e: MemoryEstimate, gpu_gb: float, host_gb: float) -> tuple[int, int]:
    """(bytes missing on the GPU, bytes missing on the host); (0, 0) when it fits."""
    return max(0, e.gpu_required - int(gpu_gb * GIB)), max(0, e.host_per_host - int(host_gb * GIB))


@dataclass(frozen=True)
class Rung:
    """One (checkpoint_every, optimizer placement) of the search and the offload it may take there."""

    every: int
    opt: bool
    saved: int  # layers that keep an input at this checkpoint_every
    offload: int | None  # the fixed offload count, None: searched
    knobs: Zero3Knobs  # the ZeRO-3 sizes with this placement (an added offload shrinks the sub-groups)

    def levers(self) -> dict[str, Any]:
        """The levers this rung sets (Settings.with_levers)."""
        return {"checkpoint_every": self.every, "optimizer_offload": self.opt}


def _at(base: Settings, r: Rung, **levers: Any) -> Settings:
    """`base` at rung `r` (its thinning, placement and that placement's ZeRO-3 sizes) with `levers` changed."""
    return replace(base.with_levers(**r.levers(), **levers), zero3=r.knobs)


@dataclass
class Search:
    """The candidates and the fit test of one search: the base settings, what the user fixed, the budgets
    (GiB per GPU, GiB per host), and the closest miss of all estimates seen."""

    shape: ModelShape
    base: Settings
    fixed: Levers
    gpu_gb: float
    host_gb: float
    knobs: dict[bool, Zero3Knobs]  # per optimizer placement
    closest: MemoryEstimate | None = None

    # ---------------------------------------------------------------- the candidates

    def rungs(self) -> Iterator[list[Rung]]:
        """Per checkpoint_every, cheapest first, the rungs of each placement to try there (GPU first)."""
        fixed, layers = self.fixed, self.shape.layers
        if not self.base.levers.gradient_checkpointing:
            everies = [1]
        else:
            everies = [fixed.checkpoint_every] if fixed.checkpoint_every is not None \
                else [c for c in EVERY_CHOICES if c <= layers]
        opts = [fixed.optimizer_offload] if fixed.optimizer_offload is not None else [False, True]
        if self.base.zero_stage != 3:
            opts = [False]  # no ZeRO, no ZeRO-Offload
        for every in everies:
            saved = saved_layer_count(self.shape, every)
            offload = fixed.offload_for(saved) if self.base.levers.gradient_checkpointing else 0
            if offload is not None and offload > saved and fixed.checkpoint_every is None and every > 1:
                continue  # a thinning the search tries keeps fewer inputs than the fixed offload asks for
            yield [Rung(every, opt, saved, offload, self.knobs[opt]) for opt in opts]

    def top_tiles(self) -> int:
        return max(1, min(MAX_TILES, self.base.local_tokens))

    def tiles_under(self, rule: int) -> list[int]:
        """The tile counts under the shape rule's `rule` worth timing where it fits (halving down to untiled; none
        where the user fixed the tiles): fewer tiles cost memory, not time, except where a block's measured rate
        falls with its tiles (a sparse block: families/qwen3_moe.experts_rate); `Fits.fastest` takes one only when
        the step time says faster."""
        return [] if self.fixed.tiled_mlp is not None else [rule >> k for k in range(1, rule.bit_length())]

    def tile_ladder(self, *, every_count: bool) -> list[int]:
        """The tile counts to try, ascending. every_count False: the shape rule (`default_mlp_tiles`), more only
        by powers of two (tiles are a memory lever; at 256K the tiled MLP measured no slower); True: each count."""
        if self.fixed.tiled_mlp is not None:
            return [self.fixed.tiled_mlp]
        top = self.top_tiles()
        if every_count:
            return list(range(1, top + 1))
        rule = default_mlp_tiles(self.base.local_tokens, self.shape.mlp_row_width)
        return sorted({min(rule, top)} | {t for t in (2, 4, 8, 16, 32, 64) if rule < t <= top})

    # ---------------------------------------------------------------- the fit test

    def est(self, r: Rung, **levers: Any) -> MemoryEstimate:
        """The estimate of the base settings at rung `r` with `levers` changed (kept when it is the closest miss so
        far)."""
        return self._seen(estimate(self.shape, _at(self.base, r, **levers)))

    def _seen(self, e: MemoryEstimate) -> MemoryEstimate:
        if self.closest is None or sum(shortfall(e, self.gpu_gb, self.host_gb)) < \
                sum(shortfall(self.closest, self.gpu_gb, self.host_gb)):
            self.closest = e
        return e

    def fits(self, e: MemoryEstimate) -> bool:
        return e.fits(self.gpu_gb, self.host_gb)

    def fewest_offloaded(self, r: Rung, **levers: Any) -> MemoryEstimate | None:
        """The estimate with the fewest offloaded inputs that fits (GPU memory falls and host memory grows
        with each one: the fewest that fit the GPU are the best chance for the host), or None."""
        if r.offload is not None:
            e = self.est(r, activation_offload=r.offload, **levers)
            return e if self.fits(e) else None
        lo, hi = 0, r.saved
        e_hi = self.est(r, activation_offload=hi, **levers)
        if e_hi.gpu_required > self.gpu_gb * GIB:
            return None
        while lo < hi:  # invariant: hi fits the GPU
            mid = (lo + hi) // 2
            e = self.est(r, activation_offload=mid, **levers)
            if e.gpu_required <= self.gpu_gb * GIB:
                hi, e_hi = mid, e
            else:
                lo = mid + 1
        return e_hi if self.fits(e_hi) else None

    def fewest_tiles(self, ladder: list[int], at_top: MemoryEstimate) -> MemoryEstimate:
        """The estimate with the fewest tiles of `ladder` (ascending) that fits, given `at_top` (its last) fits.
        Untiled is tried on its own; from 2 tiles on, memory only falls as tiles grow, so bisect."""
        if len(ladder) == 1:
            return at_top
        first = self._seen(estimate(self.shape, at_top.settings.with_levers(tiled_mlp=ladder[0])))
        if self.fits(first):
            return first
        lo, hi, best = 1, len(ladder) - 1, at_top  # ladder[lo] untested or failing, ladder[hi] fits
        while lo < hi:
            mid = (lo + hi) // 2
            e = self._seen(estimate(self.shape, at_top.settings.with_levers(tiled_mlp=ladder[mid])))
            if self.fits(e):
                hi, best = mid, e
            else:
                lo = mid + 1
        return best

    @staticmethod
    def most_kept(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
        """The largest k in [lo, hi] with ok(k), given ok(lo) (ok is monotone: more kept, more memory)."""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


# -------------------------------------------------------------------- goal 1: the fastest that fits


def _timed_candidates(sr: Search, r: Rung, tiles: int, keep_max: int) -> list[MemoryEstimate]:
    """The settings worth timing at one rung and tile count: the fewest offloaded inputs for no kept outputs
    plus as many kept outputs as fit without more offload, and the most kept outputs that fit with any offload
    (time is near linear in both, so the best lies at one of the ends)."""
    if sr.fixed.keep_attention_outputs is not None:
        e = sr.fewest_offloaded(r, keep_attention_outputs=sr.fixed.keep_attention_outputs, tiled_mlp=tiles)
        return [e] if e is not None else []
    base = sr.fewest_offloaded(r, keep_attention_outputs=0, tiled_mlp=tiles)
    if base is None:
        return []
    a0 = base.settings.levers.activation_offload
    k_lo = sr.most_kept(0, keep_max, lambda k: sr.fits(sr.est(r, activation_offload=a0, keep_attention_outputs=k,
                                                              tiled_mlp=tiles)))
    k_hi = sr.most_kept(k_lo, keep_max,
                        lambda k: sr.fewest_offloaded(r, keep_attention_outputs=k, tiled_mlp=tiles) is not None)
    out = [sr.est(r, activation_offload=a0, keep_attention_outputs=k_lo, tiled_mlp=tiles)]
    if k_hi > k_lo:
        out.append(sr.fewest_offloaded(r, keep_attention_outputs=k_hi, tiled_mlp=tiles))
    return out


@dataclass(frozen=True)
class Fits:
    """What one search found, memory only: per optimizer placement, the settings worth timing at the first
    checkpoint_every where anything fits (at the first tile count of the ladder where anything fits there), and
    the closest miss. The step time then chooses among them (`fastest`): the data's attention share moves the
    time, never the memory, so one search serves the plan with or without it."""

    found: dict[bool, list[MemoryEstimate]]  # per optimizer placement; empty: nothing fits
    closest: MemoryEstimate | None  # the closest miss of every estimate seen

    @property
    def fits(self) -> bool:
        return bool(self.found)

    def fastest(self, time_of: Callable[[Settings], float], attention_fraction: float
                ) -> tuple[MemoryEstimate, bool, dict[bool, tuple[float, MemoryEstimate]]]:
        """(the fastest estimate that fits, True) or (the closest miss, False); and the best per optimizer
        placement. Each estimate's settings take `attention_fraction` (what the step time reads of the data)."""

        def at(e: MemoryEstimate) -> MemoryEstimate:
            return replace(e, settings=replace(e.settings, attention_fraction=attention_fraction))

        if not self.found:
            assert self.closest is not None
            return at(self.closest), False, {}
        best: dict[bool, tuple[float, MemoryEstimate]] = {}
        for opt, found in self.found.items():
            for e in map(at, found):
                key = (time_of(e.settings), e.settings.levers.activation_offload)
                if opt not in best or key < (best[opt][0], best[opt][1].settings.levers.activation_offload):
                    best[opt] = (key[0], e)
        winner = min(best.values(), key=lambda te: (te[0], te[1].settings.levers.optimizer_offload))
        return winner[1], True, best


def search_fits(shape: ModelShape, base: Settings, fixed: Levers, keep_max: int, gpu_gb: float, host_gb: float,
                knobs: dict[bool, Zero3Knobs]) -> Fits:
    """The plan's one search (memory only; `Fits.fastest` times what it found).

    It stops after the checkpoint_every following the first where anything fits: rebuilding a layer mostly costs
    more than the kept attention outputs or the offload the freed memory buys, but not always (Qwen3.5-27B on 8
    H200s of a 560 GB node: every second layer's input, its cheap DeltaNet layers rebuilt, frees room to keep all
    64 attention outputs, 2.3% faster by the plan); and per placement at the first tile count of the ladder where
    anything fits."""
    sr = Search(shape, base, fixed, gpu_gb, host_gb, knobs)
    ladder = sr.tile_ladder(every_count=False)
    found: dict[bool, list[MemoryEstimate]] = {}
    fitted_before = False  # something fit at an earlier checkpoint_every: this one is the last timed
    for rungs in sr.rungs():
        for r in rungs:
            for tiles in ladder:
                here = _timed_candidates(sr, r, tiles, keep_max)
                if here:
                    if tiles == ladder[0]:  # the rule's count fits: fewer are timed after it (a tie keeps the rule)
                        here += [e for t in sr.tiles_under(tiles) for e in _timed_candidates(sr, r, t, keep_max)]
                    found.setdefault(r.opt, []).extend(here)
                    break
        if fitted_before:
            break
        fitted_before = bool(found)  # the next is timed too: a cheap rebuild (a DeltaNet layer's) may buy a faster step
    return Fits(found, sr.closest)


def with_headroom(shape: ModelShape, chosen: MemoryEstimate, gpu_gb: float, host_gb: float) -> MemoryEstimate:
    """`chosen` with the fewest more offloaded inputs that bring the GPU need under GPU_HEADROOM of the
    budget, or as many more as the host holds (within HOST_HEADROOM where `chosen` is): the same predicted step,
    less risk of running out."""
    s, saved = chosen.settings, saved_layer_count(shape, chosen.settings.levers.checkpoint_every)
    best = chosen
    for a in range(s.levers.activation_offload + 1, saved + 1):
        if best.gpu_required <= GPU_HEADROOM * gpu_gb * GIB:
            break
        e = estimate(shape, s.with_levers(activation_offload=a))
        roomy = host_gb is not None and best.fits(gpu_gb, host_gb * HOST_HEADROOM)
        if not e.fits(gpu_gb, host_gb * HOST_HEADROOM if roomy else host_gb):
            break  # never past the host's headroom for the GPU's, where the plan was under it
        best = e
    return best


def cheapest_autos(shape: ModelShape, base: Settings, fixed: Levers) -> MemoryEstimate:
    """The CPU run (no GPU budget): nothing is short of memory; the autos take their cheapest values."""
    every = fixed.checkpoint_every or 1
    tiles = fixed.tiled_mlp if fixed.tiled_mlp is not None else default_mlp_tiles(base.local_tokens,
                                                                                  shape.mlp_row_width)
    s = base.with_levers(checkpoint_every=every, tiled_mlp=tiles, optimizer_offload=bool(fixed.optimizer_offload),
                         activation_offload=fixed.offload_for(saved_layer_count(shape, every)) or 0,
                         keep_attention_outputs=fixed.keep_attention_outputs or 0)
    return estimate(shape, s)


# -------------------------------------------------------------------- goal 2: the cheapest that fits


def cheapest_fit(shape: ModelShape, base: Settings, fixed: Levers, gpu_gb: float, host_gb: float,
                 knobs: dict[bool, Zero3Knobs] | None = None) -> tuple[MemoryEstimate, bool]:
    """(the first estimate that fits in the cost order, True) or (the closest miss, False). Memory only; the
    ZeRO-3 sizes per placement are `knobs` (search_fits's; None: the base's for both), the kept attention
    outputs the base's.

    At each rung the fewest offloaded inputs are searched at the most tiles (GPU memory falls as tiles grow,
    host memory does not depend on them), then the fewest tiles for that count."""
    sr = Search(shape, base, replace(fixed, keep_attention_outputs=base.levers.keep_attention_outputs), gpu_gb, host_gb,
                knobs or {False: base.zero3, True: base.zero3})
    ladder = sr.tile_ladder(every_count=True)
    for rungs in sr.rungs():
        for r in rungs:
            at_top = sr.fewest_offloaded(r, tiled_mlp=ladder[-1])
            if at_top is not None:
                return sr.fewest_tiles(ladder, at_top), True
    return _closest_in_cost_order(sr, ladder[-1]), False


def _closest_in_cost_order(sr: Search, tiles: int) -> MemoryEstimate:
    """When nothing fits: of the settings at `tiles` along the cost order, each rung's offload counts from
    none up to the first where the host is short (more only need more host memory), the fewest bytes missing."""
    closest: MemoryEstimate | None = None
    for rungs in sr.rungs():
        for r in rungs:
            for k in [r.offload] if r.offload is not None else range(r.saved + 1):
                e = estimate(sr.shape, _at(sr.base, r, activation_offload=k, tiled_mlp=tiles))
                if closest is None or sum(shortfall(e, sr.gpu_gb, sr.host_gb)) < \
                        sum(shortfall(closest, sr.gpu_gb, sr.host_gb)):
                    closest = e
                if e.host_per_host > sr.host_gb * GIB:
                    break
    assert closest is not None
    return closest
