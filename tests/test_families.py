"""The model-family seam: presets and parameter counts against independent published numbers, the planner
reading the family (dense Qwen3 unchanged, Qwen3-MoE's sparse terms), the ZeRO-3 trace's module order."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

from ulysses_trainer.errors import ConfigError
from ulysses_trainer.families import FAMILIES, PRESETS, family
from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.plan.counts import layer_param_numels, num_active_params, num_params
from ulysses_trainer.plan.inputs import ModelShape, Settings, mlp_run
from ulysses_trainer.plan.layer_terms import layer_forward_saved, mlp_backward_extra
from ulysses_trainer.plan.zero3_trace import forward_order, gathers_per_micro_step, module_trace
from ulysses_trainer.vocabulary.layout import Layout


@pytest.mark.parametrize("name,total,active", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),  # Qwen3 technical report / model card: 30.5B total, 3.3B activated
    ("qwen3-235b-a22b", 235e9, 22e9),  # 235B total, 22B activated
])
def test_moe_parameter_counts_match_the_published_ones(name, total, active):
    shape = ModelShape.preset(name)
    assert num_params(shape) == pytest.approx(total, rel=0.01)
    assert num_active_params(shape) == pytest.approx(active, rel=0.03)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(name))
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert sum(p.numel() for p in model.parameters()) == num_params(shape)  # the planner counts what is built


def test_moe_presets_carry_the_published_dimensions():
    for name, dims in {"qwen3-30b-a3b": (2048, 768, 48, 32, 4), "qwen3-235b-a22b": (4096, 1536, 94, 64, 4)}.items():
        c = preset_config(name)
        assert (c.hidden_size, c.moe_intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                c.num_key_value_heads) == dims
        assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, c.router_aux_loss_coef) == (128, 8, True, 0.001)
        assert (c.vocab_size, c.head_dim, c.max_position_embeddings, c.rms_norm_eps) == (151936, 128, 40960, 1e-6)
        assert c.tie_word_embeddings is False and c.decoder_sparse_step == 1 and not c.mlp_only_layers
    t = preset_config("tiny-moe")
    assert (t.vocab_size, t.num_attention_heads, t.num_key_value_heads, t.num_experts, t.num_experts_per_tok) == \
        (151936, 8, 2, 8, 2)


def test_every_preset_belongs_to_one_family_and_unknown_types_are_refused():
    assert set(PRESETS) == {n for f in FAMILIES.values() for n in f.presets}
    assert {preset_config(n).model_type for n in PRESETS} == set(FAMILIES)
    with pytest.raises(ConfigError, match="'stablelm' is not supported; this trainer supports qwen3, qwen3_moe"):
        family("stablelm")


def test_dense_layer_order_is_unchanged():
    shape = ModelShape.preset("qwen3-4b")
    h, i, q, k, d = 2560, 9728, 4096, 1024, 128
    assert layer_param_numels(shape) == [h * q, h * k, h * k, q * h, d, d, h * i, h * i, i * h, h, h]
    assert forward_order(shape) == ["input_norm", "q", "q_norm", "k", "k_norm", "v", "o", "post_attention_norm",
                                    "gate", "up", "down"]
    assert num_active_params(shape) == num_params(shape)


def test_sparse_trace_runs_the_router_once_and_the_experts_per_tile():
    shape = ModelShape.preset("tiny-moe")
    assert forward_order(shape)[-3:] == ["router", "experts_gate_up", "experts_down"]
    trace = [n for i, n in module_trace(shape, tiled_mlp=3) if i == 0]
    # forward 1 router + 3 tiles; recompute: the router; backward: 3 x (forward + backward) of the experts
    assert trace.count("router") == 3 and trace.count("experts_down") == 3 + 6
    assert gathers_per_micro_step(shape, persistence_threshold=0, tiled_mlp=3)["experts_gate_up"] >= 2


def test_sparse_memory_terms_scale_with_top_k_and_tiles():
    shape = ModelShape.preset("qwen3-30b-a3b")
    s = Settings(max_length=1048576, layout=Layout(8, 8)).with_levers(tiled_mlp=1)
    saved = layer_forward_saved(shape, s)
    t = 131072
    assert saved["experts: permuted token buffer (top_k x t rows)"] == 8 * t * 2048 * 2
    assert saved["experts: intermediates of the top_k x t routed rows (gate_up, act, product)"] == 4 * 8 * t * 768 * 2
    assert "MLP intermediates (gate, act, up, product)" not in saved
    tiled = Settings(max_length=1048576, layout=Layout(8, 8)).with_levers(tiled_mlp=8)
    assert sum(layer_forward_saved(shape, tiled).values()) < sum(saved.values())
    assert sum(mlp_backward_extra(shape, tiled).values()) < sum(mlp_backward_extra(shape, s).values())
    batched = layer_forward_saved(shape, Settings(max_length=131072, experts_implementation="batched_mm"))
    assert batched["experts (batched_mm): gathered gate_up weights of one tile's rows"] == 768 * 2**30  # measured ask
    # active FLOPs: top_k experts per token, 2 x fwd passes + 4
    plain = Settings(max_length=131072).with_levers(gradient_checkpointing=False)
    assert shape.family.mlp.experts_flops(shape.dims, mlp_run(shape, plain), shape.layers) == \
        48 * 8 * 3 * 2048 * 768 * 131072 * 6


def test_plan_of_the_moe_recipe_and_the_one_line_question(capsys):
    """`ulysses-trainer plan` for Qwen3-30B-A3B at 1M on 8 H200s: sp 8, experts tiled, grouped_mm, the
    experts' step time at their own rate, active FLOPs (the plan's numbers are predictions, not measurements)."""
    import json
    from pathlib import Path

    from ulysses_trainer.__main__ import main as cli_main

    args = ["plan", "--model", "qwen3-30b-a3b", "--max_length", "1048576", "--gpus", "8", "--gpu_memory_gb", "139.8",
            "--host_memory_gb", "2000", "--json",
            "--model_init_kwargs", "{rope_parameters: {rope_type: yarn, factor: auto}}"]
    assert cli_main(args) == 0
    data = json.loads(capsys.readouterr().out)
    plan = data["plan"]
    assert plan["sp_size"] == 8 and plan["experts_implementation"] == "grouped_mm" and plan["tiled_mlp"] > 1
    assert data["estimate"]["parameters"] == 30_532_122_624
    assert any(name.startswith("experts (grouped_mm)") for name in plan["step_parts_s"])
    recipe = Path(__file__).resolve().parent.parent / "launch" / "recipes" / "moe_8gpu_1m.yaml"
    assert cli_main(["plan", "--config", str(recipe), "--gpu_memory_gb", "139.8", "--host_memory_gb", "2000",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["chosen"]["sp_size"] == 8 and data["chosen"]["max_length"] == 1_048_576


def test_logged_flops_count_the_active_experts():
    from ulysses_trainer.plan.counts import matmul_params

    c = ModelShape.preset("qwen3-30b-a3b")
    attn = 2048 * 4096 * 2 + 2 * 2048 * 512
    assert matmul_params(c) == 48 * (attn + 128 * 2048 + 8 * 3 * 2048 * 768) + 151936 * 2048
    dense = ModelShape.preset("qwen3-4b")
    assert matmul_params(dense) == 36 * (2560 * 4096 * 2 + 2 * 2560 * 1024 + 3 * 2560 * 9728) + 151936 * 2560
