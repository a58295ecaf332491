"""dp × sp process groups, built once and passed explicitly.

Layout: ranks [i*sp, (i+1)*sp) form one SP group; ranks with the same sp_rank form one DP group.
world = dp * sp. Launchers number ranks node by node (the deepspeed launcher gives node n the ranks
[n*slots, (n+1)*slots)), so when sp divides the ranks per node every SP group (all-to-all in every
layer) lies inside one node and its fast links, and only DP's gradient reduction crosses nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError
from ..vocabulary.layout import Layout, resolve_layout


@dataclass(frozen=True)
class ParallelState:
    """Who I am in the dp × sp grid, and the groups to talk to. Groups are None when size is 1."""

    world_size: int
    rank: int
    sp_size: int
    sp_rank: int
    dp_size: int
    dp_rank: int
    sp_group: Any = None
    dp_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def group_ranks(world_size: int, sp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(SP groups, DP groups) as rank lists: SP groups are runs of consecutive ranks."""
    dp_size = world_size // sp_size
    sp_groups = [list(range(i * sp_size, (i + 1) * sp_size)) for i in range(dp_size)]
    dp_groups = [list(range(j, world_size, sp_size)) for j in range(sp_size)]
    return sp_groups, dp_groups


def ranks_per_node(default: int = 1) -> int:
    """Ranks on this node, from the launcher: LOCAL_SIZE (deepspeed) or LOCAL_WORLD_SIZE (torchrun); else
    `default` (no launcher: e.g. the whole world in one process group on this machine)."""
    return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or default)


def single_process_state() -> ParallelState:
    """The state of an unsharded run (no process group needed)."""
    return ParallelState(world_size=1, rank=0, sp_size=1, sp_rank=0, dp_size=1, dp_rank=0)


def make_parallel_state(layout: Layout | int | None = None) -> ParallelState:
    """Build the dp × sp groups. Every rank must call this, in the same order (new_group is collective).

    layout: the run's Layout (the trainer's, decided once by config.checks.validate_config), or an sp_size for a
    loop of your own (None: the world size, all ranks shard one sequence).
    """
    sp_size = layout.sp_size if isinstance(layout, Layout) else layout
    if not dist.is_available() or not dist.is_initialized():
        if sp_size not in (None, 1):
            raise ConfigError(f"sp_size={sp_size} needs torch.distributed; launch with `deepspeed --num_gpus "
                              f"{sp_size} ...` or set sp_size 1")
        return single_process_state()
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(layout, Layout):
        layout = resolve_layout(sp_size, world_size)
    assert layout.world_size == world_size, f"a layout of {layout.world_size} ranks in a process group of {world_size}"
    sp_size, dp_size = layout.sp_size, layout.dp_size
    sp_group = dp_group = None
    sp_ranks, dp_ranks = group_ranks(world_size, sp_size)
    for ranks in sp_ranks:  # consecutive ranks: inside a node when sp divides the ranks per node
        g = dist.new_group(ranks) if sp_size > 1 else None
        if rank in ranks:
            sp_group = g
    for ranks in dp_ranks:  # the same position inside each SP group: across nodes
        g = dist.new_group(ranks) if dp_size > 1 else None
        if rank in ranks:
            dp_group = g
    return ParallelState(world_size=world_size, rank=rank, sp_size=sp_size, sp_rank=rank % sp_size, dp_size=dp_size,
                         dp_rank=rank // sp_size, sp_group=sp_group, dp_group=dp_group)
