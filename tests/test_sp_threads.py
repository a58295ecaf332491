"""sp=2 in the fast tier: two ranks as threads (tests/threaded_ranks.py) run the Ulysses all-to-alls for real;
loss and gradients equal the unsharded plain-HF reference of tests/test_sp_exact.py (fp32, CPU)."""

import pytest
import torch

from tests.test_sp_exact import build_model, make_batch, reference
from tests.threaded_ranks import run_threads


def _rank(models, ids, pos, rank, world_size):
    from ulysses_trainer import (
        ParallelizeConfig,
        global_loss,
        make_parallel_state,
        parallelize,
        shard_batch,
        step_token_count,
    )

    state = make_parallel_state(world_size)
    model = parallelize(models[rank], state, ParallelizeConfig(attn_implementation="sdpa", loss_chunk_size=7,
                                                               tiled_mlp=False, gradient_checkpointing=False))
    shard = shard_batch(ids, position_ids=pos, sp_size=state.sp_size, sp_rank=state.sp_rank)
    count = step_token_count(shard.num_valid, state)  # every rank's trained tokens
    local = model(**shard.model_inputs())  # this rank's sum of token losses
    (local / count).backward()  # replicated weights: the full gradient is the sum over ranks
    grads = {n.removeprefix("causal_lm."): p.grad.detach().clone() for n, p in model.named_parameters()}
    return float(global_loss(local.detach(), count, state)), grads


@pytest.mark.parametrize("kv_heads, docs", [(2, None), (1, [9, 14, 6])])  # kv 1: each KV head copied to both ranks
def test_sp2_threads_equal_the_unsharded_reference(kv_heads, docs):
    ids, pos = make_batch(2, 29, docs, seed=3)  # odd length: one pad on the last shard
    ref_loss, ref_grads = reference(ids, pos, kv_heads)
    models = [build_model(kv_heads) for _ in range(2)]  # built here: the seed is process-wide
    out = run_threads(2, lambda rank, world_size: _rank(models, ids, pos, rank, world_size))
    for loss, _ in out:
        assert abs(loss - ref_loss) / abs(ref_loss) <= 1e-5
    for name, ref in ref_grads.items():
        got = sum(grads[name] for _, grads in out)
        assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) <= 1e-5, name
