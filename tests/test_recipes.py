"""Every recipe in launch/recipes/ parses and validates for the world size it is written for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ulysses_trainer.cli.argv import load_config
from ulysses_trainer.config import TrainConfig, validate_config
from ulysses_trainer.ds_config import fill_ds_config, load_ds_config, resolve_ds_path
from ulysses_trainer.model.load import model_config_for
from ulysses_trainer.vocabulary.layout import resolve_layout

RECIPES = Path(__file__).resolve().parent.parent / "launch" / "recipes"
WORLD = {"reference_8gpu_1m.yaml": 8, "one_gpu_4b_long.yaml": 1, "one_gpu_4b_1m.yaml": 1, "cpu_default.yaml": 2,
         "moe_8gpu_1m.yaml": 8,
         "agent_sessions_1m.yaml": 1, "one_gpu_4b_sessions.yaml": 1, "sessions_8gpu_1m.yaml": 8,
         "qwen3_5_27b_8gpu_1m.yaml": 8, "qwen3_5_35b_a3b_8gpu_1m.yaml": 8, "qwen3_5_9b_one_gpu_256k.yaml": 1,
         "llama_3_1_8b_8gpu_1m.yaml": 8}


def _load(name: str) -> TrainConfig:
    return load_config(["--config", str(RECIPES / name)])


def test_every_recipe_is_covered():
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(WORLD)


@pytest.mark.parametrize("name", sorted(WORLD))
def test_recipe_validates_for_its_world_size(name):
    cfg, world_size = _load(name), WORLD[name]
    validate_config(cfg, world_size)
    sp_size = world_size if cfg.sp_size is None else cfg.sp_size
    model = model_config_for(cfg)  # presets and YaRN resolve without weights
    resolve_layout(sp_size, world_size, model.num_attention_heads, model.num_key_value_heads)
    gpu = name != "cpu_default.yaml"
    ds, _ = fill_ds_config(load_ds_config(cfg.deepspeed), cfg, world_size, world_size // sp_size, gpu,
                           bf16=gpu, total_steps=cfg.max_steps, hidden_size=model.hidden_size,
                           use_deepspeed_optimizer=False, source=name)
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["train_batch_size"] == cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size


def test_moe_recipe_is_qwen3_30b_a3b_at_1m_sp8_with_the_aux_loss():
    cfg = _load("moe_8gpu_1m.yaml")
    model = model_config_for(cfg)
    assert (cfg.model_name_or_path, cfg.max_length, cfg.sp_size) == ("qwen3-30b-a3b", 1048576, 8)
    assert (model.model_type, model.num_experts, model.num_experts_per_tok) == ("qwen3_moe", 128, 8)
    assert model.output_router_logits is True and model.router_aux_loss_coef == 0.001
    assert model.rope_parameters["rope_type"] == "yarn" and model.rope_parameters["factor"] == 4.0


def test_reference_recipe_is_the_reference_run():
    cfg = _load("reference_8gpu_1m.yaml")
    model = model_config_for(cfg)
    assert (cfg.model_name_or_path, cfg.max_length, cfg.sp_size) == ("qwen3-8b", 1048576, 8)
    assert (model.hidden_size, model.num_hidden_layers, model.tie_word_embeddings) == (4096, 36, False)
    rope = model.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["rope_theta"] == 1e6
    assert rope["original_max_position_embeddings"] == 40960 and model.max_position_embeddings == 163840
    assert cfg.bf16 is True and cfg.loss_type == "chunked_nll" and cfg.learning_rate == 1e-5
    assert cfg.activation_offload == "auto" and cfg.tiled_mlp == "auto" and cfg.logging_steps == 1


def test_llama_recipe_is_the_reference_shape_on_llama_3_1_8b_on_its_own_rope():
    """Llama 3.1's own llama3 rope, exactly (the preset's: the published config.json's), trained past its 131,072
    positions with allow_beyond_positions, as the reference run does: its rotary frequencies are transformers' own
    llama3 ones for the Hub's config, so nothing changes where it was trained; 4 q / 1 kv heads a rank."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ulysses_trainer.families.dense import LLAMA3_ROPE

    cfg = _load("llama_3_1_8b_8gpu_1m.yaml")
    model = model_config_for(cfg)
    assert (cfg.model_name_or_path, cfg.max_length, cfg.sp_size) == ("llama-3.1-8b", 1048576, 8)
    assert (model.model_type, model.num_attention_heads // 8, model.num_key_value_heads // 8) == ("llama", 4, 1)
    assert cfg.allow_beyond_positions is True and model.max_position_embeddings == 131072
    assert model.rope_parameters == LLAMA3_ROPE == {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hub = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=131072, rope_parameters={
                          "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})  # the Hub's config
    got, got_scale = ROPE_INIT_FUNCTIONS["llama3"](model, torch.device("cpu"))
    want, want_scale = ROPE_INIT_FUNCTIONS["llama3"](hub, torch.device("cpu"))
    assert got.shape == (64,) and torch.equal(got, want) and got_scale == want_scale == 1.0
    unscaled = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128)
    assert not torch.equal(got, unscaled)  # a real llama3 scaling, not the plain rope_theta frequencies


def test_one_gpu_recipe_stretches_qwen3_4b():
    cfg = _load("one_gpu_4b_long.yaml")
    model = model_config_for(cfg)
    assert cfg.model_name_or_path == "qwen3-4b" and cfg.sp_size == 1 and cfg.max_length >= 131072
    assert model.rope_parameters["factor"] == pytest.approx(cfg.max_length / 40960)
    assert model.max_position_embeddings == cfg.max_length


def test_cpu_default_recipe_is_the_no_argument_run():
    from ulysses_trainer.train.prepare import prepare

    cfg = _load("cpu_default.yaml")
    default = load_config([])
    # the JSON path is written repo-relative in the recipe; both name the same file
    assert resolve_ds_path(cfg.deepspeed).resolve() == resolve_ds_path(default.deepspeed).resolve()
    # its own output_dir, so that it runs after the no-argument job without being refused
    assert cfg.output_dir == "out/cpu_default" and default.output_dir == "out/default"
    assert dataclasses.replace(cfg, deepspeed=default.deepspeed, output_dir=default.output_dir) == default
    plan = prepare(cfg, 2)
    assert (plan.sp_size, plan.dp_size, plan.device, plan.bf16) == (2, 1, "cpu", False)
    assert len(plan.train_data) >= plan.sequences_per_step * plan.total_steps


def test_one_gpu_1m_recipe_is_the_measured_run_and_fits_the_plan(capsys):
    import json

    from ulysses_trainer.__main__ import main as cli_main

    cfg = _load("one_gpu_4b_1m.yaml")
    model = model_config_for(cfg)
    # the settings of benchmarks/results/long_context_ours_train_qwen3-4b_1048576_standin_every4_off7.json
    assert (cfg.model_name_or_path, cfg.max_length, cfg.sp_size) == ("qwen3-4b", 1048576, 1)
    assert (cfg.checkpoint_every, cfg.activation_offload, cfg.lean_norm) == (4, 7, True)
    assert load_ds_config(cfg.deepspeed)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert model.rope_parameters["factor"] == pytest.approx(1048576 / 40960)
    assert cli_main(["plan", "--config", str(RECIPES / "one_gpu_4b_1m.yaml"), "--gpus", "1",
                     "--gpu_memory_gb", "139.8", "--host_memory_gb", "125.9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["chosen"]["checkpoint_every"] == 4 and out["chosen"]["activation_offload"] == 7


def test_agent_sessions_recipe_is_the_1m_run_on_agent_sessions():
    """The same model, length and memory settings as one_gpu_4b_1m.yaml; only the data and the mask differ."""
    agent, text = _load("agent_sessions_1m.yaml"), _load("one_gpu_4b_1m.yaml")
    assert agent.dataset_name == "synthetic:agent_sessions" and agent.assistant_only_loss and not agent.packing
    data_fields = {"dataset_name", "assistant_only_loss", "packing", "max_length_policy", "output_dir"}
    differ = {f.name for f in dataclasses.fields(TrainConfig) if getattr(agent, f.name) != getattr(text, f.name)}
    assert differ <= data_fields, differ


@pytest.mark.parametrize("name, model, length, sp_size", [("one_gpu_4b_sessions.yaml", "qwen3-4b", 262144, 1),
                                                     ("sessions_8gpu_1m.yaml", "qwen3-8b", 1048576, 8)])
def test_mixed_sessions_recipes_pack_whole_sessions_best_fit(name, model, length, sp_size):
    cfg = _load(name)
    assert (cfg.model_name_or_path, cfg.max_length, cfg.sp_size) == (model, length, sp_size)
    assert cfg.dataset_name == "synthetic:agent_sessions_mixed" and cfg.assistant_only_loss
    assert cfg.packing and cfg.packing_strategy == "bfd"


@pytest.mark.parametrize("name, model, sp_size, yarn", [("qwen3_5_27b_8gpu_1m.yaml", "qwen3.5-27b", 8, True),
                                                   ("qwen3_5_35b_a3b_8gpu_1m.yaml", "qwen3.5-35b-a3b", 8, True),
                                                   ("qwen3_5_9b_one_gpu_256k.yaml", "qwen3.5-9b", 1, False)])
def test_qwen3_5_recipes(name, model, sp_size, yarn):
    cfg = _load(name)
    config = model_config_for(cfg)
    assert (cfg.model_name_or_path, cfg.sp_size) == (model, sp_size) and cfg.max_length >= 262144
    rope = config.rope_parameters
    assert rope["partial_rotary_factor"] == 0.25 and rope["rope_theta"] == 1e7  # YaRN keeps the partial rotary
    assert (rope["rope_type"], rope.get("factor")) == (("yarn", 4.0) if yarn else ("default", None))
    if yarn:
        assert rope["original_max_position_embeddings"] * rope["factor"] == cfg.max_length == 1048576
