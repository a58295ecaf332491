"""Qwen3-MoE (tiny-moe, CPU, fp32): ours against a plain transformers Qwen3MoeForCausalLM, the router's
load-balancing loss included, and each lever changing memory, not results."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from tests.dist_utils import JOB_TIMEOUT_S
from ulysses_trainer import ParallelizeConfig, parallelize, shard_batch
from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.levers.sparse_moe import SparseMoE
from ulysses_trainer.model.load import build_model
from ulysses_trainer.parallel.state import single_process_state


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tiny_moe(seed: int = 3) -> torch.nn.Module:
    cfg = preset_config("tiny-moe")
    cfg.output_router_logits = True
    model = build_model(cfg, torch.float32, seed=seed)
    with torch.no_grad():  # transformers initialises the router to zeros: give it something to route with
        g = torch.Generator().manual_seed(seed)
        for layer in model.model.layers:
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g) * 0.5)
    return model


def batch(seed: int = 7, b: int = 2, length: int = 36) -> torch.Tensor:
    return torch.randint(0, 1000, (b, length), generator=torch.Generator().manual_seed(seed))


def hf_reference(model: torch.nn.Module, ids: torch.Tensor):
    """transformers' own loss: mean token NLL + router_aux_loss_coef x aux (load_balancing_loss_func)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    return out.loss.detach(), out.aux_loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def ours(model: torch.nn.Module, ids: torch.Tensor, **levers):
    """parallelize + one forward/backward, the objective as the trainer forms it (one rank, one micro-step)."""
    sp_model = parallelize(model, single_process_state(), ParallelizeConfig(attn_implementation="sdpa", **levers))
    sp_model.zero_grad(set_to_none=True)
    shard = shard_batch(ids, sp_size=1, sp_rank=0)
    loss_sum = sp_model(**shard.model_inputs())
    objective = loss_sum / shard.num_valid + sp_model.aux_loss_coef * sp_model.aux_loss
    objective.backward()
    grads = {n.removeprefix("causal_lm."): p.grad.clone() for n, p in sp_model.named_parameters()}
    return objective.detach(), sp_model.aux_loss.detach(), grads, sp_model


def test_matches_plain_transformers_with_aux_loss():
    torch.manual_seed(0)
    model = tiny_moe()
    ids = batch()
    ref_loss, ref_aux, ref_grads = hf_reference(copy.deepcopy(model), ids)
    loss, aux, grads, sp_model = ours(copy.deepcopy(model), ids, lean_norm=False, gradient_checkpointing=False,
                                tiled_mlp=False, loss_type="nll")
    assert isinstance(sp_model.causal_lm.model.layers[0].mlp, SparseMoE)
    assert ref_aux > 1.0  # E x sum f P is 1 when balanced: something to get right
    assert abs(aux - ref_aux) <= 1e-6 * ref_aux
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    assert grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        assert rel(grads[n], g) <= 1e-5, n
    # the aux loss reaches the router: leaving its term out of the objective changes the router's grads
    sp_model = parallelize(copy.deepcopy(model), single_process_state(), ParallelizeConfig(
        attn_implementation="sdpa", lean_norm=False, gradient_checkpointing=False, tiled_mlp=False, loss_type="nll"))
    shard = shard_batch(ids, sp_size=1, sp_rank=0)
    (sp_model(**shard.model_inputs()) / shard.num_valid).backward()
    name = "model.layers.0.mlp.gate.weight"
    assert rel(dict(sp_model.named_parameters())["causal_lm." + name].grad, ref_grads[name]) > 1e-4


@pytest.mark.parametrize("levers", [
    dict(tiled_mlp=3),  # tiled experts, checkpointed (the recompute skips the experts' forward)
    dict(tiled_mlp=5, checkpoint_every=2),  # rebuilds
    dict(tiled_mlp=False, activation_offload=True, keep_attention_outputs=True),
    dict(tiled_mlp=4, loss_type="chunked_nll", loss_chunk_size=16, lean_norm=True),
])
def test_levers_change_memory_not_results(levers):
    model = tiny_moe(seed=4)
    ids = batch(seed=8, length=35)
    ref_loss, ref_aux, ref_grads = hf_reference(copy.deepcopy(model), ids)
    loss, aux, grads, _ = ours(copy.deepcopy(model), ids, **levers)
    assert abs(aux - ref_aux) <= 1e-6 * ref_aux
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    for n, g in ref_grads.items():
        assert rel(grads[n], g) <= 1e-5, n


def test_pads_are_left_out_of_the_router_statistics():
    """A shard's pad rows (real_rows) do not count: the aux loss equals transformers' with an attention mask."""
    model = tiny_moe(seed=5)
    ids = batch(seed=9, b=1, length=30)
    sp_model = parallelize(copy.deepcopy(model), single_process_state(), ParallelizeConfig(
        attn_implementation="sdpa", tiled_mlp=False, gradient_checkpointing=False))
    padded = torch.cat([ids, torch.zeros(1, 6, dtype=ids.dtype)], dim=1)
    shard = shard_batch(padded, sp_size=1, sp_rank=0)
    with torch.no_grad():
        sp_model(**{**shard.model_inputs(), "context": dataclasses.replace(shard.context, real_rows=(30,))})
        ref = model(input_ids=padded, attention_mask=(torch.arange(36) < 30).long()[None],
                    output_router_logits=True).aux_loss
    assert abs(sp_model.aux_loss - ref) <= 1e-6 * ref


def test_rows_of_different_lengths_leave_their_own_pads_out():
    """One conversation per row, each padded to the row's length: per-row real lengths (the trainer's rows carry
    them) keep every row's pads out of the router statistics, as transformers' per-row attention mask does; a
    single count for the batch (the longest row's) would count the shorter row's pads."""
    model = tiny_moe(seed=6)
    ids = batch(seed=10, b=2, length=32)
    mask = torch.stack([torch.arange(32) < 32, torch.arange(32) < 21]).long()  # row 1: 11 pads
    ids = torch.where(mask.bool(), ids, 0)
    sp_model = parallelize(copy.deepcopy(model), single_process_state(), ParallelizeConfig(
        attn_implementation="sdpa", tiled_mlp=False, gradient_checkpointing=False))
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        shard = shard_batch(ids, sp_size=1, sp_rank=0, real_lengths=[32, 21])
        assert shard.context.real_rows == (32, 21)
        sp_model(**shard.model_inputs())
        per_row = float(sp_model.aux_loss)
        sp_model(**{**shard.model_inputs(), "context": dataclasses.replace(shard.context, real_rows=(32, 32))})
        one_count = float(sp_model.aux_loss)
    assert abs(per_row - ref) <= 1e-6 * ref
    assert abs(one_count - ref) > 1e-4 * ref
    with pytest.raises(ValueError, match="one count in"):
        shard_batch(ids, sp_size=1, sp_rank=0, real_lengths=[32])


def _sp_rank_step(rank: int, world_size: int, per_rank_aux: bool):
    """Inside a rank: tiny-moe under parallelize in a ZeRO-3 engine, one forward + backward of the batch sharded
    over `world` SP ranks, the objective as the trainer forms it. per_rank_aux: each rank's aux loss from its own
    tokens only (the wrong loss), for the test that the comparison catches it."""
    import dataclasses

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from tests.dist_utils import zero3_config
    from ulysses_trainer import make_parallel_state
    from ulysses_trainer.parallel.loss import (
        aux_for_backward,
        global_aux_loss,
        global_loss,
        loss_for_backward,
        step_token_count,
    )

    state = make_parallel_state(world_size)
    model = parallelize(tiny_moe(seed=6), state, ParallelizeConfig(attn_implementation="sdpa", tiled_mlp=3))
    if per_rank_aux:
        model.state = dataclasses.replace(state, sp_size=1)  # only the aux loss reads it: sums over no group
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=zero3_config(world_size))
    # DeepSpeed's default leaf classes name transformers' Qwen3MoeSparseMoeBlock, which SparseMoE replaces: the
    # router and the experts fetch through their own hooks. With 3 tiles of ~3 rows (6 top-2 slots over 8
    # experts) every tile leaves experts without a token on this rank; the experts module runs anyway.
    from deepspeed.utils import z3_leaf_module

    assert not any(z3_leaf_module(layer.mlp) for layer in model.causal_lm.model.layers)
    shard = shard_batch(batch(seed=10, b=1, length=38), sp_size=world_size, sp_rank=rank)  # 38: pads at sp=4
    tokens = step_token_count(shard.num_valid, state)
    context = shard.context
    if per_rank_aux:  # the wrapper's shard check reads the replaced state too: leave it the all-gather path, which
        context = dataclasses.replace(context, seq_len=None)  # at sp 1 checks nothing (the all-to-alls keep the group)
    loss_sum = engine(**{**shard.model_inputs(), "context": context})
    aux = model.aux_loss
    engine.backward(loss_for_backward(loss_sum, tokens, state) + aux_for_backward(aux, model.aux_loss_coef, 1),
                    scale_wrt_gas=False)
    grads = {n.removeprefix("causal_lm."): safe_get_full_grad(p).numpy().copy()
             for n, p in engine.module.named_parameters()}
    aux_mean = global_aux_loss(float(aux.detach()), 1, state)
    return global_loss(float(loss_sum.detach()), tokens, state) + model.aux_loss_coef * aux_mean, aux_mean, grads


def _sp_both(rank: int, world_size: int):
    return _sp_rank_step(rank, world_size, False), _sp_rank_step(rank, world_size, True)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])  # 4 > tiny-moe's 2 KV heads: KV replicated
def test_sp_zero3_matches_plain_transformers_and_a_per_rank_aux_would_not(world_size):
    from tests.dist_utils import run_ranks

    ids = batch(seed=10, b=1, length=38)
    ref_loss, ref_aux, ref_grads = hf_reference(tiny_moe(seed=6), ids)
    for (loss, aux, grads), (_, bad_aux, bad_grads) in run_ranks(world_size, _sp_both, timeout=JOB_TIMEOUT_S):
        assert abs(aux - ref_aux) <= 1e-6 * ref_aux
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss
        for n, g in ref_grads.items():
            assert rel(torch.from_numpy(grads[n]), g) <= 1e-5, n
        # the per-rank aux loss is another loss: its value and the routers' grads miss the tolerance
        assert abs(bad_aux - ref_aux) > 1e-3 * ref_aux
        router = "model.layers.0.mlp.gate.weight"
        assert rel(torch.from_numpy(bad_grads[router]), ref_grads[router]) > 1e-5


@pytest.mark.slow
def test_train_sp1_sp2_sp4_same_losses_and_aux_losses_and_export_generates(tmp_path):
    """`deepspeed --num_gpus N launch/train.py`'s ranks (tests/warm_ranks.py) on tiny-moe, fp32, 3 steps,
    world = sp: the same losses and aux losses (1e-4 relative); final/ loads with AutoModelForCausalLM as
    Qwen3MoeForCausalLM and generates."""
    import ast
    import json
    import re

    from transformers import AutoModelForCausalLM

    from tests.dist_utils import job_failure
    from tests.warm_ranks import run_trainer

    args = ["--model_name_or_path", "tiny-moe", "--max_length", "126", "--max_steps", "3", "--bf16", "false",
            "--seed", "3", "--logging_steps", "1", "--learning_rate", "1e-3"]  # 126: pads at sp=4
    rows = {}
    for n in (1, 2, 4):
        out = tmp_path / f"sp{n}"
        proc = run_trainer(n, [*args, "--output_dir", str(out)], timeout=JOB_TIMEOUT_S)
        assert proc.returncode == 0, job_failure(proc)
        rows[n] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[1]] == [1, 2, 3]
    for n in (2, 4):
        for ref, got in zip(rows[1], rows[n], strict=True):
            for key in ("loss", "aux_loss"):
                assert abs(got[key] - ref[key]) <= 1e-4 * abs(ref[key]), (n, ref["step"], key, got[key], ref[key])
    assert all(r["aux_loss"] > 0 for r in rows[1])
    printed = [ast.literal_eval(m) for m in re.findall(r"\{'loss': [^{}]*\}", proc.stdout)]  # the sp=4 run's
    assert [p["aux_loss"] for p in printed] == [round(r["aux_loss"], 4) for r in rows[4]]

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sp2" / "final", dtype=torch.float32)
    assert isinstance(model, Qwen3MoeForCausalLM)
    ids = torch.tensor([[151643, 40, 1079, 264]])
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 9) and torch.equal(out[:, :4], ids)


def test_rehearse_rank_0_of_4_counts_what_the_comm_model_says(tmp_path):
    """The rehearsal runs tiny-moe as rank 0 of 4 (sp=4, tiled experts) in this process: ZeRO-3's gathers and
    reduce-scatters and the all-reduces (the router statistics' among them) are the ones modelled."""
    import json
    from pathlib import Path

    from tests.test_rehearse import _main

    recipe = str(Path(__file__).resolve().parent.parent / "launch/recipes/cpu_default.yaml")
    out = tmp_path / "r.json"
    assert _main(["--config", recipe, "--model_name_or_path", "tiny-moe", "--gpus", "4", "--max_length", "256",
                  "--tiled_mlp", "2", "--warmup_length", "64", "--count_collectives", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["world_size"], r["sp_size"]) == (4, 4) and r["losses_meaningful"] is False
    counted, modelled = r["collectives_counted"], r["comm"]["by_op"]
    assert counted["all_to_all"] == modelled["all_to_all"]
    assert counted["reduce_scatter"]["bytes"] == modelled["reduce_scatter"]["bytes"]
    assert counted["all_gather"]["bytes"] == modelled["all_gather"]["bytes"]
    assert counted["all_reduce"]["calls"] == modelled["all_reduce"]["calls"] - 1  # the stop flag is the loop's


def test_yarn_config_reaches_the_moe_model_and_ours_still_matches_transformers():
    """YaRN through the family's config (model_config_for): the rope is transformers' own, so ours (SP path,
    tiled experts, checkpointing) and the plain model agree on it; the aux loss is on by default."""
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import model_config_for

    cfg = model_config_for(TrainConfig(model_name_or_path="tiny-moe", max_length=163840,
                                       model_init_kwargs={"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}))
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 4.0
    assert cfg.output_router_logits is True and cfg.router_aux_loss_coef == 0.001
    off = model_config_for(TrainConfig(model_name_or_path="tiny-moe",
                                       model_init_kwargs={"output_router_logits": False}))
    assert off.output_router_logits is False
    model = build_model(cfg, torch.float32, seed=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    ids = batch(seed=12, length=33)
    ref_loss, ref_aux, ref_grads = hf_reference(copy.deepcopy(model), ids)
    loss, aux, grads, _ = ours(copy.deepcopy(model), ids, tiled_mlp=2)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss and abs(aux - ref_aux) <= 1e-6 * ref_aux
    for n, g in ref_grads.items():
        assert rel(grads[n], g) <= 1e-5, n


def test_the_console_line_shows_aux_loss_for_moe_only():
    import ast

    from ulysses_trainer.train.run_log import log_line

    row = {"loss": 11.91352, "grad_norm": 1.5, "learning_rate": 1e-4, "num_tokens": 512, "epoch": 0.5}
    dense = ast.literal_eval(log_line(row))
    assert list(dense) == ["loss", "grad_norm", "learning_rate", "num_tokens", "epoch"]  # the reference format
    moe = ast.literal_eval(log_line({**row, "aux_loss": 2.0412345}))
    assert list(moe) == [*dense, "aux_loss"] and moe["aux_loss"] == 2.0412
