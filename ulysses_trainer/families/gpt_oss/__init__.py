"""gpt-oss: attention with biases on q, k, v and o and a learned sink logit per query head, sliding-window (128)
and full layers alternating, and a sparse MoE block with its own router in every layer.

Attention sinks: every softmax has exp(sink_h) in its denominator and nothing in its numerator. Under Ulysses each
rank holds the whole sequence of its heads, so it takes its heads' slice of the sinks and runs them exactly as in
one process, windows and packed documents included (attention/kernels.sink_attention: the sink as a key of its
own, through the planned kernel on full layers and SDPA block masks on windowed ones).
The block (transformers' GptOssMLP): a router (Linear H -> E with a bias; top_k of the logits, softmax over those
k) and E experts held fused with biases (gate_up_proj [E, H, 2I], gate and up interleaved; down_proj [E, I, H]),
each a clamped SwiGLU: (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max=7) (transformers'
GptOssExperts, which the trainer calls). It runs as Qwen3-MoE's block (levers/sparse_moe.SparseMoE, experts by tiles;
the load-balancing loss over the whole sequence, router_aux_loss_coef times, when output_router_logits).

Presets from the published openai/gpt-oss-20b and openai/gpt-oss-120b config.json files: vocab 201,088, hidden
2880, 64 q / 8 kv heads of 64, experts of width 2880, top-4 (32 experts, 24 layers; 128 experts, 36 layers),
sliding_window 128 on every other layer (the first windowed), YaRN factor 32 over 4,096 original positions with
rope_theta 150,000 (131,072 positions), rms_norm_eps 1e-5, attention_bias true, router_aux_loss_coef 0.9, untied
embeddings (20.9B / 3.6B active; 116.8B / 5.1B active); tokenized with o200k_harmony's stand-in (the Qwen BPE
with harmony's special tokens at 199998+ and its chat format: data/stand_in_bpe.py). tiny-gpt-oss keeps the Qwen
vocabulary at CPU size with a 16-token window and YaRN (factor 32 over 128 original positions: 4,096).
"""

from __future__ import annotations

from typing import Any

from ..base import Family, LayerDims
from ..qwen3 import VOCAB_SIZE as QWEN_VOCAB
from ..qwen3_moe import SparseMoeMlp


class GptOssMoeMlp(SparseMoeMlp):
    """gpt-oss's block: a router with a bias and E experts (fused, with biases) of width intermediate_size."""

    def dims(self, config: Any) -> dict[str, int]:
        return {"intermediate": config.intermediate_size, "experts": config.num_local_experts,
                "top_k": config.num_experts_per_tok}

    def check_config(self, config: Any) -> str | None:
        return None  # every layer is sparse

    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        """The router's weight and bias, then the experts' gate_up [E, H, 2I] and its bias, down [E, I, H] and its
        bias (one module holds them)."""
        h, i, e = d.hidden, d.intermediate, d.experts
        return [("router", e * h), ("router_bias", e), ("experts_gate_up", e * h * 2 * i),
                ("experts_gate_up_bias", e * 2 * i), ("experts_down", e * i * h), ("experts_down_bias", e * h)]

    def trace_groups(self, d: LayerDims) -> tuple[list[str], list[str]]:
        names = [n for n, _ in self.params(d)]
        return names[:2], names[2:]

    def active_numel(self, d: LayerDims) -> int:
        """The router and top_k of the experts, their biases included."""
        h, i = d.hidden, d.intermediate
        return d.experts * (h + 1) + d.top_k * (3 * h * i + 2 * i + h)


class GptOssFamily(Family):
    """gpt-oss's attention: biases on all four projections and a sink per query head."""

    def attention_params(self, d: LayerDims) -> list[tuple[str, int]]:
        """The sinks (one logit per query head, the attention module's own parameter, so first; named *_bias: no
        matmul), then q, k, v, o with their biases."""
        h, q, k = d.hidden, d.q_width, d.kv_width
        return [("sinks_bias", q // d.head_dim), ("q", h * q), ("q_bias", q), ("k", h * k), ("k_bias", k),
                ("v", h * k), ("v_bias", k), ("o", q * h), ("o_bias", h)]

    def check_config(self, config: Any) -> str | None:
        if not getattr(config, "attention_bias", True):
            return ("attention_bias false is not supported for gpt_oss (the plan counts the projections' biases); "
                    "use a checkpoint with them")
        return super().check_config(config)


YARN = {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}


def _gpt_oss(layers: int, **kw: Any) -> dict[str, Any]:
    return dict(num_hidden_layers=layers, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                num_experts_per_tok=4, attention_bias=True, router_aux_loss_coef=0.9, output_router_logits=True,
                rms_norm_eps=1e-5, swiglu_limit=7.0, attention_dropout=0.0, tie_word_embeddings=False,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                use_cache=False, **kw)


def _big(layers: int, experts: int) -> dict[str, Any]:
    return _gpt_oss(layers, vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=experts,
                    sliding_window=128, max_position_embeddings=131072, rope_parameters=dict(YARN),
                    eos_token_id=200002, pad_token_id=199999)


GPT_OSS = GptOssFamily(
    model_type="gpt_oss", config_class="GptOssConfig", causal_lm_class="GptOssForCausalLM", mlp=GptOssMoeMlp(),
    qk_norm=False, attention_sinks=True, modules=f"{__name__}.modules", stand_in="o200k_harmony",
    presets={
        # CPU preset: 2 layers (windowed, full) of hidden 64, 8 q / 2 kv heads of 16 (sp=4 replicates KV), 8 experts
        # of width 32, top-2, a 16-token window
        "tiny-gpt-oss": dict(_gpt_oss(2, vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=32,
                                      num_local_experts=8, sliding_window=16, max_position_embeddings=4096,
                                      rope_parameters=dict(YARN, original_max_position_embeddings=128),
                                      eos_token_id=151643), head_dim=16, num_attention_heads=8,
                             num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=True),
        "gpt-oss-20b": _big(24, 32),
        "gpt-oss-120b": _big(36, 128)})
