"""The per-position loss plot of a trained model, computed sharded exactly like training."""

from __future__ import annotations

import deepspeed
import torch

from ..model.parallelize import SequenceParallelCausalLM
from ..parallel.comm import gather_sequence
from ..parallel.sharding import Shard
from ..parallel.state import ParallelState
from .diagnostics import per_token_losses, plot_per_position_loss


def write_per_position_loss(engine, model: SequenceParallelCausalLM, shard: Shard, state: ParallelState,
                            chunk: int, length: int, path: str, title: str) -> None:
    """Collective: every rank runs the forward (Ulysses all-to-all, ZeRO-3 gathers) and the gather;
    rank 0 writes the PNG. Only the first row of the shard is plotted."""
    lm = model.causal_lm
    engine.eval()
    with torch.no_grad():
        hidden = model.final_hidden(shard.input_ids, shard.context)  # [b, s/sp, H]
        with deepspeed.zero.GatheredParameters([lm.lm_head.weight]):  # the full weight, one chunk of logits at a time
            losses = per_token_losses(hidden[:1], lm.lm_head.weight, shard.labels[:1], chunk,  # [1, s/sp]
                                      lm.lm_head.logits_scaling, lm.lm_head.softcap)  # the loss head's (Granite, Gemma)
    engine.train()
    full = gather_sequence(losses[0], state.sp_size, state.sp_group)  # [s/sp] -> [s]
    targets = gather_sequence(shard.labels[0], state.sp_size, state.sp_group)
    if state.is_main:
        plot_per_position_loss(full[:length].cpu(), path, targets=targets[:length].cpu(), title=title)
