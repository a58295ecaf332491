"""Granite (IBM Granite 3.x dense): a Llama layer (gated SiLU MLP, no q/k norms) with four multipliers, all read from
its config by transformers' own modules, which the trainer runs unchanged: the embeddings times embedding_multiplier
(GraniteModel), attention scaled by attention_multiplier in place of 1/sqrt(head_dim) (GraniteAttention passes it
to the attention function as `scaling`, which Ulysses attention applies), each residual branch times
residual_multiplier (GraniteDecoderLayer, inside the layer a checkpoint recomputes). The one the trainer replaces is
the head: its loss head divides the logits by logits_scaling as GraniteForCausalLM does (model/loss_head.py).

Preset `granite-3.1-8b`: the Granite 3.x 8B shape and multipliers as a published Granite 3.3-8B config.json gives
them (hidden 4096, FFN 12,800, 40 layers, 32 q / 8 kv heads of 128, rope_theta 1e7, 131,072 positions,
rms_norm_eps 1e-5, tied embeddings, embedding_multiplier 12, attention_multiplier 0.0078125, residual_multiplier
0.22, logits_scaling 16) with the vocabulary of 49,155 a third-party parameter table gives for 3.1; it counts
8,170,848,256 parameters, 16,384 (4 x 4096) fewer than that table's 8,170,864,640, so the 3.1 vocabulary may be
49,159. ibm-granite/granite-3.1-8b-base's own config.json was not read here: a checkpoint's config is what the
trainer reads. `tiny-granite`: the
dense tiny shape with multipliers away from 1 (and an attention scale other than 1/sqrt(head_dim)), so the tests
see each one.
"""

from __future__ import annotations

from typing import Any

from ..base import Family
from ..qwen3 import VOCAB_SIZE as QWEN_VOCAB
from ..qwen3 import GatedMlp

MULTIPLIERS = dict(embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                   logits_scaling=16.0)


def _tiny() -> dict[str, Any]:
    """A CPU preset: 2 layers of hidden 64, 8 q / 2 kv heads of 16, the Qwen vocabulary (the built-in tokenizer's
    ids fit); the attention scale 0.1 (not 1/sqrt(16)), logits divided by 4."""
    return dict(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096, use_cache=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0}, embedding_multiplier=12.0,
                attention_multiplier=0.1, residual_multiplier=0.22, logits_scaling=4.0)


GRANITE = Family(model_type="granite", config_class="GraniteConfig", causal_lm_class="GraniteForCausalLM",
                 mlp=GatedMlp(), qk_norm=False, refused_flags=("attention_bias", "mlp_bias"),
                 modules=f"{__name__}.modules", stand_in="granite3",
                 presets={"tiny-granite": _tiny(),
                          "granite-3.1-8b": dict(
                              vocab_size=49155, hidden_size=4096, intermediate_size=12800, num_hidden_layers=40,
                              num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                              max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=False,
                              mlp_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0},
                              tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                              use_cache=False, **MULTIPLIERS)})
