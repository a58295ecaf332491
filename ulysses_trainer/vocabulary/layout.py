"""The run's layout: world = dp x sp, and the head-count rule. Decided once here (torch-free) for the config's
checks, the plan, the trainer's preparation, the process groups and the Ulysses attention.

Rules: sp divides the world (dp = world / sp); sp divides the model's query heads (each rank attends to
heads / sp of them); sp divides the KV heads or is a multiple of them (then each KV head is copied sp / kv
times before the all-to-all, parallel/ulysses.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """world ranks in dp groups of sp consecutive ranks."""

    world_size: int
    sp_size: int

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size


def padded_length(length: int, sp_size: int, pad_to_multiple_of: int | None = None) -> int:
    """Smallest length >= `length` that both sp and pad_to_multiple_of divide (what a sequence is padded to)."""
    m = math.lcm(sp_size, pad_to_multiple_of or 1)
    return -(-length // m) * m


def kv_repeat(sp_size: int, num_kv_heads: int) -> int:
    """How many times each KV head is copied before the all-to-all: past the KV heads, each rank needs one whole
    (parallel/ulysses.py does it, plan/ counts it)."""
    return max(1, sp_size // num_kv_heads)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_heads(sp_size: int, num_heads: int, num_kv_heads: int | None = None, divides: tuple[int, ...] = ()) -> None:
    """ConfigError (naming sp values that work) unless sp splits the model's query and KV heads, and divides each
    of `divides` (a linear-attention mixer's key and value heads: Qwen3.5's Gated DeltaNet)."""
    ok = [d for d in _divisors(num_heads) if (num_kv_heads is None or num_kv_heads % d == 0 or d % num_kv_heads == 0)
          and all(n % d == 0 for n in divides)]
    bad = [n for n in divides if n % sp_size]
    if bad:
        raise ConfigError(f"sp_size={sp_size} does not divide the model's {bad[0]} linear-attention (Gated DeltaNet) "
                          f"heads, which are split over the SP group; sp_size values that work for this model: {ok}")
    if num_heads % sp_size != 0:
        raise ConfigError(f"sp_size={sp_size} does not divide the model's {num_heads} query heads; "
                          f"sp_size values that work for this model: {ok}")
    if num_kv_heads is not None and num_kv_heads % sp_size != 0 and sp_size % num_kv_heads != 0:
        raise ConfigError(f"sp_size={sp_size} neither divides nor is a multiple of the model's {num_kv_heads} KV "
                          f"heads; sp_size values that work for this model: {ok}")


def resolve_layout(sp_size: int | None, world_size: int, num_heads: int | None = None,
                   num_kv_heads: int | None = None) -> Layout:
    """The layout for `sp_size` (None: the whole world, dp = 1) on `world` ranks; ConfigError naming sizes that
    work. With the model's head counts, the head rule is checked too."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    sp_size = world_size if sp_size is None else sp_size
    if sp_size < 1:
        raise ConfigError(f"sp_size must be >= 1, got {sp_size}")
    if world_size % sp_size != 0:
        raise ConfigError(f"sp_size={sp_size} does not divide the world size {world_size}; use one of "
                          f"{_divisors(world_size)} (world_size = dp x sp_size) or launch "
                          f"{sp_size * max(1, world_size // sp_size)} ranks")
    if num_heads is not None:
        check_heads(sp_size, num_heads, num_kv_heads)
    return Layout(world_size, sp_size)
