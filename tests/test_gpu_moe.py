"""Qwen3-MoE in bf16 on a CUDA device: ours (parallelize with the MoE recipe's levers: tiled experts on
transformers' grouped_mm, chunked loss, lean norms, checkpoints with kept attention outputs) against a plain
transformers Qwen3MoeForCausalLM with the same weights, both bf16, the router's load-balancing loss included.
Two layers of Qwen3-30B-A3B's shape (128 experts, top 8), 8,192 tokens. Tolerances for bf16 on a GPU: loss
rel <= 1e-2, grad norm rel <= 5e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from ulysses_trainer import ParallelizeConfig, parallelize, shard_batch
from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.levers.lean_norm import available_norm_kernels
from ulysses_trainer.levers.sparse_moe import SparseMoE
from ulysses_trainer.model.load import build_model
from ulysses_trainer.parallel.state import single_process_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
LENGTH = 8192


def _model() -> torch.nn.Module:
    cfg = preset_config("qwen3-30b-a3b")
    cfg.num_hidden_layers = 2
    cfg.output_router_logits = True
    model = build_model(cfg, torch.bfloat16, seed=0)
    with torch.no_grad():  # transformers initialises the router to zeros: give it something to route with
        g = torch.Generator().manual_seed(1)
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w.copy_((torch.randn(w.shape, generator=g) * 0.02).to(w.dtype))
    return model.cuda()


def _grad_norm(grads) -> float:
    return torch.sqrt(sum(g.float().pow(2).sum() for g in grads)).item()


def test_bf16_moe_matches_plain_transformers_on_a_gpu():
    model = _model()
    assert isinstance(model, Qwen3MoeForCausalLM)
    ids = torch.randint(0, 150000, (1, LENGTH), generator=torch.Generator().manual_seed(2)).cuda()

    ref = copy.deepcopy(model)
    out = ref(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    ref_loss, ref_aux = out.loss.item(), out.aux_loss.item()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    del out

    norms = "triton" if "triton" in available_norm_kernels() else "torch"
    sp_model = parallelize(copy.deepcopy(model), single_process_state(), ParallelizeConfig(
        attn_implementation="sdpa", loss_type="chunked_nll", loss_chunk_size=256, tiled_mlp=4, lean_norm=True,
        norm_kernel=norms, gradient_checkpointing=True, keep_attention_outputs=True,
        experts_implementation="grouped_mm"))
    assert isinstance(sp_model.causal_lm.model.layers[0].mlp, SparseMoE)
    shard = shard_batch(ids, sp_size=1, sp_rank=0)
    objective = sp_model(**shard.model_inputs()) / shard.num_valid + sp_model.aux_loss_coef * sp_model.aux_loss
    objective.backward()
    grads = {n.removeprefix("causal_lm."): p.grad for n, p in sp_model.named_parameters()}

    assert grads.keys() == ref_grads.keys()
    loss_err = abs(objective.item() - ref_loss) / ref_loss
    aux_err = abs(sp_model.aux_loss.item() - ref_aux) / ref_aux
    gn, ref_gn = _grad_norm(grads.values()), _grad_norm(ref_grads.values())
    print(f"loss {objective.item():.5f} vs {ref_loss:.5f} (rel {loss_err:.2e}); aux {sp_model.aux_loss.item():.5f} vs "
          f"{ref_aux:.5f} (rel {aux_err:.2e}); grad norm {gn:.4f} vs {ref_gn:.4f} (rel {abs(gn / ref_gn - 1):.2e}); "
          f"norms {norms}")
    assert loss_err <= 1e-2 and aux_err <= 1e-2
    assert abs(gn / ref_gn - 1) <= 5e-2
    router = "model.layers.0.mlp.gate.weight"  # the aux loss's gradient reaches the router in both
    assert grads[router].float().norm() > 0 and ref_grads[router].float().norm() > 0
