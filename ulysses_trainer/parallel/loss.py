"""Loss normalisation over the whole optimizer step.

The step minimises sum(token losses) / (valid tokens in the step), over every dp rank, sp shard and
accumulation micro-step; a rank or micro-step without valid tokens adds 0, never NaN. Each rank
knows only its own sums, so the count is all-reduced first.
"""

from __future__ import annotations

import torch

from .comm import all_reduce_sum
from .state import ParallelState


def step_token_count(local_valid_tokens: int, state: ParallelState) -> int:
    """Valid tokens in the optimizer step over all ranks: pass this rank's count summed over its
    micro-steps. A collective: every rank calls it once per step."""
    t = torch.tensor([local_valid_tokens], dtype=torch.float64)
    return int(all_reduce_sum(t).item())


def loss_for_backward(loss_sum: torch.Tensor, step_tokens: int, state: ParallelState) -> torch.Tensor:
    """What to hand to `engine.backward(..., scale_wrt_gas=False)` for one micro-step.

    DeepSpeed (given no mpu) averages gradients over all world ranks; multiplying by the world size
    turns that average into the sum the true loss needs. A step with no valid token gives 0, not NaN.
    """
    return loss_sum * (state.world_size / max(step_tokens, 1))


def global_loss(local_loss_sum: float, step_tokens: int, state: ParallelState) -> float:
    """The logged loss: token-weighted mean over the step on all ranks (collective)."""
    t = all_reduce_sum(torch.tensor([local_loss_sum], dtype=torch.float64))
    return float(t.item()) / max(step_tokens, 1)
