"""Dense decoders whose layers go through transformers' attention interface and whose MLP is a gated SiLU MLP acting
per token: Llama (3.x, with its `llama3` RoPE scaling), Mistral (a sliding window on every layer when the config
gives one), Ministral (sliding and full layers interleaved, as its layer_types say) and Qwen2 / Qwen2.5 (biases on
q, k and v; windowed layers where its config's layer_types say so).

One generic family: each architecture is config facts (its transformers names, which flags it refuses, whether
q/k/v carry biases, its presets). Qwen3's gated MLP block counts and tiles the MLP (qwen3.GatedMlp); attention runs
through Ulysses with no q/k norms. RoPE of any type the config names runs as transformers computes it (position_ids
go to every rank), so Llama 3's `llama3` scaling needs nothing of its own. A sliding window: after the all-to-all each
rank holds the whole sequence of its heads, so the window applies exactly as in one process
(attention/kernels.windowed_attention); ring attention cannot say that.

Presets from the published config.json files: Llama-3.1-8B / 70B (vocab 128,256, head_dim 128, rope_theta 5e5 with
llama3 scaling factor 8 over 8,192 original positions, 131,072 positions, rms_norm_eps 1e-5, untied) and
Mistral-Small-24B-Base-2501 (vocab 131,072, hidden 5120, FFN 32,768, 40 layers, 32 q / 8 kv heads of 128,
rope_theta 1e8, 32,768 positions, no sliding window) and Qwen2.5-7B (vocab 152,064, hidden 3584, FFN 18,944,
28 layers, 28 q / 4 kv heads of 128, rope_theta 1e6, 131,072 positions, rms_norm_eps 1e-6, untied, no sliding
window). The tiny CPU presets keep the Qwen vocabulary so the built-in tokenizer's ids fit (data/tokenizer.py); the
Llama-3.1 presets' 128,256 ids take Llama 3's stand-in (the Qwen BPE's first 128,000 ranks, Llama 3's special tokens
at 128000+: data/stand_in_bpe.py); tiny-mistral's 16-token window is shorter than the tests' rows.
"""

from __future__ import annotations

from typing import Any

from ..base import Family, LayerDims, MlpBlock, MlpRun
from ..qwen3 import VOCAB_SIZE as QWEN_VOCAB
from ..qwen3 import GatedMlp


class PlainMlp(MlpBlock):
    """A plain MLP acting per token, down(act(up(x))) (Arcee's); tiled: dense/modules.TiledPlainMLP. The generic path
    (model/generic.py) gives it to a decoder whose MLP is up_proj / down_proj."""

    lora_linears = ("up_proj", "down_proj")

    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        """up, down."""
        return [("up", d.hidden * d.intermediate), ("down", d.intermediate * d.hidden)]

    def saved(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """Untiled: act keeps up(x), down_proj keeps act(up(x)): 2 [t, I]; tiled: only the input, counted with the
        post-attention norm's output."""
        return {"MLP intermediates (up, act)": 2 * run.tokens * d.intermediate * run.act_bytes
                if run.levers.tiled_mlp == 1 else 0}

    def backward_extra(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """Untiled: the grads of act and up coexist with the saved two (2 [t, I]), and the input grad [t, H]. Tiled:
        the full input grad plus one tile's forward + backward (4 [r, I] and 2 [r, H], r = t/tiles)."""
        t, e, h, i = run.tokens, run.act_bytes, d.hidden, d.intermediate
        if run.levers.tiled_mlp == 1:
            return {"MLP backward: grads of act, up": 2 * t * i * e, "MLP backward: input grad": t * h * e}
        r = -(-t // run.levers.tiled_mlp)
        return {"tiled MLP: input grad [t, H]": t * h * e,
                f"tiled MLP: one tile of {r} rows (intermediates + grads)": 4 * r * i * e + 2 * r * h * e}

    def weight_grad_numel(self, d: LayerDims, run: MlpRun) -> int:
        """Tiled: the two weight grads accumulate in full over the tiles; untiled: one at a time."""
        return (2 if run.levers.tiled_mlp > 1 else 1) * d.hidden * d.intermediate

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _tiny(**extra: Any) -> dict[str, Any]:
    """A CPU preset: 2 layers of hidden 64, 8 q / 2 kv heads of 16 (sp=4 replicates KV), the Qwen vocabulary."""
    return dict(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096, use_cache=False, **extra)


def _llama(hidden: int, intermediate: int, layers: int, heads: int) -> dict[str, Any]:
    return dict(vocab_size=128256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=dict(LLAMA3_ROPE),
                attention_bias=False, mlp_bias=False, tie_word_embeddings=False, bos_token_id=128000,
                eos_token_id=128001, use_cache=False)


LLAMA = Family(model_type="llama", config_class="LlamaConfig", causal_lm_class="LlamaForCausalLM", mlp=GatedMlp(),
               qk_norm=False, refused_flags=("attention_bias", "mlp_bias"), modules=f"{__name__}.modules",
               stand_in="llama3",
               presets={"tiny-llama": _tiny(rope_parameters=dict(LLAMA3_ROPE, original_max_position_embeddings=64)),
                        "llama-3.1-8b": _llama(4096, 14336, 32, 32),
                        "llama-3.1-70b": _llama(8192, 28672, 80, 64)})

MISTRAL = Family(model_type="mistral", config_class="MistralConfig", causal_lm_class="MistralForCausalLM",
                 mlp=GatedMlp(), qk_norm=False, modules=f"{__name__}.modules", stand_in="mistral_tekken",
                 presets={"tiny-mistral": _tiny(sliding_window=16, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 10_000.0}),
                          "mistral-small-24b": dict(
                              vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                              max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
                              rope_parameters={"rope_type": "default", "rope_theta": 100_000_000.0},
                              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, use_cache=False)})

MINISTRAL = Family(model_type="ministral", config_class="MinistralConfig", causal_lm_class="MinistralForCausalLM",
                   mlp=GatedMlp(), qk_norm=False, modules=f"{__name__}.modules",
                   presets={"tiny-ministral": _tiny(sliding_window=16, layer_types=["sliding_attention",
                                                                                    "full_attention"],
                                                    rope_parameters={"rope_type": "default", "rope_theta": 1e8})})

QWEN2 = Family(model_type="qwen2", config_class="Qwen2Config", causal_lm_class="Qwen2ForCausalLM", mlp=GatedMlp(),
               qk_norm=False, qkv_bias=True, modules=f"{__name__}.modules",
               presets={"tiny-qwen2": _tiny(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
                        "qwen2.5-7b": dict(
                            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
                            max_position_embeddings=131072, rms_norm_eps=1e-6, use_sliding_window=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                            tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643,
                            use_cache=False)})
