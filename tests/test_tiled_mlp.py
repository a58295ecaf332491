"""Tiled MLP against the untiled HF MLP: alone (CPU, fp32) and inside a DeepSpeed ZeRO-3 engine."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from tests.dist_utils import JOB_TIMEOUT_S, run_ranks, stock_zero3_step
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.levers.tiled_mlp import TiledMLP
from ulysses_trainer.parallel.sharding import mlp_output_unused
from ulysses_trainer.vocabulary.names import auto_num_tiles


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tiny_config(vocab_size: int = 1000) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=16)


def run_mlp(mlp: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    mlp.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = mlp(x)
    y.backward(grad_out)
    grads = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("num_tiles,shape", [(1, (2, 50)), (3, (2, 50)), (7, (2, 50)), (7, (1, 5))])
def test_tiled_matches_untiled(num_tiles, shape):
    torch.manual_seed(0)
    ref_mlp = Qwen3MLP(tiny_config())
    tiled = TiledMLP(copy.deepcopy(ref_mlp), num_tiles)  # (1, 5) with 7 tiles: two tiles are empty
    x = torch.randn(*shape, 64)
    grad_out = torch.randn(*shape, 64)
    y_ref, gx_ref, gw_ref = run_mlp(ref_mlp, x, grad_out)
    y, gx, gw = run_mlp(tiled, x, grad_out)
    assert y.shape == y_ref.shape and gx.shape == x.shape
    assert rel(y, y_ref) <= 1e-6
    assert rel(gx, gx_ref) <= 1e-6
    assert gw.keys() == gw_ref.keys() == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    for name in gw_ref:
        assert rel(gw[name], gw_ref[name]) <= 1e-6, name


def test_weight_grads_when_input_needs_none():
    torch.manual_seed(1)
    ref_mlp = Qwen3MLP(tiny_config())
    tiled = TiledMLP(copy.deepcopy(ref_mlp), 4)
    x = torch.randn(1, 30, 64)  # no requires_grad: the weights still need theirs
    ref_mlp(x).square().sum().backward()
    tiled(x).square().sum().backward()
    for (name, p), q in zip(ref_mlp.named_parameters(), tiled.parameters()):
        assert rel(q.grad, p.grad) <= 1e-6, name


def test_state_dict_keys_unchanged_and_bad_input():
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(tiny_config())
    keys = list(model.state_dict().keys())
    for layer in model.model.layers:
        layer.mlp = TiledMLP(layer.mlp, 3)
    assert list(model.state_dict().keys()) == keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys
    with pytest.raises(ConfigError, match="tiled_mlp: false"):
        TiledMLP(torch.nn.Linear(4, 4), 2)
    with pytest.raises(ConfigError, match="int >= 1"):
        TiledMLP(Qwen3MLP(tiny_config()), 0)


def test_auto_num_tiles():
    assert auto_num_tiles(131_072, 2560, 9728) == 16  # Qwen3-4B: ceil(4 * 9728 / 2560)
    assert auto_num_tiles(131_072, 5120, 25600) == 20  # Qwen3-32B
    assert auto_num_tiles(5, 2560, 9728) == 5  # never more tiles than rows
    assert auto_num_tiles(1, 64, 8) == 1


def _engine_grads(rank, world_size, tiled):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)  # the same initial weights on every rank and in both runs
    model = Qwen3ForCausalLM(tiny_config())
    if tiled:
        for layer in model.model.layers:
            layer.mlp = TiledMLP(layer.mlp, 3)
    g = torch.Generator().manual_seed(100 + rank)  # different data per rank
    # 2 rows on rank 1: with 3 tiles one of its tiles is empty and must still all-gather like rank 0's
    ids = torch.randint(0, 1000, (1, 37 if rank == 0 else 2), generator=g)
    loss, grads, engine = stock_zero3_step(model, world_size, ids)  # tiny parameters partitioned: each tile gathers
    engine.step()
    return loss, grads


def _tiled_vs_untiled(rank, world_size):
    return _engine_grads(rank, world_size, tiled=False), _engine_grads(rank, world_size, tiled=True)


@pytest.mark.slow
def test_tiled_matches_untiled_under_zero3():
    results = [[(loss, {n: torch.from_numpy(g) for n, g in grads.items()}) for loss, grads in rank_out]
               for rank_out in run_ranks(2, _tiled_vs_untiled, timeout=JOB_TIMEOUT_S)]
    for (loss_ref, grads_ref), (loss, grads) in results:
        assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
        assert grads.keys() == grads_ref.keys()
        mlp_names = [n for n in grads if ".mlp." in n]
        assert len(mlp_names) == 6  # 2 layers x (gate, up, down)
        for name in grads:  # the MLP weights, and everything upstream of them
            assert rel(grads[name], grads_ref[name]) <= 1e-5, name
    assert rel(results[0][1][1]["model.layers.0.mlp.up_proj.weight"],
               results[1][1][1]["model.layers.0.mlp.up_proj.weight"]) <= 1e-6  # reduced: same on both ranks


def _checkpointed_tiny(tiles, every, seed=5):
    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.model.load import build_model

    cfg = preset_config("tiny")
    cfg.num_hidden_layers, cfg.layer_types = 3, ["full_attention"] * 3
    return parallelize(build_model(cfg, torch.float32, seed=seed), make_parallel_state(1), ParallelizeConfig(
        attn_implementation="sdpa", tiled_mlp=tiles, checkpoint_every=every))


def _loss_and_grads(model, ids):
    from ulysses_trainer import shard_batch

    model.zero_grad(set_to_none=True)
    loss = model(**shard_batch(ids, sp_size=1, sp_rank=0).model_inputs())
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("every", [1, 3])  # 3: layers 1, 2 are rebuilt by forwards whose outputs are used
def test_recompute_skips_the_tiled_forward_and_changes_nothing(every):
    ids = torch.randint(0, 1000, (2, 37), generator=torch.Generator().manual_seed(3))
    ref_model = _checkpointed_tiny(3, every)
    ref_model.checkpointer.recompute_skips_mlp = False  # the recompute runs the tiles
    model = _checkpointed_tiny(3, every)
    calls = {"n": 0}
    for layer in model.causal_lm.model.layers:
        inner = layer.mlp.tile_forward

        def counted(x, inner=inner):
            calls["n"] += 1
            return inner(x)

        layer.mlp.tile_forward = counted
    ref_loss, ref_grads = _loss_and_grads(ref_model, ids)
    loss, grads = _loss_and_grads(model, ids)
    assert torch.equal(loss, ref_loss)
    for n, g in ref_grads.items():
        assert torch.equal(grads[n], g), n
    rebuilds = model.checkpointer.rebuild_forwards
    assert rebuilds == (2 if every == 3 else 0)  # layers 0 and 1 forward again to rebuild 1's and 2's inputs
    # forward 3 layers x 3 tiles, rebuilds 3 tiles each, backward 3 x 3; the recompute none
    assert calls["n"] == 9 + 3 * rebuilds + 9
    assert not mlp_output_unused()  # the scope is left as it was


def _sp2_tiled_vs_untiled(rank, world_size):
    from tests.dist_utils import tiny_zero3_sp_step
    from ulysses_trainer import ParallelizeConfig

    out = []
    for tiles in (False, 3):  # 3: the recompute skips the tiled forward; ZeRO-3 gathers in backward only
        loss, grads, model = tiny_zero3_sp_step(rank, world_size, ParallelizeConfig(
            attn_implementation="sdpa", tiled_mlp=tiles), layers=2, seq=45, small_buckets=True)
        out.append((loss, grads))
    return out


@pytest.mark.slow
def test_sp2_zero3_checkpointed_tiled_equals_untiled():
    from tests.test_offload import _assert_close

    for (ref_loss, ref_grads), (loss, grads) in run_ranks(2, _sp2_tiled_vs_untiled, timeout=JOB_TIMEOUT_S):
        _assert_close(torch.tensor(loss), {n: torch.from_numpy(g) for n, g in grads.items()},
                      torch.tensor(ref_loss), {n: torch.from_numpy(g) for n, g in ref_grads.items()}, tol=1e-5)
