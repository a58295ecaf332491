"""One SP rank's training step without a DeepSpeed engine, as docs/library-api.md's loop runs it: parallelize,
shard_batch, the step's token count, the loss sum, backward of this rank's share, the global loss. The exactness
tests run it on ranks as threads (tests/threaded_ranks.py) and compare with a reference of their own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tests.threaded_ranks import run_threads

if TYPE_CHECKING:
    from ulysses_trainer import ParallelState, SequenceParallelCausalLM, Shard

# what the exactness tests parallelize with unless they say otherwise: the plain paths, sdpa on the CPU
LEVERS = dict(attn_implementation="sdpa", tiled_mlp=False, gradient_checkpointing=False)


@dataclass
class RankStep:
    """What one rank's step gave."""

    loss: float  # the step's token-weighted mean loss over every rank (the same on each)
    grads: dict[str, torch.Tensor]  # this rank's gradients, stock keys; the step's gradient is their sum over ranks
    count: int  # the step's valid tokens, every rank
    shard: Shard  # this rank's shard
    model: SequenceParallelCausalLM  # the model it ran


def parallelize_rank(model: nn.Module, world_size: int, **levers) -> tuple[SequenceParallelCausalLM, ParallelState]:
    """(the parallelized model, the ParallelState) of this rank: sp = world_size, LEVERS overridden by `levers`."""
    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize

    state = make_parallel_state(world_size)
    return parallelize(model, state, ParallelizeConfig(**{**LEVERS, **levers})), state


def rank_step(model: SequenceParallelCausalLM, state: ParallelState, ids: torch.Tensor,
              position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
              real_lengths: Sequence[int] | None = None, device: str | None = None) -> RankStep:
    """This rank's shard of the batch, its loss sum and backward of loss_sum / the step's tokens (replicated
    weights: the full gradient is the sum over ranks)."""
    from ulysses_trainer import global_loss, shard_batch, step_token_count

    shard = shard_batch(ids, position_ids=position_ids, labels=labels, sp_size=state.sp_size, sp_rank=state.sp_rank,
                        real_lengths=real_lengths)
    if device is not None:
        shard = shard.to(device)
    count = step_token_count(shard.num_valid, state)  # every rank's trained tokens
    local = model(**shard.model_inputs())  # this rank's sum of token losses
    (local / count).backward()
    grads = {n.removeprefix("causal_lm."): p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return RankStep(float(global_loss(local.detach(), count, state)), grads, int(count), shard, model)


def sp_steps(models: Sequence[nn.Module], ids: torch.Tensor, position_ids: torch.Tensor | None = None,
             labels: torch.Tensor | None = None, real_lengths: Sequence[int] | None = None,
             **levers) -> list[RankStep]:
    """One step on len(models) ranks as threads, rank r parallelizing models[r]: every rank's RankStep."""
    def one(rank: int, world_size: int) -> RankStep:
        model, state = parallelize_rank(models[rank], world_size, **levers)
        return rank_step(model, state, ids, position_ids, labels, real_lengths)

    return run_threads(len(models), one)


def summed_grads(steps: Sequence[RankStep]) -> dict[str, torch.Tensor]:
    """The step's gradient: every rank's, summed."""
    return {n: sum(s.grads[n] for s in steps) for n in steps[0].grads}



def trainer_path_matches(model_name: str, length: int,
                         model_init_kwargs: dict | None = None) -> SequenceParallelCausalLM:
    """The trainer's own model path on one process (model_config_for -> plan_for -> build_model -> parallelize with
    the plan's levers -> the loss sum over the shard's valid tokens, plus coef x the aux loss of a sparse model,
    whose stock loss adds it too) on one random row of `length` = the stock model built alike: loss and every
    gradient (fp32, 1e-5). `model_init_kwargs` reach the config as a user's do. Returns the parallelized model."""
    from ulysses_trainer import parallelize, shard_batch
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.ds_config import load_ds_config
    from ulysses_trainer.model.load import build_model, model_config_for
    from ulysses_trainer.parallel.state import single_process_state
    from ulysses_trainer.plan.resolve import plan_for
    from ulysses_trainer.plan.types import Machine

    cfg = TrainConfig(model_name_or_path=model_name, max_length=length, model_init_kwargs=model_init_kwargs)
    config = model_config_for(cfg)
    plan = plan_for(cfg, config, load_ds_config(cfg.deepspeed), Machine(gpus=1, gpu_memory_gb=None,
                                                                        host_memory_gb=64.0))
    ids = torch.randint(0, min(1000, config.vocab_size), (1, length), generator=torch.Generator().manual_seed(3))
    ref = build_model(config, torch.float32, seed=5)
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    sp_model = parallelize(build_model(config, torch.float32, seed=5), single_process_state(),
                           plan.model_setup(None, 1))
    shard = shard_batch(ids, sp_size=1, sp_rank=0)
    loss = sp_model(**shard.model_inputs()) / shard.num_valid
    if sp_model.aux_loss is not None:  # the load-balancing loss over the row (levers/sparse_moe.py)
        assert out.aux_loss is not None and abs(sp_model.aux_loss.item() - out.aux_loss.item()) <= 1e-6 * out.aux_loss
        loss = loss + sp_model.aux_loss_coef * sp_model.aux_loss
    loss.backward()
    assert abs(loss.item() - out.loss.item()) <= 1e-5 * abs(out.loss.item())
    grads = {n.removeprefix("causal_lm."): p.grad for n, p in sp_model.named_parameters()}
    for name, p in ref.named_parameters():
        assert (grads[name] - p.grad).norm() <= 1e-5 * p.grad.norm() + 1e-12, name
    return sp_model
