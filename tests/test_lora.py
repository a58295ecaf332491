"""LoRA pieces without processes: the adapters' sizes the plan counts, the merge, the config checks."""

import pytest
import torch

from ulysses_trainer.config import TrainConfig
from ulysses_trainer.config.load import build_config
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.model.load import build_model, model_config_for
from ulysses_trainer.model.lora import add_lora, lora_scaling, merged_state_dict
from ulysses_trainer.plan.inputs import ModelShape
from ulysses_trainer.plan.partitions import lora_numels


@pytest.mark.parametrize("preset, targets", [("tiny", None), ("tiny", ["q_proj", "k_proj", "down_proj"]),
                                             ("tiny", "all-linear"), ("tiny-llama", "all-linear"),
                                             ("tiny-qwen2", "all-linear")])  # qwen2: its q/k/v Linears carry biases
def test_plan_counts_the_adapters_peft_makes(preset, targets):
    cfg = TrainConfig(model_name_or_path=preset, use_peft=True, lora_r=4, lora_target_modules=targets,
                      lora_dropout=0.0)
    mc = model_config_for(cfg)
    _, peft_model = add_lora(build_model(mc, torch.float32, None, seed=0), cfg)
    trainable = sorted(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable == sorted(lora_numels(ModelShape.from_config(mc), targets, 4))
    assert all(not p.requires_grad for n, p in peft_model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("targets", [None, ["q_proj", "o_proj"], "all-linear"])
def test_plan_counts_the_adapters_peft_makes_on_qwen3_moe(targets):
    """A sparse block has no Linear (fused experts, a router module): every target is an attention projection."""
    cfg = TrainConfig(model_name_or_path="tiny-moe", use_peft=True, lora_r=4, lora_target_modules=targets,
                      lora_dropout=0.0)
    mc = model_config_for(cfg)
    _, peft_model = add_lora(build_model(mc, torch.float32, None, seed=0), cfg)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in peft_model.named_parameters() if p.requires_grad}
    assert adapted <= {"q_proj", "k_proj", "v_proj", "o_proj"}
    trainable = sorted(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable == sorted(lora_numels(ModelShape.from_config(mc), targets, 4))


def test_adding_lora_shows_no_deprecation_notice():
    """PEFT reads a property transformers deprecates; the notice names PEFT's call, which no user can change."""
    import warnings

    cfg = TrainConfig(use_peft=True, lora_r=4, lora_dropout=0.0)
    model = build_model(model_config_for(cfg), torch.float32, None, seed=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        add_lora(model, cfg)
    assert [str(w.message) for w in seen if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []


def test_a_target_the_family_lacks_is_refused_naming_what_it_has():
    moe = ModelShape.preset("tiny-moe")
    with pytest.raises(ConfigError, match="no such Linear .*fused 3-D.*q_proj, k_proj, v_proj, o_proj"):
        lora_numels(moe, ["q_proj", "gate_proj"], 4)
    with pytest.raises(ConfigError, match="no such Linear; target some of q_proj, .*down_proj"):
        lora_numels(ModelShape.preset("tiny"), ["qproj"], 4)


def test_plan_with_lora_holds_no_gradient_or_adam_state_for_frozen_weights():
    from ulysses_trainer.plan.inputs import Settings
    from ulysses_trainer.plan.memory import adam_states_bytes, gradients_bytes, weights_bytes

    shape = ModelShape.preset("qwen3-4b")
    adapters = lora_numels(shape, None, 16)
    full, lora = Settings(max_length=4096), Settings(max_length=4096, trainable_numels=adapters)
    assert weights_bytes(shape, lora) == weights_bytes(shape, full)  # frozen weights are still held
    assert gradients_bytes(shape, lora) == sum(adapters) * 2
    assert adam_states_bytes(shape, lora) == sum(adapters) * 8
    assert adam_states_bytes(shape, full) > 500 * adam_states_bytes(shape, lora)  # 4B weights vs 5.9M adapter elements


def test_plan_with_lora_times_no_weight_gradient_matmuls():
    """Frozen base weights get no gradient: the backward runs 2 FLOPs a weight and token (the input's grad), not
    4, in the step model's dense term and in the floor; attention is unchanged."""
    from ulysses_trainer.plan.inputs import Settings, mlp_run
    from ulysses_trainer.plan.step_time import dense_flops, step_floor, step_time

    shape = ModelShape.preset("qwen3-4b")
    adapters = lora_numels(shape, None, 16)
    full = Settings(max_length=65536).with_levers(tiled_mlp=4)
    lora = Settings(max_length=65536, trainable_numels=adapters).with_levers(tiled_mlp=4)
    run = mlp_run(shape, full)
    passes, t, head = run.forward_passes, run.tokens, shape.vocab * shape.hidden
    expected = shape.layers * shape.active_layer_numel * t * (2 * passes + 2) + 4 * head * t
    assert mlp_run(shape, lora).weights_frozen and not run.weights_frozen
    assert dense_flops(shape, mlp_run(shape, lora)) == pytest.approx(expected)
    a, b = step_time(shape, full, shape.num_params), step_time(shape, lora, shape.num_params)
    assert b.parts["attention backward"] == a.parts["attention backward"]
    assert b.parts["matmuls and the rest"] < a.parts["matmuls and the rest"]
    fa, fb = step_floor(shape, full, a.parts)["matmuls s"], step_floor(shape, lora, b.parts)["matmuls s"]
    ratio = ((2 * passes + 2) * (shape.matmul_params - head) + 4 * head) / \
        ((2 * passes + 4) * (shape.matmul_params - head) + 6 * head)
    assert fb / fa == pytest.approx(ratio)


def test_merged_state_dict_equals_peft_merge():
    cfg = TrainConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear")
    model, peft_model = add_lora(build_model(model_config_for(cfg), torch.float32, None, seed=1), cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # B starts at zero: give the adapters an effect
    merged = merged_state_dict(model.state_dict(), lora_scaling(peft_model))
    reference = peft_model.merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for k, v in reference.items():
        assert torch.allclose(merged[k], v, atol=1e-6), k


def test_lora_config_refusals():
    with pytest.raises(ConfigError, match="lora_r must be an integer >= 1"):
        from ulysses_trainer.model.lora import check_lora

        check_lora(build_config(None, {"use_peft": True, "lora_r": 0}))
    with pytest.raises(ConfigError, match="not a valid LoraConfig"):
        check_lora(build_config(None, {"use_peft": True, "peft_config": {"no_such_key": 1}}))
