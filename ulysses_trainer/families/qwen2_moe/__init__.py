"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (biases on q, k and v, no q/k norms) and a sparse
MoE block with a shared expert in every layer.

The block (transformers' Qwen2MoeSparseMoeBlock): a router (Linear H -> E, softmax, top_k, renormalised only when
norm_topk_prob, which the published checkpoints leave false), E experts of width moe_intermediate_size held fused
(gate_up_proj [E, 2I, H], down_proj [E, H, I]) and a shared expert (a gated SiLU MLP of width
shared_expert_intermediate_size) on every token, scaled by sigmoid(shared_expert_gate(x)) (a Linear H -> 1). The
trainer runs it as Qwen3.5-MoE's block (levers/sparse_moe.SparseMoE: transformers' own router, the experts by
tiles, the shared expert, the load-balancing statistics summed over the SP group). Refused in one line: layers with
a dense MLP (decoder_sparse_step > 1, mlp_only_layers, num_experts 0: the plan counts every layer sparse),
sliding-window layers (use_sliding_window: Qwen2-MoE's attention hands its window to no kernel, only to the mask,
which Ulysses does not use) and qkv_bias false.

Preset from the published Qwen/Qwen1.5-MoE-A2.7B config.json: vocab 151,936, hidden 2048, 24 layers, 16 q / 16 kv
heads of 128, 60 experts of width 1408, top-4, norm_topk_prob false, a shared expert of width 5632,
rope_theta 1e6, 8,192 positions, rms_norm_eps 1e-6, untied embeddings, use_sliding_window false (14.3B parameters,
2.7B active). tiny-qwen2-moe keeps the Qwen vocabulary at CPU size.
"""

from __future__ import annotations

from typing import Any

from ..base import Family, LayerDims
from ..qwen3 import VOCAB_SIZE as QWEN_VOCAB
from ..qwen3_5 import SharedExpertMoeMlp
from ..qwen3_moe import ROUTER_AUX_LOSS_COEF, SparseMoeMlp

ENDOFTEXT_ID = 151643


class Qwen2MoeMlp(SharedExpertMoeMlp):
    """Qwen3.5-MoE's block (router, fused experts, a shared expert under a sigmoid gate), its shared expert's
    gate and up projections two tensors (Qwen2MoeMLP), every layer sparse."""

    def check_config(self, config: Any) -> str | None:
        if not getattr(config, "num_experts", 0):
            return "num_experts 0 (every layer a dense MLP) is not supported for qwen2_moe; use a sparse checkpoint"
        return SparseMoeMlp.check_config(self, config)

    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        h, s = d.hidden, d.shared_expert
        return [*SparseMoeMlp.params(self, d), ("shared_gate", h * s), ("shared_up", h * s), ("shared_down", s * h),
                ("shared_expert_gate", h)]


class Qwen2MoeFamily(Family):
    """Qwen2-MoE's facts, refusing what its layers do not run as the trainer counts and splits them."""

    def check_config(self, config: Any) -> str | None:
        if not getattr(config, "qkv_bias", True):
            return ("qkv_bias false is not supported for qwen2_moe (the plan counts q/k/v biases); use a checkpoint "
                    "with them")
        if self.windowed_layers(config)[0]:
            return ("use_sliding_window true is not supported for qwen2_moe: its attention hands the window to the "
                    "mask only, which Ulysses does not build, so it would train unwindowed; set use_sliding_window "
                    "false")
        return super().check_config(config)


def _qwen2_moe(**kw: Any) -> dict[str, Any]:
    return dict(hidden_act="silu", norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
                use_sliding_window=False, output_router_logits=True, router_aux_loss_coef=ROUTER_AUX_LOSS_COEF,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-6,
                attention_dropout=0.0, use_cache=False, bos_token_id=ENDOFTEXT_ID, eos_token_id=ENDOFTEXT_ID, **kw)


QWEN2_MOE = Qwen2MoeFamily(
    model_type="qwen2_moe", config_class="Qwen2MoeConfig", causal_lm_class="Qwen2MoeForCausalLM", mlp=Qwen2MoeMlp(),
    qk_norm=False, qkv_bias=True, modules=f"{__name__}.modules",
    presets={
        # CPU preset: 2 layers of hidden 64, 8 q / 2 kv heads of 8 (sp=4 replicates KV), 8 experts of width 32,
        # top-2 not renormalised, a shared expert of width 64
        "tiny-qwen2-moe": _qwen2_moe(
            vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, max_position_embeddings=4096, tie_word_embeddings=True),
        "qwen1.5-moe-a2.7b": _qwen2_moe(
            vocab_size=QWEN_VOCAB, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
            num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
            moe_intermediate_size=1408, shared_expert_intermediate_size=5632, max_position_embeddings=8192,
            max_window_layers=21, tie_word_embeddings=False)})
