"""YaRN: the resolved config gives exactly transformers' own yarn rope, at every shard's global positions."""

import math

import pytest
import torch
from transformers import AutoConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ulysses_trainer.config import TrainConfig
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.model.load import build_model, model_config_for, resolve_rope_parameters

L = 163_840  # 4 x 40,960: the reference recipe's YaRN length
SP = 4


def _shard_positions(length: int, sp_size: int) -> torch.Tensor:
    """Global positions at both edges and the middle of every shard of a `sp`-way split: [1, n]."""
    step = length // sp_size
    picks = []
    for s in range(sp_size):
        lo, hi = s * step, (s + 1) * step
        picks += [lo, lo + 1, lo + 7, (lo + hi) // 2, hi - 2, hi - 1]
    return torch.tensor(picks + [length - 1]).unsqueeze(0)


def _reference_cos_sin(rope_parameters: dict, positions: torch.Tensor, max_pos: int):
    """cos/sin from transformers' yarn init function on an independently written config."""
    ref = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=max_pos, rope_parameters=dict(rope_parameters))
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](ref, torch.device("cpu"))
    freqs = positions[0, :, None].double() * inv_freq.double()[None, :]  # [n, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [n, d]
    return (emb.cos() * scale).float(), (emb.sin() * scale).float(), scale


def _model_cos_sin(config, positions):
    model = build_model(config, torch.float32, seed=0)
    x = torch.zeros(1, positions.shape[1], config.hidden_size)
    cos, sin = model.model.rotary_emb(x, positions)
    return cos[0], sin[0], model.model.rotary_emb.attention_scaling


def test_resolved_yarn_matches_transformers_at_every_shard():
    cfg = TrainConfig(max_length=L, model_init_kwargs={"rope_parameters": {"rope_type": "yarn", "factor": 4}})
    config = model_config_for(cfg)
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                      "original_max_position_embeddings": 40960}
    assert config.max_position_embeddings == L

    pos = _shard_positions(L, SP)
    cos, sin, scale = _model_cos_sin(config, pos)
    ref_cos, ref_sin, ref_scale = _reference_cos_sin(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 40960, "rope_theta": 1e6},
        pos, L)
    assert scale == pytest.approx(ref_scale) and scale == pytest.approx(0.1 * math.log(4) + 1)
    # fp32 rotary at positions up to 1.6e5: the phase itself carries ~1e-2 absolute rounding
    torch.testing.assert_close(cos, ref_cos, atol=2e-2, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=2e-2, rtol=0)
    # and the low-frequency dims (small phases, no rounding issue) agree tightly
    torch.testing.assert_close(cos[:, 6:8], ref_cos[:, 6:8], atol=1e-5, rtol=1e-5)

    # default rope differs (so the comparison above can fail), most of all far from the start
    d_cos, _, d_scale = _model_cos_sin(preset_config("tiny"), pos)
    assert d_scale == 1.0
    assert (d_cos - cos).abs().max() > 0.3


def test_exact_against_reference_in_matching_arithmetic():
    """Same inputs, same fp32 arithmetic as the model: bitwise-equal cos/sin."""
    config = model_config_for(TrainConfig(max_length=L, model_init_kwargs={
        "rope_parameters": {"rope_type": "yarn", "factor": 4}}))
    pos = _shard_positions(L, SP)
    cos, sin, _ = _model_cos_sin(config, pos)
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=L,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 40960,
                         "rope_theta": 1e6}), torch.device("cpu"))
    freqs = pos[..., None].float() * inv_freq  # [1, n, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[0]
    assert torch.equal(cos, emb.cos() * scale) and torch.equal(sin, emb.sin() * scale)


def test_factor_auto_is_max_length_over_original():
    config = model_config_for(TrainConfig(max_length=100_000, model_init_kwargs={
        "rope_parameters": {"rope_type": "yarn", "factor": "auto"}}))
    assert config.rope_parameters["factor"] == pytest.approx(100_000 / 40_960)
    assert config.max_position_embeddings == 100_000
    # factor defaults to auto; rope_scaling (the old name) is accepted
    c2 = model_config_for(TrainConfig(max_length=81_920,
                                      model_init_kwargs={"rope_scaling": {"rope_type": "yarn"}}))
    assert c2.rope_parameters["factor"] == 2.0


def test_no_rope_parameters_keeps_the_checkpoint_rope():
    config = model_config_for(TrainConfig(max_length=1_048_576, allow_beyond_positions=True))  # meant: kept
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert config.max_position_embeddings == 40960


def test_saved_config_reloads_to_the_same_rope(tmp_path):
    config = model_config_for(TrainConfig(max_length=L, model_init_kwargs={
        "rope_parameters": {"rope_type": "yarn", "factor": 4, "beta_fast": 16}}))
    config.save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path)
    assert again.rope_parameters == config.rope_parameters
    pos = _shard_positions(L, SP)
    assert torch.equal(_model_cos_sin(config, pos)[0], _model_cos_sin(again, pos)[0])


def test_already_yarn_checkpoint_keeps_its_original_length():
    config = preset_config("tiny")
    resolve_rope_parameters(config, {"rope_type": "yarn", "factor": 2}, 81_920)
    resolve_rope_parameters(config, {"rope_type": "yarn", "factor": "auto"}, 163_840)
    assert config.rope_parameters["original_max_position_embeddings"] == 40_960
    assert config.rope_parameters["factor"] == 4.0


@pytest.mark.parametrize("rope, max_length, pattern", [
    ({"rope_type": "yarn", "factor": 1}, L, r"YaRN factor must be > 1, got 1"),
    ({"rope_type": "yarn", "factor": 0.5}, L, r"YaRN factor must be > 1, got 0.5"),
    ({"rope_type": "yarn", "factor": "auto"}, 40_960, r"YaRN factor must be > 1, got 1"),
    ({"rope_type": "yarn", "factor": "auto"}, 8192,
     r"original_max_position_embeddings 40960 exceeds the target length max_length 8192"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 200_000}, L,
     r"original_max_position_embeddings 200000 exceeds the target length max_length 163840"),
    ({"rope_type": "yarn", "factor": 4, "rope_theta": 10000}, L,
     r"rope_theta 10000 differs from the checkpoint's rope_theta 1000000.0"),
    ({"rope_type": "linear", "factor": 4}, L, r"rope_type 'linear' is not supported; use yarn"),
    ({"rope_type": "yarn", "factor": 4, "fudge": 1}, L, r"unknown YaRN keys \['fudge'\]"),
    ({"rope_type": "yarn", "factor": "big"}, L, r"factor must be a number, got 'big'"),
    ("yarn", L, r"rope_parameters must be a mapping"),
])
def test_rope_errors(rope, max_length, pattern):
    with pytest.raises(ConfigError, match=pattern):
        resolve_rope_parameters(preset_config("tiny"), rope, max_length)


def test_rope_theta_equal_to_checkpoint_is_accepted():
    rope = {"rope_type": "yarn", "factor": 4, "rope_theta": 1e6}
    out = resolve_rope_parameters(preset_config("tiny"), rope, L)
    assert out["rope_theta"] == 1e6


def test_both_rope_names_is_an_error():
    with pytest.raises(ConfigError, match="both rope_parameters and rope_scaling"):
        model_config_for(TrainConfig(model_init_kwargs={"rope_parameters": {}, "rope_scaling": {}}))


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": "auto"}, {"rope_type": "default"}])
def test_qwen3_5s_partial_rotary_is_kept_in_the_resolved_rope(rope):
    """Qwen3.5 rotates the first 25% of each head (rope_parameters.partial_rotary_factor) in sections for its
    multimodal positions: the resolved rope keeps both, so YaRN stretches those 64 of 256 dimensions, as
    transformers computes YaRN for a Qwen3.5 config that states it."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    config = Qwen3_5TextConfig(head_dim=256, max_position_embeddings=4096, num_hidden_layers=4)
    kept = {k: config.rope_parameters[k] for k in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
            if k in config.rope_parameters}
    assert kept.get("partial_rotary_factor") == 0.25
    resolved = resolve_rope_parameters(config, rope, 16384)
    assert {k: resolved[k] for k in kept} == kept
    inv_freq = Qwen3_5TextRotaryEmbedding(config).inv_freq
    assert inv_freq.numel() == 256 // 4 // 2  # 64 rotated dimensions: 32 frequencies
    if rope["rope_type"] == "yarn":
        stated = Qwen3_5TextConfig(head_dim=256, max_position_embeddings=16384, num_hidden_layers=4,
                                   rope_parameters={**kept, "rope_type": "yarn", "rope_theta": resolved["rope_theta"],
                                                    "factor": 4.0, "original_max_position_embeddings": 4096})
        assert torch.equal(inv_freq, Qwen3_5TextRotaryEmbedding(stated).inv_freq)
