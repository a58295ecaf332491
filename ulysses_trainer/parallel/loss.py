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


def aux_for_backward(aux_loss: torch.Tensor, coef: float, accumulation: int) -> torch.Tensor:
    """A sparse model's load-balancing term to add to loss_for_backward's, for one micro-step.

    The step minimises mean(token losses) + coef x (aux averaged over dp ranks and micro-steps), as TRL adds
    coef x aux to each forward's loss. Each SP rank holds the same aux (its statistics are sums over the SP
    group, whose backward sums the grads over the group: sp x); DeepSpeed averages over all world = sp x dp
    ranks. So each rank adds coef / accumulation x aux: (1 / (sp dp)) x sum over dp of sp x coef / acc x grad.
    """
    return aux_loss * (coef / max(accumulation, 1))


def global_aux_loss(local_aux_sum: float, micro_steps: int, state: ParallelState) -> float:
    """The logged aux_loss: mean over dp ranks and micro-steps (SP ranks hold the same value; collective)."""
    t = all_reduce_sum(torch.tensor([local_aux_sum], dtype=torch.float64))
    return float(t.item()) / (state.world_size * max(micro_steps, 1))
