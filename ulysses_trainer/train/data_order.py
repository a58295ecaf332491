"""Which rows each optimizer step trains on, and one micro-batch's rows as this rank's shard.

The order is TRL's sampler: every epoch is a seeded permutation of the whole dataset, and the epochs follow one
another as one stream that the steps cut into `sequences_per_step` rows (a step may straddle two epochs, so no
row of an epoch is left out). It depends on (seed, dataset) only, never on max_steps, which only says where the
run stops: a run extended on resume continues the same order. Every rank computes it without a collective."""

from __future__ import annotations

import torch

from ..data.order import epoch_permutation, stream_rows
from ..parallel.sharding import Shard, shard_batch
from ..parallel.state import ParallelState
from .prepare import PreparedRun


def epoch_order(prepared: PreparedRun, epoch: int) -> torch.Tensor:
    """Row indices of one pass over the dataset."""
    return epoch_permutation(prepared.cfg.seed, len(prepared.train_data), epoch)


def step_rows(prepared: PreparedRun, step: int) -> torch.Tensor:
    """Row indices of optimizer step `step`, all dp ranks and micro-steps (the same on every rank)."""
    per_step = prepared.sequences_per_step
    return stream_rows(prepared.cfg.seed, len(prepared.train_data), step * per_step, (step + 1) * per_step)


def epoch_of(prepared: PreparedRun, steps: int) -> float:
    """Passes over the dataset after `steps` optimizer steps (TRL's `epoch`)."""
    return steps * prepared.sequences_per_step / len(prepared.train_data)


def step_real_tokens(prepared: PreparedRun, step: int) -> int:
    """Non-pad tokens of every sequence in step `step` (every rank holds the whole dataset: no collective)."""
    real = getattr(prepared.train_data, "real_tokens", None)
    rows = step_rows(prepared, step)
    return sum(real(int(i)) for i in rows) if real else len(rows) * prepared.cfg.max_length


def micro_batch_rows(prepared: PreparedRun, dp_rank: int, step: int) -> list[list[dict]]:
    """This dp rank's rows of each micro-step of optimizer step `step`."""
    micro = prepared.cfg.per_device_train_batch_size
    order = step_rows(prepared, step)
    out = []
    for m in range(prepared.cfg.gradient_accumulation_steps):
        start = (m * prepared.dp_size + dp_rank) * micro
        out.append([prepared.train_data[int(i)] for i in order[start:start + micro]])
    return out


def shard_rows(rows: list[dict], prepared: PreparedRun, state: ParallelState, device: torch.device) -> Shard:
    """Rows stacked into a micro-batch and cut to this rank's sequence shard, on `device`."""
    ids = torch.stack([r["input_ids"] for r in rows])  # [micro, L]
    pos = torch.stack([r["position_ids"] for r in rows])
    pad = getattr(prepared.tokenizer, "pad_token_id", None) or 0
    # rows with labels (masked conversations, a padded last sequence) mask what is not trained; the others
    # train on every token
    labels = torch.stack([r.get("labels", r["input_ids"]) for r in rows]) if any("labels" in r for r in rows) \
        else None
    # a row shorter than max_length (one conversation per row, the padded last sequence): its pads stay out of
    # the router statistics, as transformers' attention mask keeps them out
    real = [int(r.get("real_tokens", ids.shape[1])) for r in rows]
    return shard_batch(ids, position_ids=pos, labels=labels, sp_size=state.sp_size,
                       sp_rank=state.sp_rank, pad_to_multiple_of=prepared.cfg.pad_to_multiple_of,
                       pad_token_id=pad, real_lengths=real).to(device)
