"""Qwen3 (dense): q/k RMSNorm attention and a gated SiLU MLP in every layer.

Presets checked against the Qwen/Qwen3-*B config.json files on the Hub (and the Qwen3 technical report):
all share vocab 151,936, head_dim 128, rope_theta 1e6, max_position_embeddings 40,960,
rms_norm_eps 1e-6, no attention bias, SiLU MLP. The Hub configs set eos_token_id 151645 (<|im_end|>,
the chat models); the presets use 151643 (<|endoftext|>), the document separator of the
pretraining-style data the builder makes.
"""

from __future__ import annotations

from typing import Any

from ..base import Family, LayerDims, MlpBlock, MlpRun

VOCAB_SIZE = 151936
MAX_POSITIONS = 40960
ROPE_THETA = 1_000_000.0
ENDOFTEXT_ID = 151643

# name: (hidden, intermediate, layers, q heads, kv heads, tied embeddings)
_DIMS: dict[str, tuple[int, int, int, int, int, bool]] = {
    # CPU preset: real vocabulary; 8 q / 2 kv heads so sp=4 exercises KV replication
    "tiny": (64, 128, 2, 8, 2, True),
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False),
    "qwen3-14b": (5120, 17408, 40, 40, 8, False),
    "qwen3-32b": (5120, 25600, 64, 64, 8, False),
}


class GatedMlp(MlpBlock):
    """A gated SiLU MLP, down(act(gate(x)) * up(x)) (transformers' Qwen3MLP); tiled: levers/tiled_mlp.TiledMLP."""

    lora_linears = ("gate_proj", "up_proj", "down_proj")

    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        """gate, up, down."""
        h, i = d.hidden, d.intermediate
        return [("gate", h * i), ("up", h * i), ("down", i * h)]

    def saved(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """Untiled: act_fn keeps gate(x), the product keeps act(gate(x)) and up(x), down_proj keeps the product:
        4 [t, I] tensors (not 3: SiLU's backward needs its input, the product both factors); tiled: only the
        input, counted with the post-attention norm's output."""
        return {"MLP intermediates (gate, act, up, product)":
                4 * run.tokens * d.intermediate * run.act_bytes if run.levers.tiled_mlp == 1 else 0}

    def backward_extra(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """Untiled: the grads of the product and of act/up coexist with the saved four (2 more [t, I]), and the
        gate/up input grads ([t, H] each). Tiled: the full input grad plus one tile's forward + backward
        (6 [r, I] and 2 [r, H], r = t/tiles)."""
        t, e, h, i = run.tokens, run.act_bytes, d.hidden, d.intermediate
        if run.levers.tiled_mlp == 1:
            return {"MLP backward: grads of product, act, up": 2 * t * i * e,
                    "MLP backward: input grads (gate, up)": 2 * t * h * e}
        r = -(-t // run.levers.tiled_mlp)
        return {"tiled MLP: input grad [t, H]": t * h * e,
                f"tiled MLP: one tile of {r} rows (intermediates + grads)": 6 * r * i * e + 2 * r * h * e}

    def weight_grad_numel(self, d: LayerDims, run: MlpRun) -> int:
        """Tiled: the three weight grads accumulate in full over the tiles; untiled: one at a time."""
        return (3 if run.levers.tiled_mlp > 1 else 1) * d.hidden * d.intermediate


def common_kwargs(layers: int) -> dict[str, Any]:
    """What every Qwen3-family preset shares (the published configs)."""
    return dict(vocab_size=VOCAB_SIZE, hidden_act="silu", max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, attention_bias=False,
                use_sliding_window=False, max_window_layers=layers, use_cache=False, bos_token_id=ENDOFTEXT_ID,
                eos_token_id=ENDOFTEXT_ID, pad_token_id=ENDOFTEXT_ID)


def _preset(name: str) -> dict[str, Any]:
    hidden, inter, layers, heads, kv, tied = _DIMS[name]
    return dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=16 if name == "tiny" else 128, tie_word_embeddings=tied,
                **common_kwargs(layers))


QWEN3 = Family(model_type="qwen3", config_class="Qwen3Config", causal_lm_class="Qwen3ForCausalLM",
               mlp=GatedMlp(), qk_norm=True, fused_rope=True, presets={n: _preset(n) for n in _DIMS},
               modules=f"{__name__}.modules")
