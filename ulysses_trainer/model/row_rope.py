"""RoPE whose frequencies depend on the longest position of the forward (LongRoPE: Phi-3's long or short factors;
dynamic NTK scaling), decided on the whole row under SP.

transformers' rotary embedding picks them from max(position_ids) + 1 of the call (modeling_rope_utils'
dynamic_rope_update). Under Ulysses each rank calls it on its own L/sp shard, so ranks holding only early positions
would pick the short factors while the others pick the long ones: not what one process's forward of the row
computes. RowForward runs transformers' own update with the row's longest real position (this shard's, its pads left
out, then the maximum over the SP group), then the embedding's forward without the update on this rank's positions.
It is the embedding's own `forward` (an instance attribute, which unparallelize removes: model/undo.py), so the
module, its buffers and their names stay as they were (verify_sp copies them by name).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..parallel.comm import all_reduce
from ..parallel.sharding import shard_in_scope
from ..parallel.state import ParallelState


def _longest_dependent(rotary: nn.Module) -> bool:
    """Whether this rotary embedding's frequencies depend on the longest position of the call."""
    rope_type = getattr(rotary, "rope_type", None)
    return isinstance(rope_type, str) and (rope_type == "longrope" or "dynamic" in rope_type)


class RowForward:
    """A transformers rotary embedding's forward under SP: frequencies from the row's longest real position over the
    SP group, cos/sin for this rank's positions."""

    def __init__(self, rotary: nn.Module, state: ParallelState):
        update = type(rotary).forward  # transformers' forward, decorated with its frequency update
        plain = getattr(update, "__wrapped__", None)  # the forward itself (functools.wraps)
        if plain is None:
            raise ConfigError(f"{type(rotary).__name__} ({rotary.rope_type} RoPE) has no undecorated forward to run "
                              f"after the row's frequency update; use a rope_type that does not depend on the "
                              f"sequence length")
        self.rotary, self.state = rotary, state
        self._update, self._plain = update, plain

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        pos = position_ids
        shard = shard_in_scope()
        if shard is not None and shard.has_pads and tuple(pos.shape) == tuple(shard.position_ids.shape):
            # pads continue the last document's positions: leave them out, as the row without them has none
            real = torch.arange(pos.shape[1], device=pos.device)[None, :] < \
                torch.tensor(shard.real_rows, device=pos.device)[:, None]  # [b, s]
            pos = torch.where(real, pos, 0)
        top = pos.max().reshape(1)  # this shard's longest real position
        if self.state.sp_size > 1:
            top = all_reduce(top, "max", self.state.sp_group).to(pos.device)  # the row's, over every rank
        with torch.no_grad():
            self._update(self.rotary, x, top.view(1, 1), *args, **kwargs)  # transformers' choice, on the row
        return self._plain(self.rotary, x, position_ids, *args, **kwargs)


def chooses_by_longest(model: nn.Module) -> bool:
    """Whether some rotary embedding of `model` picks its frequencies by the longest position of the forward: its
    stock forward of a packed row then differs from its forwards of the row's documents one at a time."""
    return any(_longest_dependent(m) for m in model.modules())


def use_row_rope(model: nn.Module, state: ParallelState) -> int:
    """Give every rotary embedding of `model` whose frequencies depend on the longest position its RowForward;
    returns how many."""
    targets = [m for m in model.modules() if _longest_dependent(m) and "forward" not in m.__dict__]
    for m in targets:
        m.forward = RowForward(m, state)
    return len(targets)
