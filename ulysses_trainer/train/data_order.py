"""Which rows each optimizer step trains on, and one micro-batch's rows as this rank's shard.

Deterministic in (seed, step): every rank computes the same order without a collective, and a resumed run
lands on the same data."""

from __future__ import annotations

import torch

from ..parallel.sharding import Shard, shard_batch
from ..parallel.state import ParallelState
from .prepare import RunPlan


def epoch_order(plan: RunPlan, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(plan.cfg.seed + epoch)
    return torch.randperm(len(plan.train_data), generator=g)


def step_rows(plan: RunPlan, step: int) -> torch.Tensor:
    """Row indices of optimizer step `step`, all dp ranks and micro-steps (the same on every rank)."""
    epoch, j = divmod(step, plan.steps_per_epoch)
    return epoch_order(plan, epoch)[j * plan.sequences_per_step:(j + 1) * plan.sequences_per_step]


def step_real_tokens(plan: RunPlan, step: int) -> int:
    """Non-pad tokens of every sequence in step `step` (every rank holds the whole dataset: no collective)."""
    real = getattr(plan.train_data, "real_tokens", None)
    rows = step_rows(plan, step)
    return sum(real(int(i)) for i in rows) if real else len(rows) * plan.cfg.max_length


def micro_batch_rows(plan: RunPlan, dp_rank: int, step: int) -> list[list[dict]]:
    """This dp rank's rows of each micro-step of optimizer step `step`."""
    micro = plan.cfg.per_device_train_batch_size
    order = step_rows(plan, step)
    out = []
    for m in range(plan.cfg.gradient_accumulation_steps):
        start = (m * plan.dp_size + dp_rank) * micro
        out.append([plan.train_data[int(i)] for i in order[start:start + micro]])
    return out


def shard_rows(rows: list[dict], plan: RunPlan, state: ParallelState, device: torch.device) -> Shard:
    """Rows stacked into a micro-batch and cut to this rank's sequence shard, on `device`."""
    ids = torch.stack([r["input_ids"] for r in rows])  # [micro, L]
    pos = torch.stack([r["position_ids"] for r in rows])
    pad = getattr(plan.tokenizer, "pad_token_id", None) or 0
    # rows with labels (masked conversations, a padded last sequence) mask what is not trained; the others
    # train on every token
    labels = torch.stack([r.get("labels", r["input_ids"]) for r in rows]) if any("labels" in r for r in rows) \
        else None
    # a row shorter than max_length (one conversation per row, the padded last sequence): its pads stay out of
    # the router statistics, as transformers' attention mask keeps them out
    real = [int(r.get("real_tokens", ids.shape[1])) for r in rows]
    return shard_batch(ids, position_ids=pos, labels=labels, sp_size=state.sp_size,
                       sp_rank=state.sp_rank, pad_to_multiple_of=plan.cfg.pad_to_multiple_of,
                       pad_token_id=pad, real_lengths=real).to(device)
