"""checkpoint_every=k: only every k-th layer keeps its input; backward rebuilds the rest. Same results."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import JOB_TIMEOUT_S, run_ranks, tiny_zero3_sp_step
from tests.saved_tensors import saved_bytes
from tests.test_offload import (
    _assert_close,
    _backward_after_a_second_forward_raises,
    _loss_and_grads,
    _tiny_qwen3,
    _wire,
)
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.levers.host_pool import HostPool
from ulysses_trainer.levers.recompute import LayerRecompute
from ulysses_trainer.plan.inputs import ModelShape, Settings, forward_passes, layer_forward_passes

N = 5  # odd: the last block is short


@pytest.fixture(scope="module")
def tiny():
    model = _tiny_qwen3(N).train()
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(4))
    _wire(model, None)
    return model, ids, _loss_and_grads(model, ids)


def _rebuild_forwards(n: int, k: int) -> int:
    # each block [b, top] rebuilds the inputs of b+1..top once, running layers b..top-1
    return sum(min(b + k - 1, n - 1) - b for b in range(0, n, k))


@pytest.mark.parametrize("every, offload", [
    (2, []), (3, []), (5, []), (2, [0, 2, 4]), (3, [3]), (2, [0]),
])
def test_matches_no_checkpointing(tiny, every, offload):
    model, ids, (ref_loss, ref_grads) = tiny
    ckpt = LayerRecompute(N, offload, HostPool(host_memory_gb=1.0), checkpoint_every=every)
    _wire(model, ckpt)
    try:
        loss, grads = _loss_and_grads(model, ids)
    finally:
        _wire(model, None)
    assert ckpt.saved_layers == list(range(0, N, every))
    assert ckpt.forward_calls == [1] * N and ckpt.recompute_calls == [1] * N
    assert ckpt.rebuild_forwards == _rebuild_forwards(N, every)
    assert not ckpt._rebuilt and not ckpt._block_inputs and not ckpt._runs  # nothing outlives the backward
    _assert_close(loss, grads, ref_loss, ref_grads)


def test_rebuilt_layers_start_from_the_block_input(tiny):
    """Corrupting block start 2's host copy changes layer 3's gradients: layer 3's input was rebuilt from it."""
    model, ids, (_, ref_grads) = tiny
    ckpt = LayerRecompute(N, [0, 2, 4], HostPool(host_memory_gb=1.0), checkpoint_every=2)
    _wire(model, ckpt)
    try:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        ckpt.state(2).host.mul_(1.5)
        loss.backward()
    finally:
        _wire(model, None)
    for layer in (2, 3):
        g = model.model.layers[layer].mlp.down_proj.weight.grad
        ref = ref_grads[f"model.layers.{layer}.mlp.down_proj.weight"]
        assert (g - ref).norm() / ref.norm() > 1e-3, layer


def test_second_forward_before_backward_raises(tiny):
    model, ids, _ = tiny
    ckpt = LayerRecompute(N, [], checkpoint_every=2)
    _wire(model, ckpt)
    try:
        _backward_after_a_second_forward_raises(model, ids, "ran forward again before its backward")
    finally:
        _wire(model, None)


def test_only_block_starts_offload():
    with pytest.raises(ConfigError, match=r"offload layers \[1\] keep no input with checkpoint_every=2"):
        LayerRecompute(4, [0, 1], checkpoint_every=2)
    with pytest.raises(ConfigError, match="checkpoint_every must be an int >= 1"):
        LayerRecompute(4, [], checkpoint_every=0)


def _sp2_step(rank, world_size, every: int, offload):
    from ulysses_trainer import ParallelizeConfig

    loss, grads, model = tiny_zero3_sp_step(rank, world_size, ParallelizeConfig(
        attn_implementation="sdpa", tiled_mlp=2, checkpoint_every=every, activation_offload=offload),
        layers=3, seq=43, small_buckets=True)
    ck = model.checkpointer
    return loss, grads, (ck.offload_layers, ck.rebuild_forwards, ck.recompute_calls)


def _sp2_runs(rank, world_size):
    return [_sp2_step(rank, world_size, every, offload) for every, offload in ((1, False), (2, True), (3, 1))]


@pytest.mark.slow
def test_sp2_zero3_every_2_and_3_with_offload_equal_every_layer():
    for (ref_loss, ref_grads, _), *others in run_ranks(2, _sp2_runs, timeout=JOB_TIMEOUT_S):
        assert [o[2] for o in others] == [([0, 2], 1, [1, 1, 1]), ([0], 2, [1, 1, 1])]
        for loss, grads, _ in others:
            _assert_close(torch.tensor(loss), {n: torch.from_numpy(g) for n, g in grads.items()},
                          torch.tensor(ref_loss), {n: torch.from_numpy(g) for n, g in ref_grads.items()})


def _saved_bytes(model, ids) -> int:
    """Bytes autograd keeps during a forward (parameters excluded); the backward then runs."""
    loss, n = saved_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
    loss.backward()
    return n


def test_keeps_one_layer_input_in_k():
    model = _tiny_qwen3(6).train()
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(5))
    held = {}
    for every in (1, 3):
        ckpt = LayerRecompute(6, [], checkpoint_every=every)
        _wire(model, ckpt)
        try:
            held[every] = _saved_bytes(model, ids)
        finally:
            _wire(model, None)
    assert held[1] - held[3] == (6 - 2) * 2 * 21 * 64 * 4  # 4 fewer [b, s, h] fp32 layer inputs


@pytest.mark.parametrize("every", [2, 3, 5])
def test_each_layer_runs_the_forwards_the_plan_counts(tiny, every):
    """The planner's per-layer forward count (plan/inputs.layer_forward_passes: a block's top is not rebuilt)
    is what the recompute runs: hooks count each layer's attention forwards through a real backward."""
    model, ids, _ = tiny
    counts = [0] * N
    hooks = [layer.self_attn.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
             for i, layer in enumerate(model.model.layers)]
    ckpt = LayerRecompute(N, [], HostPool(host_memory_gb=1.0), checkpoint_every=every)
    _wire(model, ckpt)
    try:
        _loss_and_grads(model, ids)
    finally:
        _wire(model, None)
        for h in hooks:
            h.remove()
    shape = ModelShape.from_config(model.config)
    s = Settings(max_length=ids.shape[1]).with_levers(gradient_checkpointing=True, checkpoint_every=every)
    assert counts == [layer_forward_passes(shape, s, i) for i in range(N)]
    assert sum(counts) / N == pytest.approx(forward_passes(shape, s))  # the dense terms' average agrees
