"""Presets carry the real Qwen3 dimensions; model configs load from presets or checkpoint dirs."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from ulysses_trainer.errors import ConfigError
from ulysses_trainer.model.load import build_model, checkpoint_source, load_model_config
from ulysses_trainer.model.presets import PRESETS, preset_config

# hidden, intermediate, layers, q heads, kv heads, tied (Qwen/Qwen3-*B config.json)
TABLE = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False),
    "qwen3-14b": (5120, 17408, 40, 40, 8, False),
    "qwen3-32b": (5120, 25600, 64, 64, 8, False),
}


def _params(name: str) -> int:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(preset_config(name))
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


@pytest.mark.parametrize("name", list(TABLE))
def test_real_dimensions(name):
    c = preset_config(name)
    got = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
           c.num_key_value_heads, c.tie_word_embeddings)
    assert got == TABLE[name]
    assert (c.vocab_size, c.head_dim, c.max_position_embeddings, c.rms_norm_eps) == (151936, 128, 40960, 1e-6)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert c.hidden_act == "silu" and c.attention_bias is False and c.sliding_window is None


def test_presets_list():
    assert set(PRESETS) == set(TABLE) | {"tiny", "tiny-moe", "qwen3-30b-a3b", "qwen3-235b-a22b"}


def test_parameter_counts_match_the_model_cards():
    assert _params("qwen3-8b") / 1e9 == pytest.approx(8.19, abs=0.01)
    assert _params("qwen3-4b") / 1e9 == pytest.approx(4.02, abs=0.01)
    assert _params("qwen3-0.6b") / 1e9 == pytest.approx(0.596, abs=0.005)


def test_tiny_keeps_the_real_vocabulary_and_replicates_kv_at_sp4():
    c = preset_config("tiny")
    assert c.vocab_size == 151936 and c.tie_word_embeddings
    assert c.num_attention_heads >= 8 and c.num_key_value_heads == 2 and c.num_attention_heads % 4 == 0
    assert c.rope_parameters["rope_theta"] == 1e6 and c.max_position_embeddings == 40960
    assert _params("tiny") < 20_000_000


def test_build_model_is_seeded_and_leaves_global_rng_alone():
    c = preset_config("tiny")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = build_model(c, torch.float32, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    b = build_model(c, torch.float32, seed=7)
    d = build_model(c, torch.float32, seed=8)
    wa, wb, wd = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, d))
    assert torch.equal(wa, wb) and not torch.equal(wa, wd)
    assert a.config._attn_implementation == "sdpa" and a.config.use_cache is False
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied


def test_load_from_checkpoint_dir_and_overrides(tmp_path):
    model = build_model(preset_config("tiny"), torch.float32, seed=1)
    model.save_pretrained(tmp_path / "ckpt")
    path = str(tmp_path / "ckpt")
    assert checkpoint_source(path) == path and checkpoint_source("tiny") is None
    c = load_model_config(path, {"num_hidden_layers": 1})
    assert c.num_hidden_layers == 1 and len(c.layer_types) == 1 and c.hidden_size == 64
    again = build_model(c, torch.float32, from_pretrained_path=path)
    torch.testing.assert_close(again.model.layers[0].self_attn.q_proj.weight,
                               model.model.layers[0].self_attn.q_proj.weight, rtol=0, atol=0)


def test_missing_and_bad_models(tmp_path):
    with pytest.raises(ConfigError, match=r"'/no/such/dir': no such path; use a preset \(tiny, qwen3-0.6b"):
        load_model_config("/no/such/dir")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        load_model_config(str(tmp_path / "empty"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read .*config.json"):
        load_model_config(str(tmp_path / "broken"))
    with pytest.raises(ConfigError, match=r"not a field of the qwen3 config; did you mean 'num_hidden_lay"):
        load_model_config("tiny", {"num_hiden_layers": 3})
    with pytest.raises(ConfigError, match="rejected by the qwen3 config"):
        load_model_config("tiny", {"hidden_size": "big"})
    with pytest.raises(ConfigError, match="may not set dtype"):
        load_model_config("tiny", {"dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="not loadable as a Hub id"):
        load_model_config("nobody-here/no-such-model-xyz")  # HF_HUB_OFFLINE=1 in tests
