"""A test-only model family in one module: Qwen3 with a plain (not gated) MLP, down(act(up(x))), of width
intermediate_size. Registering it (`register_plain`: families.register, its block's install with
families/installs.register_install, and transformers' Auto classes) is all it takes for the planner, parallelize and the
trainer's model loading to run it: nothing else in the package names it. `unregister_plain` takes all of it back,
so no other test sees it."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.activations import ACT2FN
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ulysses_trainer.errors import ConfigError
from ulysses_trainer.families import Family, LayerDims, MlpBlock, MlpRun, register, unregister
from ulysses_trainer.families.installs import register_install, unregister_install
from ulysses_trainer.families.qwen3 import common_kwargs

MODEL_TYPE = "qwen3_plain_mlp"
PRESET = "tiny-plain"


class PlainConfig(Qwen3Config):
    model_type = MODEL_TYPE


class PlainMLP(nn.Module):
    """down(act(up(x))): two Linears, no gate."""

    def __init__(self, config: PlainConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class PlainForCausalLM(Qwen3ForCausalLM):
    config_class = PlainConfig

    def __init__(self, config: PlainConfig):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = PlainMLP(config)
        self.post_init()


class PlainMlp(MlpBlock):
    """The block's behaviour: two tensors, two [t, I] intermediates kept (up's output for act, act's for down)."""

    lora_linears = ("up_proj", "down_proj")

    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        return [("up", d.hidden * d.intermediate), ("down", d.intermediate * d.hidden)]

    def saved(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        return {"plain MLP intermediates (up, act)": 2 * run.tokens * d.intermediate * run.act_bytes}

    def backward_extra(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        return {"plain MLP backward: grad of act, input grad": run.tokens * (d.intermediate + d.hidden) * run.act_bytes}

    def weight_grad_numel(self, d: LayerDims, run: MlpRun) -> int:
        return d.hidden * d.intermediate


def install_plain(block: PlainMlp, model: Any, layers: Any, tiles: int,
                  experts_implementation: str) -> tuple[Any, float]:
    """What parallelize swaps in for the block: nothing (no tiled version; no load-balancing statistics)."""
    if tiles > 1:
        raise ConfigError("this test family has no tiled MLP: set tiled_mlp: false")
    return None, 0.0


PLAIN = Family(model_type=MODEL_TYPE, config_class="PlainConfig", causal_lm_class="PlainForCausalLM", mlp=PlainMlp(),
               qk_norm=True, presets={PRESET: dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                   num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                                   tie_word_embeddings=True, **common_kwargs(2))})


def register_plain() -> None:
    """What a user's own family module does: the family, and its classes for transformers' Auto maps (which
    preset_config and build_model go through), and its block's install. Raises if any of it is registered already."""
    AutoConfig.register(MODEL_TYPE, PlainConfig)
    AutoModelForCausalLM.register(PlainConfig, PlainForCausalLM)
    register(PLAIN)
    register_install(PlainMlp, install_plain)


def unregister_plain() -> None:
    """register_plain undone: the family's unregister, and the Auto maps' entries dropped (transformers has no
    unregister; `register` adds to each map's `_extra_content`)."""
    unregister(MODEL_TYPE)
    unregister_install(PlainMlp)
    CONFIG_MAPPING._extra_content.pop(MODEL_TYPE, None)
    MODEL_FOR_CAUSAL_LM_MAPPING._extra_content.pop(PlainConfig, None)
