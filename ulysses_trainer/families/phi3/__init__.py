"""Phi-3 (Phi-3 mini / Phi-3.5 mini): fused projections, LongRoPE, and a sliding window where its config gives one.

Attention projects q, k and v with one qkv_proj (width q + 2 kv) and the MLP gate and up with one gate_up_proj
(width 2 x intermediate; up * act(gate)): the planner counts them fused, LoRA targets those names (qkv_proj, o_proj,
gate_up_proj, down_proj; the default: qkv_proj), and the tiled MLP runs Phi3MLP's own forward per tile
(modules.TiledFusedMLP). RoPE of any type the config names runs as transformers computes it; LongRoPE (the 128k
variants; "su" in older configs) picks its long or short factors by the longest position of the forward, which under
SP is the row's over every rank (model/row_rope.py), as one process's forward of the whole row picks it. Its
sliding_window (262,144 in the published configs, 2,047 in some early Phi-3-mini ones): stock transformers applies it
to every layer (a windowed mask; the window argument to flash attention), so the trainer does too (after the
all-to-all each rank holds the whole sequence of its heads; families/base.Family.windowed_layers).

Preset `phi-3.5-mini` from the published config of microsoft/Phi-3.5-mini-instruct: vocab 32,064, hidden 3072,
FFN 8192, 32 layers, 32 q / 32 kv heads of 96, LongRoPE over 4096 original of 131,072 positions (factor 32; its long and
short factors below), rope_theta 1e4, rms_norm_eps 1e-5, sliding_window 262,144, untied (3,821,079,552 parameters).
`tiny-phi3`: hidden 128, 8 q / 2 kv heads of 16 (sp=4 replicates KV), LongRoPE over 32 original positions (shorter
than the tests' rows), the Qwen vocabulary.
"""

from __future__ import annotations

from typing import Any

from ..base import Family, LayerDims, MlpRun
from ..qwen3 import VOCAB_SIZE as QWEN_VOCAB
from ..qwen3 import GatedMlp

# microsoft/Phi-3.5-mini-instruct config.json rope_scaling (type longrope), 48 = head_dim / 2 values each
LONG_FACTOR = [1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
               1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
               4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
               17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
               32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
               50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
               62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
               63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
               64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
               64.51000213623047, 64.52999877929688, 64.83999633789062]
SHORT_FACTOR = [1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842,
                1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979,
                1.0999999046325684, 1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662,
                1.2899998426437378, 1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
                1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745,
                2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
                2.0199997425079346, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
                2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
                2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533,
                2.729999542236328, 2.749999523162842, 2.8399994373321533]


class FusedGatedMlp(GatedMlp):
    """Phi-3's gated MLP, down(up * act(gate)) with gate and up from one gate_up_proj [2I, H] (transformers'
    Phi3MLP); tiled: modules.TiledFusedMLP. Its activations are the gated MLP's (the fused output [t, 2I] is kept
    whole: gate and up are views of it)."""

    lora_linears = ("gate_up_proj", "down_proj")

    def check_config(self, config: Any) -> str | None:
        """Dropout on the residual branches or the embeddings: each rank would draw its own masks, so an SP run
        could not equal one process's; the published configs set them to 0."""
        for name in ("resid_pdrop", "embd_pdrop"):
            if getattr(config, name, 0.0):
                return (f"{name} {getattr(config, name)} is not supported (dropout under sequence parallelism draws "
                        f"other masks than one process); set it to 0 in model_init_kwargs or the checkpoint's config")
        return None

    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        """gate_up, down."""
        h, i = d.hidden, d.intermediate
        return [("gate_up", 2 * h * i), ("down", i * h)]

    def backward_extra(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """The gated MLP's, plus the fused grad [t, 2I] that gate_up_proj's backward takes (assembled from the
        gate and up grads), and one input grad in place of two."""
        t, e, h, i = run.tokens, run.act_bytes, d.hidden, d.intermediate
        if run.levers.tiled_mlp == 1:
            return {"MLP backward: grads of product, act, up": 2 * t * i * e,
                    "MLP backward: the fused gate_up grad [t, 2I]": 2 * t * i * e,
                    "MLP backward: input grad": t * h * e}
        r = -(-t // run.levers.tiled_mlp)
        return {"tiled MLP: input grad [t, H]": t * h * e,
                f"tiled MLP: one tile of {r} rows (intermediates + grads)": 8 * r * i * e + r * h * e}

    def weight_grad_numel(self, d: LayerDims, run: MlpRun) -> int:
        """Tiled: both weight grads accumulate in full over the tiles; untiled: gate_up's, the larger, at most."""
        return (3 if run.levers.tiled_mlp > 1 else 2) * d.hidden * d.intermediate


def _tiny() -> dict[str, Any]:
    """A CPU preset: 2 layers of hidden 128, 8 q / 2 kv heads of 16, LongRoPE over 32 original positions."""
    return dict(vocab_size=QWEN_VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, hidden_act="silu",
                rms_norm_eps=1e-5, max_position_embeddings=4096, original_max_position_embeddings=32,
                use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, sliding_window=None,
                pad_token_id=None, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                                 "original_max_position_embeddings": 32, "factor": 128.0,
                                 "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
                                 "short_factor": [1.0, 1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5]})


PHI3 = Family(model_type="phi3", config_class="Phi3Config", causal_lm_class="Phi3ForCausalLM", mlp=FusedGatedMlp(),
              qk_norm=False, fused_qkv=True, attention_registered=("o", "qkv"),
              attention_linears=("qkv_proj", "o_proj"), lora_default=("qkv_proj",),
              modules=f"{__name__}.modules", stand_in="phi3",
              presets={"tiny-phi3": _tiny(),
                       "phi-3.5-mini": dict(
                           vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
                           max_position_embeddings=131072, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                           resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, sliding_window=262144,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                                            "original_max_position_embeddings": 4096, "factor": 32.0,
                                            "long_factor": list(LONG_FACTOR), "short_factor": list(SHORT_FACTOR)},
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000, pad_token_id=32000,
                           use_cache=False)})
