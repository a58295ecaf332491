"""A max_length past the positions a user's checkpoint covers is refused before any work (exit 2, one line) naming
the checkpoint's own scaling (Llama 3.1's `llama3` type, gpt-oss's YaRN, Phi-3.5's LongRoPE, Gemma 3's linear factor
on its global layers: its rope per layer type; or none: Mistral) and the stretches that reach max_length, each of
which is accepted: a llama3 checkpoint's own scheme with a larger factor, or YaRN. The checkpoints are config.json
files as the Hub writes them (transformers 4.x names: `rope_scaling`, `rope_theta`), nothing else. A YaRN asked over
an already-YaRN checkpoint (gpt-oss) stretches its own: its original length and its options (`truncate` false) kept.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

BASE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
HUB = {  # id: (config.json keys beyond BASE, what the refusal names)
    "llama-3.1": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 131072,
                   "rope_theta": 500000.0, "rope_scaling": {
                       "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
                  "the checkpoint's own llama3 scaling (factor 8) covers 131,072"),
    "gpt-oss": ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "max_position_embeddings": 131072,
                 "rope_theta": 150000.0, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
                 "layer_types": ["sliding_attention", "full_attention"], "rope_scaling": {
                     "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False}},
                "the checkpoint's own yarn scaling (factor 32) covers 131,072"),
    "phi-3.5": ({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "max_position_embeddings": 131072,
                 "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_scaling": {
                     "type": "longrope", "long_factor": [1.5] * 32, "short_factor": [1.0] * 32}},
                "the checkpoint's own longrope scaling"),
    "gemma-3": ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "max_position_embeddings": 131072,
                 "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 1024,
                 "query_pre_attn_scalar": 64, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                 "layer_types": ["sliding_attention", "full_attention"]},
                "full_attention: linear factor 8"),
    "mistral": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "max_position_embeddings": 32768,
                 "rope_theta": 1000000.0, "sliding_window": None},
                "max_position_embeddings is 32,768 and it has no rope scaling"),
}


def _checkpoint(tmp_path, name: str):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**BASE, **HUB[name][0]}, indent=2))
    return d


@pytest.mark.parametrize("name", list(HUB))
def test_past_a_user_checkpoints_positions_the_refusal_names_its_own_scaling(tmp_path, capsys, name):
    from ulysses_trainer.__main__ import main as cli_main

    d = _checkpoint(tmp_path, name)
    capsys.readouterr()
    code = cli_main(["plan", "--model", str(d), "--gpus", "2", "--gpu_memory_gb", "80", "--host_memory_gb", "64",
                     "--max_length", "262144"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]  # transformers'
    # own warnings about the legacy keys aside
    assert code == 2 and len(errors) == 1, errors
    err = errors[0]
    assert err.startswith("error: max_length 262,144 is beyond the model's positions"), err
    assert HUB[name][1] in err and "allow_beyond_positions true" in err, err
    if name != "gemma-3":  # its rope is one per layer type: no single YaRN to name
        assert '{"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}' in err, err
    if name == "llama-3.1":  # its own scheme stretched is named first
        assert '{"rope_parameters": {"rope_type": "llama3", "factor": "auto"}}' in err, err
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import model_config_for

    for named in re.findall(r"--model_init_kwargs '([^']*)'", err):  # every stretch it names is accepted
        config = model_config_for(TrainConfig(model_name_or_path=str(d), max_length=262144,
                                              model_init_kwargs=json.loads(named)))
        assert config.max_position_embeddings == 262144, named


def test_yarn_over_gpt_oss_stretches_its_own_yarn_keeping_its_options(tmp_path):
    """factor auto over gpt-oss's YaRN (4,096 original positions, factor 32, truncate false): factor 64 over the
    same 4,096 with truncate, beta_fast and beta_slow as the checkpoint has them, so the rotary frequencies are
    transformers' YaRN of that config (truncate false keeps the correction range's fractional edges)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import model_config_for

    d = _checkpoint(tmp_path, "gpt-oss")
    config = model_config_for(TrainConfig(model_name_or_path=str(d), max_length=262144, model_init_kwargs={
        "rope_parameters": {"rope_type": "yarn", "factor": "auto"}}))
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 64.0,
                                      "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False}
    assert config.max_position_embeddings == 262144
    hub = {k: v for k, v in HUB["gpt-oss"][0].items() if k not in ("rope_scaling", "rope_theta")}
    want = GptOssConfig(**{**BASE, **hub, "max_position_embeddings": 262144, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}})
    got_freq, got_scale = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](want, torch.device("cpu"))
    assert torch.equal(got_freq, want_freq) and got_scale == want_scale
    truncated = model_config_for(TrainConfig(model_name_or_path=str(d), max_length=262144, model_init_kwargs={
        "rope_parameters": {"rope_type": "yarn", "factor": "auto", "truncate": True}}))
    assert not torch.equal(ROPE_INIT_FUNCTIONS["yarn"](truncated, torch.device("cpu"))[0], got_freq)  # given: wins


def test_llama31_within_its_positions_keeps_its_llama3_rope(tmp_path):
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import model_config_for

    config = model_config_for(TrainConfig(model_name_or_path=str(_checkpoint(tmp_path, "llama-3.1")),
                                          max_length=131072))
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 8.0
    beyond = model_config_for(TrainConfig(model_name_or_path=str(tmp_path / "llama-3.1"), max_length=262144,
                                          allow_beyond_positions=True))
    assert beyond.rope_parameters == config.rope_parameters  # meant: trained past them on its own rope


def _llama3(config) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    freq, scale = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    assert scale == 1.0
    return freq


def test_a_llama3_stretch_is_llama_3_1s_own_scheme_with_a_larger_factor(tmp_path):
    """rope_type llama3 factor auto at 1,048,576 over Llama 3.1 (factor 8 over 8,192 covering 131,072): factor 64, its
    low/high_freq_factor and 8,192 original positions kept, covering 1,048,576; the frequencies are transformers'
    llama3 of that config: the high-frequency dimensions (wavelength under 8,192 / 4) as the checkpoint's, the
    low-frequency ones stretched 8x further."""
    from transformers import LlamaConfig

    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import model_config_for

    d = _checkpoint(tmp_path, "llama-3.1")
    own = model_config_for(TrainConfig(model_name_or_path=str(d), max_length=131072))
    config = model_config_for(TrainConfig(model_name_or_path=str(d), max_length=1048576, model_init_kwargs={
        "rope_parameters": {"rope_type": "llama3", "factor": "auto", "rope_theta": 500000.0}}))
    stretched = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 64.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert config.rope_parameters == stretched and config.max_position_embeddings == 1048576
    hub = {k: v for k, v in HUB["llama-3.1"][0].items() if k not in ("rope_scaling", "rope_theta")}
    want = LlamaConfig(**{**BASE, **hub, "max_position_embeddings": 1048576, "rope_parameters": stretched})
    got, before = _llama3(config), _llama3(own)
    assert torch.equal(got, _llama3(want))
    unscaled = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64)  # head_dim 64
    wavelength = 2 * torch.pi / unscaled
    high = wavelength < 8192 / 4
    assert high.any() and torch.equal(got[high], before[high])
    low = wavelength > 8192 / 1
    assert low.any() and torch.allclose(got[low], before[low] / 8)
    explicit = model_config_for(TrainConfig(model_name_or_path=str(d), max_length=1048576, model_init_kwargs={
        "rope_parameters": {"rope_type": "llama3", "factor": 64}}))
    assert explicit.rope_parameters == stretched


@pytest.mark.parametrize("name, rope, message", [
    ("llama-3.1", {"rope_type": "llama3", "factor": 32},
     "the rope_parameters given (llama3 factor 32 over 8,192 positions) cover 524,288; set rope_parameters factor "
     "to auto"),
    ("llama-3.1", {"rope_type": "llama3", "factor": 8}, "llama3 factor 8 does not stretch the checkpoint's own "
     "factor 8; use factor auto"),
    ("llama-3.1", {"rope_type": "llama3", "factor": "auto", "beta_fast": 32}, "unknown llama3 keys ['beta_fast']"),
    ("mistral", {"rope_type": "llama3", "factor": "auto"}, "rope_type llama3 stretches a checkpoint's own llama3 "
     "scaling; this mistral model's rope is default; use {rope_type: yarn, factor: auto}"),
])
def test_a_llama3_stretch_that_cannot_be_is_refused_naming_the_fix(tmp_path, name, rope, message):
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.errors import ConfigError
    from ulysses_trainer.model.load import model_config_for

    with pytest.raises(ConfigError) as err:
        model_config_for(TrainConfig(model_name_or_path=str(_checkpoint(tmp_path, name)), max_length=1048576,
                                     model_init_kwargs={"rope_parameters": rope}))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
