"""OLMo 2: norms after the sub-blocks and q/k norms over the whole projection.

Each layer normalizes its attention's output (post_attention_layernorm) and its MLP's output
(post_feedforward_layernorm) before the residual add, and has no pre-norms; its q_norm and k_norm are RMSNorms over
the whole q and k projections (widths heads x head_dim and kv heads x head_dim: the statistics span every head),
not over one head as Qwen3's. Under Ulysses they need nothing of their own: Olmo2Attention applies them on the
projection's output, on this rank's tokens with all heads, before it calls the attention function (the all-to-all
comes after), so each token's statistics are the ones one process computes. The MLP is a gated SiLU MLP (Qwen3's
block, tiled by levers/tiled_mlp.TiledMLP). The planner counts the layer in module order: q, k, v, o, q_norm (q
wide), k_norm (kv wide), gate, up, down, post_attention_layernorm, post_feedforward_layernorm.

Preset `olmo-2-7b`, OLMo-2-1124-7B's shape: 32 layers, hidden 4096, 32 heads, 4096 positions as its model card
gives them; vocab 100,352, FFN 11,008, 32 kv heads (no GQA), rope_theta 5e5, rms_norm_eps 1e-6 and untied
embeddings as OLMo 2 7B is usually described, not checked against its config.json here (7,298,617,344 parameters
with them): a checkpoint's own config.json is what the trainer reads. `tiny-olmo2`: the dense tiny shape, Qwen
vocabulary.
"""

from __future__ import annotations

from ..base import Family
from ..qwen3 import VOCAB_SIZE as QWEN_VOCAB
from ..qwen3 import GatedMlp

OLMO2 = Family(model_type="olmo2", config_class="Olmo2Config", causal_lm_class="Olmo2ForCausalLM", mlp=GatedMlp(),
               qk_norm=True, qk_norm_whole=True, norm_fp32_weight=True, stand_in="olmo2",
               # each block's output normed before its residual add, no norm before: the post-norms run after
               layer_order=("attention", "post_attention_norm", "mlp", "post_feedforward_norm"),
               refused_flags=("attention_bias",),
               modules=f"{__name__}.modules",
               presets={"tiny-olmo2": dict(
                            vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, hidden_act="silu",
                            rms_norm_eps=1e-6, max_position_embeddings=4096, use_cache=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
                        "olmo-2-7b": dict(
                            vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
                            max_position_embeddings=4096, rms_norm_eps=1e-6, attention_bias=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
                            tie_word_embeddings=False, pad_token_id=100277, bos_token_id=None,
                            eos_token_id=100257, use_cache=False)})
