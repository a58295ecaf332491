"""Qwen3.5 (dense and MoE text models): three of every four layers run Gated DeltaNet linear attention, the fourth
full attention with an output gate, q/k RMSNorm and rotary on the first 25% of each 256-wide head.

The layers (transformers' qwen3_5 / qwen3_5_moe): a DeltaNet layer projects q, k (K key heads of dk) and v (V value
heads of dv) through in_proj_qkv, runs a causal depthwise conv (kernel 4, SiLU) over those channels, then the gated
delta rule (decay g from in_proj_a, A_log, dt_bias; write strength beta from in_proj_b), a gated RMSNorm per head
(gate z from in_proj_z) and out_proj. The full-attention layer's q_proj yields a query and a sigmoid gate per head
(twice the query width); the gate multiplies the attention output before o_proj. Every RMSNorm scales by
(1 + weight) in fp32 (norm_offset 1.0). The MoE model's block adds an always-on shared expert, scaled by a sigmoid
gate, to the routed experts.

Under Ulysses SP both mixers split by head (parallel/ulysses.py, ulysses_deltanet.py): sp must divide the
query heads and the DeltaNet key and value heads; it may exceed the full attention's KV heads (replicated).

Presets from the published Qwen/Qwen3.5-* config.json text configs: vocab 248,320, head_dim 256, partial rotary
0.25, rope_theta 1e7, max_position_embeddings 262,144, rms_norm_eps 1e-6, DeltaNet heads of 128 with conv kernel 4,
untied embeddings, full attention every 4th layer, eos 248,044. qwen3.5-9b is transformers' default
Qwen3_5TextConfig shape (32 layers, hidden 4096, 16 q / 4 kv heads, FFN 12,288, 16 / 32 DeltaNet heads).
"""

from __future__ import annotations

from typing import Any

from ..base import FP32, Family, LayerDims, MlpRun, TokenMixer
from ..qwen3 import GatedMlp
from ..qwen3_moe import ROUTER_AUX_LOSS_COEF, SparseMoeMlp

VOCAB_SIZE = 248320
MAX_POSITIONS = 262144
ROPE_THETA = 10_000_000.0
EOS_ID = 248044
FULL_ATTENTION_INTERVAL = 4


class GatedDeltaNet(TokenMixer):
    """transformers' Qwen3_5GatedDeltaNet; under SP, ulysses_deltanet.UlyssesGatedDeltaNet."""

    kind = "linear_attention"
    lora_linears = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")

    def lora_shapes(self, d: LayerDims) -> dict[str, tuple[int, int]]:
        h, value, nv = d.hidden, d.linear_v_heads * d.linear_v_dim, d.linear_v_heads
        return {"in_proj_qkv": (h, self._conv(d)), "in_proj_z": (h, value), "in_proj_b": (h, nv),
                "in_proj_a": (h, nv), "out_proj": (value, h)}

    def dims(self, config: Any) -> dict[str, int]:
        return {"linear_k_heads": config.linear_num_key_heads, "linear_v_heads": config.linear_num_value_heads,
                "linear_k_dim": config.linear_key_head_dim, "linear_v_dim": config.linear_value_head_dim,
                "linear_conv": config.linear_conv_kernel_dim}

    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        """in_proj_qkv, in_proj_b, in_proj_a, the conv, A_log, dt_bias, in_proj_z, the gated norm, out_proj."""
        h, key, value, nv = d.hidden, d.linear_k_heads * d.linear_k_dim, d.linear_v_heads * d.linear_v_dim, \
            d.linear_v_heads
        conv = 2 * key + value
        return [("qkv", h * conv), ("beta", h * nv), ("decay", h * nv), ("conv", conv * d.linear_conv),
                ("A_log", nv), ("dt_bias", nv), ("z", h * value), ("gated_norm", d.linear_v_dim),
                ("out", value * h)]

    def linear_numel(self, d: LayerDims) -> int:
        return sum(n for name, n in self.params(d) if name in ("qkv", "beta", "decay", "z", "out"))

    def sp_heads(self, d: LayerDims) -> tuple[int, ...]:
        return (d.linear_k_heads, d.linear_v_heads)

    def all_to_alls(self, d: LayerDims) -> list[tuple[str, int]]:
        """ulysses_deltanet.py: q, k, v, b, a packed into one before the conv; the rule's output after."""
        nv = d.linear_v_heads
        return [("DeltaNet q, k, v, b, a (before the conv)", self._conv(d) + 2 * nv),
                ("DeltaNet rule output", nv * d.linear_v_dim)]

    def saved(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """ulysses_deltanet.py per rank (t tokens x all heads = all tokens x its heads): the all-to-all's
        result (the conv's input), the conv output (SiLU's input) and q/k/v (the rule's input), the decay (fp32)
        and beta, the rule's output back on the rank's tokens, z, out_proj's input, and with transformers' gated
        RMSNorm (lean_norm false) its fp32 upcasts of input and gate and the normalised tensor (the lean one,
        lean_gated_norm.py, keeps its input and z, counted already)."""
        t, e = run.tokens, run.act_bytes
        conv, value, nv = self._conv(d), d.linear_v_heads * d.linear_v_dim, d.linear_v_heads
        return {"DeltaNet: all-to-all result (conv input), conv output, q/k/v": t * (3 * conv + 2 * nv) * e,
                "DeltaNet: decay (fp32), beta": t * nv * (FP32 + e),
                "DeltaNet: rule output, z, out_proj input": 3 * t * value * e,
                "DeltaNet: gated norm (fp32 input and gate, normalised)": 0 if run.lean_norm else
                    t * value * (2 * FP32 + e)}

    def backward_extra(self, d: LayerDims, run: MlpRun, rates: Any) -> dict[str, int]:
        """The rule's forward+backward peak as measured (plan/rates.DELTANET_RULE_PEAK_BYTES per token and value
        head: its chunk states and transients, counted whole although its inputs are among the saved tensors),
        the conv's input grad and the residual-stream grad."""
        t, e = run.tokens, run.act_bytes
        head = d.linear_k_dim * d.linear_v_dim / (128 * 128)  # the measured heads were 128 x 128
        peak = int(t * d.linear_v_heads * head * rates.DELTANET_RULE_PEAK_BYTES)
        return {"DeltaNet backward: the rule's measured fwd+bwd peak": peak,
                "DeltaNet backward: conv input grad": t * self._conv(d) * e,
                "residual-stream grad": t * d.hidden * e}

    def seconds(self, d: LayerDims, run: MlpRun, rates: Any) -> tuple[float, list[str], float]:
        """A mixer of a shape measured whole on this card (benchmarks/qwen3_5_mixer.py: projections, conv, rule,
        gated norm, forward+backward per local token; a further forward taken as a third of that): at its rate, its
        projections' FLOPs out of the dense rate. Else its kernels (kernel_seconds), the projections in the dense
        FLOPs."""
        t, extra = run.tokens, max(0.0, run.forward_passes - 1.0)
        own = dict(getattr(rates, "MIXER_S_PER_TOKEN", ())).get(self.measured_key(d))
        if own is not None:
            taken = self.linear_numel(d) * t * (2.0 * run.forward_passes + run.backward_flops)
            source = dict(rates.MIXER_SOURCES)[self.measured_key(d)]
            return t * own * (1.0 + extra / 3.0), [
                f"DeltaNet layers timed whole at their shape's measured rate ({source}, on an {rates.name}: one "
                f"document a row; a recompute forward taken as a third of forward+backward)"], taken
        seconds, notes = self.kernel_seconds(d, run, rates)
        return seconds, notes, 0.0

    def kernel_seconds(self, d: LayerDims, run: MlpRun, rates: Any) -> tuple[float, list[str]]:
        """The rule at its measured fla rate per token and value head (forward+backward, plus a forward per further
        forward pass), the conv at fla's conv rate per token and channel (its forward taken as a third)."""
        t, extra = run.tokens, max(0.0, run.forward_passes - 1.0)
        head = d.linear_k_dim * d.linear_v_dim / (128 * 128)
        fwd, fwd_bwd = rates.DELTANET_RULE_S
        rule = t * d.linear_v_heads * head * (fwd_bwd + extra * fwd)
        conv = t * self._conv(d) * rates.DELTANET_CONV_S * (1.0 + extra / 3.0)
        cards = (getattr(rates, "DELTANET_RULE_CARD", "H200"), getattr(rates, "DELTANET_CONV_CARD", "H200"))
        on = cards[0] if cards[0] == cards[1] else f"the rule on an {cards[0]}, the conv on an {cards[1]}"
        return rule + conv, [f"DeltaNet layers timed at fla's measured rule and conv rates ({on}, one shape; the "
                             "torch kernel's rule and conv are not measured)"]

    @staticmethod
    def measured_key(d: LayerDims) -> tuple[int, int, int, int, int]:
        """What a whole mixer's measured rate is keyed by: hidden, key heads, value heads, their widths (the time
        per local token does not depend on sp: a rank runs its tokens' projections and its heads' whole rows)."""
        return d.hidden, d.linear_k_heads, d.linear_v_heads, d.linear_k_dim, d.linear_v_dim

    @staticmethod
    def _conv(d: LayerDims) -> int:
        return 2 * d.linear_k_heads * d.linear_k_dim + d.linear_v_heads * d.linear_v_dim


class SharedExpertMoeMlp(SparseMoeMlp):
    """Qwen3.5-MoE's block: Qwen3-MoE's router and fused experts plus a shared expert (a gated SiLU MLP of width
    shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate(x)); levers/sparse_moe.SparseMoE runs it."""

    def dims(self, config: Any) -> dict[str, int]:
        return {**super().dims(config), "shared_expert": config.shared_expert_intermediate_size}

    def check_config(self, config: Any) -> str | None:
        return None  # every layer is sparse: the config has no dense-layer settings

    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        h, s = d.hidden, d.shared_expert
        return [*super().params(d), ("shared_gate_up", 2 * h * s), ("shared_down", s * h), ("shared_expert_gate", h)]

    def trace_groups(self, d: LayerDims) -> tuple[list[str], list[str]]:
        names = [n for n, _ in self.params(d)]
        return [names[0], *names[3:]], names[1:3]

    def active_numel(self, d: LayerDims) -> int:
        return super().active_numel(d) + 3 * d.hidden * d.shared_expert + d.hidden


def _rope() -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25}


def common_kwargs(layers: int) -> dict[str, Any]:
    """What every Qwen3.5 preset shares (the published text configs)."""
    return dict(vocab_size=VOCAB_SIZE, hidden_act="silu", max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
                rope_parameters=_rope(), attention_bias=False, head_dim=256, linear_conv_kernel_dim=4,
                linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False, use_cache=False,
                layer_types=["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
                             for i in range(layers)],
                eos_token_id=EOS_ID)


# name: (hidden, intermediate, layers, q heads, kv heads, DeltaNet key heads, DeltaNet value heads)
_DENSE: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "qwen3.5-9b": (4096, 12288, 32, 16, 4, 16, 32),
    "qwen3.5-27b": (5120, 17408, 64, 24, 4, 16, 48),
}
# name: (hidden, moe intermediate, shared expert, layers, q heads, kv heads, experts, top_k, DeltaNet k / v heads)
_MOE: dict[str, tuple[int, int, int, int, int, int, int, int, int, int]] = {
    "qwen3.5-35b-a3b": (2048, 512, 512, 40, 16, 2, 256, 8, 16, 32),
    "qwen3.5-122b-a10b": (3072, 1024, 1024, 48, 32, 2, 256, 8, 16, 64),
    "qwen3.5-397b-a17b": (4096, 1024, 1024, 60, 32, 2, 512, 10, 16, 64),
}


def _tiny(layers: int = 4) -> dict[str, Any]:
    """CPU presets: the real vocabulary; 8 q / 2 kv heads of 32 (sp=4 replicates KV; rotary on 8 of 32);
    4 key / 8 value DeltaNet heads of 16 (sp=4 splits them); 4 layers, the last full attention."""
    kw = common_kwargs(layers)
    kw.update(hidden_size=64, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
              linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
              tie_word_embeddings=True)
    return kw


def _dense(name: str) -> dict[str, Any]:
    hidden, inter, layers, heads, kv, lk, lv = _DENSE[name]
    return dict(common_kwargs(layers), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, linear_num_key_heads=lk,
                linear_num_value_heads=lv)


def _moe_kwargs(experts: int, top_k: int, moe_i: int, shared: int) -> dict[str, Any]:
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_i,
                shared_expert_intermediate_size=shared, output_router_logits=True,
                router_aux_loss_coef=ROUTER_AUX_LOSS_COEF)


def _moe(name: str) -> dict[str, Any]:
    hidden, moe_i, shared, layers, heads, kv, experts, top_k, lk, lv = _MOE[name]
    return dict(common_kwargs(layers), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, linear_num_key_heads=lk, linear_num_value_heads=lv,
                **_moe_kwargs(experts, top_k, moe_i, shared))


QWEN3_5 = Family(model_type="qwen3_5_text", config_class="Qwen3_5TextConfig", causal_lm_class="Qwen3_5ForCausalLM",
                 mlp=GatedMlp(), qk_norm=True, gated_attention=True, norm_offset=1.0, mixer=GatedDeltaNet(),
                 tokenizer="qwen3.5", presets={"tiny-qwen3.5": dict(_tiny(), intermediate_size=128),
                          **{n: _dense(n) for n in _DENSE}}, modules=f"{__name__}.modules")

QWEN3_5_MOE = Family(model_type="qwen3_5_moe_text", config_class="Qwen3_5MoeTextConfig",
                     causal_lm_class="Qwen3_5MoeForCausalLM", mlp=SharedExpertMoeMlp(), qk_norm=True,
                     gated_attention=True, norm_offset=1.0, mixer=GatedDeltaNet(), tokenizer="qwen3.5",
                     presets={"tiny-qwen3.5-moe": dict(_tiny(), **_moe_kwargs(8, 2, 32, 32)),
                              **{n: _moe(n) for n in _MOE}}, modules=f"{__name__}.modules")
