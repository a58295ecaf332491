"""The generic path (model/generic.py): a decoder of no family folder whose layers attend through transformers'
attention interface and whose MLP is a gated per-token one trains exact under Ulysses SP, and what it cannot
classify is refused before any work in one line naming it.

Helium (its RMSNorms multiply the weight in fp32), Seed-OSS (biases on q, k and v) and Arcee (a plain up/down MLP
with a squared ReLU), tiny (2 layers of hidden 64,
8 q / 2 kv heads of 8, a 503-token vocabulary) and random, fp32 on the CPU: sp 1 and 2 through the threaded SP
harness (tests/test_qwen3_5.py's) with checkpointing, offloaded layer inputs and a tiled MLP, and the trainer's own
path (model_config_for -> plan_for -> build_model -> parallelize) from a saved config.json, each against the stock
model (loss rel <= 1e-5, every gradient rel <= 1e-5). Refused: a layer_types entry that is not attention (LFM2's
short convolutions), a decoder layer holding a module the path cannot classify (Exaone 4's norm after the MLP), a
fused gate_up MLP (GLM's), a LayerNorm (StarCoder2's), a dropout (Seed-OSS's defaults).
"""

from __future__ import annotations

import pytest
import torch

from tests.sp_rank import trainer_path_matches
from tests.test_qwen3_5 import IGNORE, VOCAB, assert_equal, batch, reference, sp_run
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.families import FAMILIES, unregister

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=512, use_cache=False, pad_token_id=None,
            bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
ARCHITECTURES = {"helium": "HeliumConfig", "seed_oss": "SeedOssConfig", "arcee": "ArceeConfig"}
NO_DROPOUT = {"seed_oss": dict(attention_dropout=0.0, residual_dropout=0.0)}  # its defaults: 0.1
assert IGNORE == -100


@pytest.fixture(autouse=True)
def _families_as_they_were():
    """Generic families registered by a test leave with it (the registry is the process's)."""
    before = set(FAMILIES)
    yield
    for model_type in set(FAMILIES) - before:
        unregister(model_type)


def _config(name: str, **extra):
    import transformers

    return getattr(transformers, ARCHITECTURES.get(name, name))(**{**TINY, **NO_DROPOUT.get(name, {}), **extra})


def _build(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def _load(tmp_path, config):
    """Save `config` and load it as the trainer does (the generic family registered)."""
    from ulysses_trainer.model.load import load_model_config

    path = tmp_path / config.model_type
    config.save_pretrained(path)
    return str(path), load_model_config(str(path))


@pytest.mark.parametrize("name, sp_size, docs", [("helium", 1, [30, 41]), ("helium", 2, [9, 50, 12]),
                                                 ("seed_oss", 2, None), ("arcee", 2, [30, 41])])
def test_sp_equals_stock_transformers(tmp_path, name, sp_size, docs):
    _, config = _load(tmp_path, _config(name))
    length = sum(docs) if docs else 67
    ids, pos, labels = batch(length, docs, seed=sp_size, masked=True)
    ref = reference(_build(config), ids, pos, labels)
    levers = dict(gradient_checkpointing=True, activation_offload=True, tiled_mlp=3) if sp_size == 2 else {}
    assert_equal(sp_run([_build(config) for _ in range(sp_size)], ids, pos, labels, **levers), ref)


def test_the_trainers_path_and_plan(tmp_path):
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.ds_config import load_ds_config
    from ulysses_trainer.model.generic import GENERIC_NOTE
    from ulysses_trainer.plan.resolve import plan_for
    from ulysses_trainer.plan.types import Machine

    path, config = _load(tmp_path, _config("seed_oss"))
    fam = FAMILIES["seed_oss"]
    assert (fam.qkv_bias, fam.norm_fp32_weight, fam.recompute_skips_mlp()) == (True, False, False)
    _load(tmp_path, _config("helium"))
    assert FAMILIES["helium"].norm_fp32_weight  # Helium's norms multiply in fp32, as OLMo 2's
    trainer_path_matches(path, 48)
    cfg = TrainConfig(model_name_or_path=path, max_length=4096)
    plan = plan_for(cfg, config, load_ds_config(cfg.deepspeed), Machine(gpus=2, gpu_memory_gb=80.0,
                                                                        host_memory_gb=64.0))
    assert [n for n in plan.notes if n.startswith("generic decoder")] == [GENERIC_NOTE]
    from ulysses_trainer.families.dense import PlainMlp
    from ulysses_trainer.plan.inputs import ModelShape

    _, arcee = _load(tmp_path, _config("arcee"))
    assert isinstance(FAMILIES["arcee"].mlp, PlainMlp)
    for c in (config, arcee):  # what the planner counts is what transformers builds
        assert ModelShape.from_config(c).num_params == sum(p.numel() for p in _build(c).parameters())


@pytest.mark.parametrize("name, extra, named", [
    ("Lfm2Config", dict(layer_types=["conv", "full_attention"]), "layer type 'conv'"),
    ("Exaone4Config", {}, "'post_feedforward_layernorm' (Exaone4RMSNorm)"),
    ("GlmConfig", {}, "GlmMLP: gate_up_proj, down_proj"),
    ("Starcoder2Config", {}, "LayerNorm, not an RMSNorm"),
    ("SeedOssConfig", {}, "attention_dropout is 0.1; set it to 0"),  # Ulysses attention runs no dropout
])
def test_what_it_cannot_classify_is_refused_in_one_line(tmp_path, name, extra, named):
    config = _config(name, **extra)
    config.save_pretrained(tmp_path)
    from ulysses_trainer.model.load import load_model_config

    with pytest.raises(ConfigError) as err:
        load_model_config(str(tmp_path))
    line = str(err.value)
    assert "\n" not in line and f"model_type {config.model_type!r}" in line and named in line, line
    assert config.model_type not in FAMILIES


def test_an_attention_keyword_ulysses_does_not_apply_is_refused():
    """Gemma 2's attention passes softcap to the attention function: Ulysses attention would drop it."""
    from ulysses_trainer.model.generic import Refused, _attention

    config = _config("Gemma2Config")
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        attn = AutoModelForCausalLM.from_config(config).model.layers[0].self_attn
    with pytest.raises(Refused, match="passes softcap to the attention function"):
        _attention(attn, config, "layer 0.self_attn")


def test_an_mlp_computing_otherwise_is_refused():
    """gate/up/down Linears and an act_fn, but the activation on up: the tiled MLP would run another function."""
    from transformers.activations import ACT2FN

    from ulysses_trainer.model.generic import Refused, _mlp

    class ActOnUp(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            h, i = config.hidden_size, config.intermediate_size
            self.gate_proj, self.up_proj = torch.nn.Linear(h, i, bias=False), torch.nn.Linear(h, i, bias=False)
            self.down_proj, self.act_fn = torch.nn.Linear(i, h, bias=False), ACT2FN[config.hidden_act]

        def forward(self, x):
            return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))

    config = _config("helium")
    with pytest.raises(Refused, match=r"does not compute down\(act\(gate\(x\)\) \* up\(x\)\)"):
        _mlp(ActOnUp(config), config, "layer 0.mlp")
    from transformers.models.helium.modeling_helium import HeliumMLP

    _mlp(HeliumMLP(config), config, "layer 0.mlp")  # the stock one passes


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_it_derives_what_the_hand_written_families_declare(preset):
    """On a config of a family it does not replace (Qwen3: per-head q/k norms; Llama; Qwen2: q/k/v biases; Mistral:
    a window on every layer), the generic family counts a layer as the hand-written one does, in the same order."""
    from ulysses_trainer.families import family
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.model.generic import generic_family

    config = preset_config(preset)
    fam, own = generic_family(config), family(config.model_type)
    assert not isinstance(fam, str), fam
    d = own.layer_dims(config)
    assert (fam.attention_params(d), fam.mlp_params(d), fam.layer_norms()) == \
        (own.attention_params(d), own.mlp_params(d), own.layer_norms())
    assert (fam.qk_norm, fam.qkv_bias, fam.norm_fp32_weight, fam.windowed_layers(config)) == \
        (own.qk_norm, own.qkv_bias, own.norm_fp32_weight, own.windowed_layers(config))
