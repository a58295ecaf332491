"""Mixtral: Mistral's attention (no q/k norms, no biases; a sliding window on every layer when the config gives one)
and a sparse MoE block in every layer.

The block (transformers' MixtralSparseMoeBlock): a router (Linear H -> E without bias, softmax over all E experts,
top_k, the chosen weights renormalised to sum to 1: Qwen3-MoE's router with norm_topk_prob always on) and E
experts, each a gated SiLU MLP of width intermediate_size (Mixtral has no separate moe_intermediate_size), held
fused as gate_up_proj [E, 2I, H] and down_proj [E, H, I]. The trainer runs it as Qwen3-MoE's block
(levers/sparse_moe.SparseMoE calls transformers' own router, so its routing is the stock model's; the
load-balancing loss is transformers' load_balancing_loss_func over the whole sequence, router_aux_loss_coef times);
only the config facts differ. router_jitter_noise (a random rescale of the block's input in training) is refused:
the trainer does not apply it.

Preset from the published mistralai/Mixtral-8x7B-v0.1 config.json: vocab 32,000, hidden 4096, FFN 14,336,
32 layers, 32 q / 8 kv heads of 128, 8 experts top-2, rope_theta 1e6, 32,768 positions, rms_norm_eps 1e-5,
router_aux_loss_coef 0.02, sliding_window null, untied embeddings (46,702,792,704 parameters, 12.9B active).
tiny-mixtral keeps the Qwen vocabulary so the built-in tokenizer's ids fit and a 16-token window shorter than the
tests' rows.
"""

from __future__ import annotations

from typing import Any

from ..base import Family
from ..qwen3 import VOCAB_SIZE as QWEN_VOCAB
from ..qwen3_moe import SparseMoeMlp


class MixtralMoeMlp(SparseMoeMlp):
    """Qwen3-MoE's sparse block with Mixtral's config names: num_local_experts experts of width intermediate_size;
    its router always renormalises the top_k weights."""

    def dims(self, config: Any) -> dict[str, int]:
        return {"intermediate": config.intermediate_size, "experts": config.num_local_experts,
                "top_k": config.num_experts_per_tok}

    def check_config(self, config: Any) -> str | None:
        jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
        if jitter > 0:
            return (f"router_jitter_noise {jitter} is not supported (the trainer runs the router without the random "
                    f"rescale of its input); set router_jitter_noise 0")
        return None


def _mixtral(**kw: Any) -> dict[str, Any]:
    return dict(hidden_act="silu", num_experts_per_tok=2, num_local_experts=8, output_router_logits=True,
                router_jitter_noise=0.0, attention_dropout=0.0, tie_word_embeddings=False, use_cache=False, **kw)


MIXTRAL = Family(model_type="mixtral", config_class="MixtralConfig", causal_lm_class="MixtralForCausalLM",
                 mlp=MixtralMoeMlp(), qk_norm=False, modules=f"{__name__}.modules", stand_in="llama2",
                 presets={
                     # CPU preset: 2 layers of hidden 64, 8 q / 2 kv heads of 16 (sp=4 replicates KV), 8 experts
                     # of width 32, top-2, a 16-token window
                     "tiny-mixtral": _mixtral(
                         vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, sliding_window=16, router_aux_loss_coef=0.02,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                         bos_token_id=151643, eos_token_id=151643),
                     "mixtral-8x7b": _mixtral(
                         vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, sliding_window=None, router_aux_loss_coef=0.02,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                         bos_token_id=1, eos_token_id=2)})
