"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm) and a sparse MoE block in every layer.

The block (transformers' Qwen3MoeSparseMoeBlock): a router (Linear H -> E, softmax, top_k, renormalised
when norm_topk_prob) and E experts, each a gated SiLU MLP of width moe_intermediate_size, held fused
as gate_up_proj [E, 2I, H] and down_proj [E, H, I]. Presets from the published Qwen/Qwen3-30B-A3B and
Qwen/Qwen3-235B-A22B configs: vocab 151,936, head_dim 128, rope_theta 1e6, max_position_embeddings
40,960, rms_norm_eps 1e-6, every layer sparse, top-8 of 128 experts, norm_topk_prob true,
router_aux_loss_coef 0.001, untied embeddings (tests/test_families.py checks the parameter counts
against the published ~30.5B / ~3.3B and ~235B / ~22B).
"""

from __future__ import annotations

from typing import Any

from .base import Family
from .qwen3 import common_kwargs

# name: (hidden, moe_intermediate, dense intermediate, layers, q heads, kv heads, experts, top_k, head_dim, tied)
_DIMS: dict[str, tuple[int, int, int, int, int, int, int, int, int, bool]] = {
    # CPU preset: real vocabulary; 8 q / 2 kv heads (sp=4 replicates KV); 8 experts, top-2
    "tiny-moe": (64, 32, 128, 2, 8, 2, 8, 2, 16, True),
    "qwen3-30b-a3b": (2048, 768, 6144, 48, 32, 4, 128, 8, 128, False),
    "qwen3-235b-a22b": (4096, 1536, 12288, 94, 64, 4, 128, 8, 128, False),
}
ROUTER_AUX_LOSS_COEF = 0.001


def _preset(name: str) -> dict[str, Any]:
    hidden, moe_i, inter, layers, heads, kv, experts, top_k, d, tied = _DIMS[name]
    return dict(hidden_size=hidden, moe_intermediate_size=moe_i, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=d, num_experts=experts,
                num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                output_router_logits=True, router_aux_loss_coef=ROUTER_AUX_LOSS_COEF, tie_word_embeddings=tied,
                **common_kwargs(layers))


QWEN3_MOE = Family(model_type="qwen3_moe", config_class="Qwen3MoeConfig", causal_lm_class="Qwen3MoeForCausalLM",
                   mlp_kind="sparse", qk_norm=True, presets={n: _preset(n) for n in _DIMS})
