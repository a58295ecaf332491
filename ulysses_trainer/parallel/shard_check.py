"""The wrapper's check that each SP rank holds its own L/sp slice of every row (tokens per rank x sp = the row):
handed the whole row on every rank, Ulysses attention would silently attend over sp copies of it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .sharding import ShardContext
from .state import ParallelState

_FIX = "each SP rank takes its L/sp slice of every row, the labels shifted before slicing (shard_batch does both)"


def check_shard(state: ParallelState, input_ids: torch.Tensor, context: ShardContext,
                default_positions: bool = False) -> None:
    """ValueError unless tokens per rank x sp is the row. `context.seq_len` (the padded row length L, which
    shard_batch sets): checked on the host with the slice's start (this rank's), no collective. Without it, one
    all-gather over the SP group of each rank's token count and row 0's first and last position: the ranks must
    hold as many tokens, and each rank's positions continue the previous rank's (one document per row; packed
    rows: cu_seqlens, which spans the whole [b x L] batch, must end at b x L). `default_positions` (the wrapper
    made them: they continue by construction): every rank holding the very same tokens is the whole row given to
    each."""
    b, s = input_ids.shape
    sp_size = state.sp_size
    position_ids, cu_seqlens, seq_len = context.position_ids, context.cu_seqlens, context.seq_len
    if position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)} but input_ids {tuple(input_ids.shape)}; "
                         f"give one position per token of this rank's shard")
    if seq_len is not None:
        if s * sp_size != seq_len:
            raise ValueError(f"this rank holds {s} tokens per row, and {s} x sp_size {sp_size} = {s * sp_size} is "
                             f"not the row's {seq_len} tokens: {_FIX}")
        if context.start != state.sp_rank * s:  # a shard cut for another rank: ranks would repeat a slice
            raise ValueError(f"SP rank {state.sp_rank} holds the slice of the row starting at token {context.start}, "
                             f"which is SP rank {context.start // s}'s: {_FIX}")
        return
    if sp_size == 1:
        return
    # a fingerprint of the tokens: sum of id x (index + 1), exact in int64 for any vocabulary and length here
    weights = torch.arange(1, b * s + 1, device=input_ids.device, dtype=torch.int64).view(b, s)
    tokens = (input_ids.long() * weights).sum()
    mine = torch.stack([torch.tensor(s, device=input_ids.device), position_ids[0, 0].long(),
                        position_ids[0, -1].long(), tokens])  # [4]
    every = [torch.empty_like(mine) for _ in range(sp_size)]
    dist.all_gather(every, mine, group=state.sp_group)
    rows = [t.tolist() for t in every]  # [sp] x (tokens per row, first position, last position, fingerprint)
    counts = [r[0] for r in rows]
    if len(set(counts)) > 1:
        raise ValueError(f"the SP ranks hold {counts} tokens per row; they must hold as many: {_FIX}")
    if default_positions and len({r[3] for r in rows}) == 1:
        raise ValueError(f"every SP rank holds the same {s} tokens per row, so tokens per rank x sp is not the row: "
                         f"{_FIX}")
    if cu_seqlens is not None:
        total = int(cu_seqlens[-1])
        if total != b * s * sp_size:
            raise ValueError(f"cu_seqlens spans {total} tokens but {b} rows x {s} tokens per rank x sp {sp_size} = "
                             f"{b * s * sp_size}: {_FIX}")
        return
    for r in range(1, sp_size):
        if rows[r][1] != rows[r - 1][2] + 1:
            raise ValueError(
                f"SP rank {r}'s tokens do not continue rank {r - 1}'s (row 0's position_ids start at {rows[r][1]} "
                f"after {rows[r - 1][2]}), so tokens per rank x sp is not the row: {_FIX}. Packed rows need "
                f"cu_seqlens (shard_batch's ShardContext holds it)")
