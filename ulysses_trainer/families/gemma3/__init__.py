"""Gemma 3 (text: transformers' Gemma3ForCausalLM / Gemma3TextConfig, model_type gemma3_text): sliding-window and
global attention layers interleaved (its layer_types; five local to one global in the published models), each kind
with its own RoPE (local: rope_theta 1e4; global: 1e6 with the checkpoint's scaling, linear factor 8 for 4B-27B),
four RMSNorms per layer that scale by (1 + weight) (input; the attention's output; the MLP's input; the MLP's
output), q/k norms per head, the embedding scaled by sqrt(hidden), a gated GELU-tanh MLP and query_pre_attn_scalar as
the attention's scale.

The trainer runs transformers' own layers: the model computes each layer kind's position embeddings from the
position_ids every rank gets, the attention interface hands Ulysses the layer's scale and window (after the
all-to-all a rank holds the whole sequence of its heads, so the window applies as in one process:
attention/kernels.windowed_attention), the lean norms take the (1 + weight) offset (Family.norm_offset), and the
MLP tiles with whatever activation the config names (levers/tiled_mlp.TiledMLP calls the model's act_fn).
final_logit_softcapping, where a config sets it, is applied inside the chunked loss, chunk by chunk
(model/loss_head.LossHead). What it refuses, in one line: attn_logit_softcapping (none of the attention kernels here
soft-caps the scores; Gemma 3 sets none), use_bidirectional_attention and attention_bias.

`gemma-3-27b`: the text model of google/gemma-3-27b-it's config.json (its text_config, as transformers' Gemma3
conversion writes it and public test fixtures copy it): vocab 262,208, hidden 5376, FFN 21,504, 62 layers, 32 q /
16 kv heads of 128, sliding_window 1024 with sliding_window_pattern 6 (layers 6, 12, ... global), rope_theta 1e6 with
linear scaling factor 8 on the global layers, rope_local_base_freq 1e4, query_pre_attn_scalar 168, 131,072
positions, rms_norm_eps 1e-6, tied embeddings, no soft-capping. The Hub checkpoint is multimodal (Gemma3Config);
its language model is what the trainer builds; it is tokenized with Gemma 3's stand-in (the Qwen BPE with Gemma 3's
special tokens at its ids and its chat format: data/stand_in_bpe.py). `tiny-gemma3`: the CPU preset, one sliding
(16-token window, shorter than the tests' rows) and one global layer, the Qwen vocabulary like the other tiny
presets.
"""

from __future__ import annotations

from typing import Any

from ..base import Family, LayerDims
from ..qwen3 import ENDOFTEXT_ID, GatedMlp
from ..qwen3 import VOCAB_SIZE as QWEN_VOCAB

# Gemma 3's layer: each block's output normed before the residual add, the MLP's input normed too
GEMMA3_LAYER = ("input_norm", "attention", "post_attention_norm", "pre_feedforward_norm", "mlp",
                "post_feedforward_norm")


def layer_types(layers: int, pattern: int = 6) -> list[str]:
    """Gemma 3's interleave: every `pattern`-th layer global, the others sliding (Gemma3TextConfig's rule)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]


def rope(global_theta: float, local_theta: float, factor: float | None) -> dict[str, dict[str, Any]]:
    """Gemma 3's RoPE per layer type: the global layers' base (linearly scaled by `factor` where given), the local
    layers' own base."""
    full = {"rope_type": "linear", "factor": factor} if factor else {"rope_type": "default"}
    return {"full_attention": {**full, "rope_theta": global_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}


class Gemma3Family(Family):
    """Gemma 3's facts where they differ from the generic Family: its attention's module order and what it
    refuses."""

    def attention_params(self, d: LayerDims) -> list[tuple[str, int]]:
        """q, k, v, then q_norm, k_norm (Gemma3Attention norms after all three projections), o."""
        h, q, k = d.hidden, d.q_width, d.kv_width
        return [("q", h * q), ("k", h * k), ("v", h * k), ("q_norm", d.head_dim), ("k_norm", d.head_dim),
                ("o", q * h)]

    def check_config(self, config: Any) -> str | None:
        """The generic checks, then attention-score soft-capping, which no kernel here runs exactly."""
        why = super().check_config(config)
        cap = getattr(config, "attn_logit_softcapping", None)
        if why is None and cap:
            why = (f"attn_logit_softcapping {cap:g} is not supported (no attention kernel of this trainer "
                   f"soft-caps the scores, so training would not be exact); use a checkpoint without it "
                   f"(Gemma 3 sets none)")
        return why


def _tiny() -> dict[str, Any]:
    """A CPU preset: 2 layers of hidden 64 (one sliding, one global), 8 q / 2 kv heads of 16 (sp=4 replicates KV), a
    16-token window, query_pre_attn_scalar 24 (not head_dim: the scale is the config's), the Qwen vocabulary."""
    return dict(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=24,
                sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                rope_parameters=rope(1_000_000.0, 10_000.0, 8.0), final_logit_softcapping=None,
                attn_logit_softcapping=None, attention_bias=False, bos_token_id=ENDOFTEXT_ID,
                eos_token_id=ENDOFTEXT_ID, pad_token_id=None, use_cache=False)


GEMMA3 = Gemma3Family(
    model_type="gemma3_text", config_class="Gemma3TextConfig", causal_lm_class="Gemma3ForCausalLM", mlp=GatedMlp(),
    qk_norm=True, norm_offset=1.0, layer_order=GEMMA3_LAYER, modules=f"{__name__}.modules", stand_in="gemma3",
    refused_flags=("attention_bias", "use_bidirectional_attention"),
    presets={"tiny-gemma3": _tiny(),
             "gemma-3-27b": dict(
                 vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                 num_attention_heads=32, num_key_value_heads=16, head_dim=128, hidden_activation="gelu_pytorch_tanh",
                 max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 query_pre_attn_scalar=168, sliding_window=1024, layer_types=layer_types(62),
                 rope_parameters=rope(1_000_000.0, 10_000.0, 8.0), final_logit_softcapping=None,
                 attn_logit_softcapping=None, attention_bias=False, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                 use_cache=False)})
