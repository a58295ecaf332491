"""Presets carry the real Qwen3 dimensions; model configs load from presets or checkpoint dirs."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from ulysses_trainer.errors import ConfigError
from ulysses_trainer.families import PRESETS
from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.model.load import build_model, checkpoint_source, load_model_config
from ulysses_trainer.plan.counts import num_params
from ulysses_trainer.plan.inputs import ModelShape

# Published facts, not the presets' own numbers: the Qwen3 model cards (Qwen/Qwen3-*) and the technical
# report give, per model, parameters in billions (total, and without the embedding matrices) rounded as written
# there, layers, attention heads (GQA) for Q and KV, and whether the input and output embeddings are tied.
PUBLISHED = {
    "qwen3-0.6b": ("0.6", "0.44", 28, 16, 8, True),
    "qwen3-1.7b": ("1.7", "1.4", 28, 16, 8, True),
    "qwen3-4b": ("4.0", "3.6", 36, 32, 8, True),
    "qwen3-8b": ("8.2", "6.95", 36, 32, 8, False),
    "qwen3-14b": ("14.8", "13.2", 40, 40, 8, False),
    "qwen3-32b": ("32.8", "31.2", 64, 64, 8, False),
}
# the whole family (config.json of each): vocabulary, head width, RoPE base, trained positions, norm epsilon
FAMILY = {"vocab_size": 151936, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6}


def _params(name_or_config) -> int:
    config = preset_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def _matches(count: int, published: str) -> bool:
    """count (parameters) rounds to the published figure in billions: within half its last digit."""
    digits = len(published.partition(".")[2])
    return abs(count / 1e9 - float(published)) <= 0.5 * 10 ** -digits


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_are_the_published_ones(name):
    total, non_embedding, *_ = PUBLISHED[name]
    c = preset_config(name)
    n = _params(name)
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    assert _matches(n, total), (name, n)
    assert _matches(n - embeddings, non_embedding), (name, n - embeddings)
    assert num_params(ModelShape.from_config(c)) == n  # the planner counts what the model holds


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_published_layout(name):
    *_, layers, heads, kv_heads, tied = PUBLISHED[name]
    c = preset_config(name)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.tie_word_embeddings) == \
        (layers, heads, kv_heads, tied)
    assert {k: getattr(c, k) for k in FAMILY} == FAMILY
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert c.hidden_act == "silu" and c.attention_bias is False and c.sliding_window is None


def test_presets_list():
    assert set(PRESETS) == set(PUBLISHED) | {"tiny", "tiny-moe", "qwen3-30b-a3b", "qwen3-235b-a22b"} | {
        "tiny-qwen3.5", "qwen3.5-9b", "qwen3.5-27b", "tiny-qwen3.5-moe", "qwen3.5-35b-a3b", "qwen3.5-122b-a10b",
        "qwen3.5-397b-a17b"} | {  # Qwen3.5: tests/test_qwen3_5.py
        "tiny-llama", "llama-3.1-8b", "llama-3.1-70b", "tiny-mistral", "mistral-small-24b", "tiny-ministral",
        "tiny-qwen2", "qwen2.5-7b"} | {
        "tiny-gemma3", "gemma-3-27b", "tiny-granite", "granite-3.1-8b", "tiny-olmo2", "olmo-2-7b", "tiny-phi3",
        "phi-3.5-mini"} | {
        "tiny-mixtral", "mixtral-8x7b", "tiny-qwen2-moe", "qwen1.5-moe-a2.7b", "tiny-gpt-oss", "gpt-oss-20b",
        "gpt-oss-120b"}
    # the dense families: tests/test_dense_families.py, tests/test_gemma3_family.py, tests/test_more_dense_families.py;
    # the sparse ones: tests/test_moe_families.py


def test_a_wrong_dimension_misses_the_published_count():
    # what the count test would catch: one digit off in an intermediate size moves Qwen3-8B out of 8.2B
    c = preset_config("qwen3-8b")
    c.intermediate_size = 13288
    assert not _matches(_params(c), PUBLISHED["qwen3-8b"][0])


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
    assert not getattr(again, "use_kernels", False)  # transformers' own forwards, which the levers wrap


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
    with pytest.raises(ConfigError, match="not in the Hugging Face cache, and HF_HUB_OFFLINE is set; download it"):
        load_model_config("nobody-here/no-such-model-xyz")  # HF_HUB_OFFLINE=1 in tests


def test_a_hub_id_without_the_network_says_the_hub_cannot_be_reached_at_once(monkeypatch):
    """One probe of HF_ENDPOINT (here a closed local port); transformers' own load, which retries for half a
    minute and ends in a bare OSError, is never asked."""
    from transformers import AutoConfig

    from ulysses_trainer.model import load

    asked = []
    real = AutoConfig.from_pretrained

    def from_pretrained(name, **kw):
        if not kw.get("local_files_only"):
            asked.append(name)
        return real(name, **kw)

    monkeypatch.setattr(load.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"'nobody-here/no-such-model-xyz': no such path and not in the Hugging "
                                          r"Face cache, and the Hub cannot be reached: http://127.0.0.1:9 did not "
                                          r"answer .*; download it where the network allows \(hf download"):
        load_model_config("nobody-here/no-such-model-xyz")
    assert asked == []
