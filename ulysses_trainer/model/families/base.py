"""What a model family declares (torch-free): the Family record and the layer dimensions it reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ...errors import ConfigError

MlpKind = Literal["dense", "sparse"]
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
# LoRA with no target_modules: PEFT's default for Qwen3, given explicitly (PEFT has none for Qwen3-MoE)
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class LayerDims:
    """The dimensions of one decoder layer that the parameter lists need."""

    hidden: int
    intermediate: int  # dense MLP width; the sparse family: one expert's width (moe_intermediate_size)
    q_width: int
    kv_width: int
    head_dim: int
    experts: int = 0
    top_k: int = 0


@dataclass(frozen=True)
class Family:
    """One model family.

    `attention_params` and `mlp_params` give (name, numel) in module order: the order the modules fetch
    their parameters in a layer's forward (plan/zero3_trace.py) and the order of a layer's parameters in
    the memory model (plan/inputs.layer_param_numels: attention, MLP, then the two layer norms).
    """

    model_type: str  # transformers' config.model_type
    config_class: str  # transformers class names, looked up when a model is built
    causal_lm_class: str
    mlp_kind: MlpKind
    qk_norm: bool
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> config kwargs

    def attention_params(self, d: LayerDims) -> list[tuple[str, int]]:
        """q, (q_norm,) k, (k_norm,) v, o: the attention's modules in the order they run."""
        h, q, k = d.hidden, d.q_width, d.kv_width
        if self.qk_norm:
            return [("q", h * q), ("q_norm", d.head_dim), ("k", h * k), ("k_norm", d.head_dim), ("v", h * k),
                    ("o", q * h)]
        return [("q", h * q), ("k", h * k), ("v", h * k), ("o", q * h)]

    def mlp_params(self, d: LayerDims) -> list[tuple[str, int]]:
        """The MLP's tensors in the order they are used: dense gate, up, down; sparse: the router's weight,
        then the experts' fused gate_up [E, 2I, H] and down [E, H, I] (one module holds both)."""
        h, i = d.hidden, d.intermediate
        if self.mlp_kind == "dense":
            return [("gate", h * i), ("up", h * i), ("down", i * h)]
        return [("router", d.experts * h), ("experts_gate_up", d.experts * 2 * i * h),
                ("experts_down", d.experts * h * i)]

    def lora_linears(self) -> tuple[str, ...]:
        """A decoder layer's nn.Linear modules, what LoRA can adapt ("all-linear"), in module order: the attention
        projections, and a dense MLP's three. A sparse block has none: its experts are fused 3-D weights and its
        router is not a Linear."""
        return ATTENTION_LINEARS + (DENSE_MLP_LINEARS if self.mlp_kind == "dense" else ())

    def lora_targets(self, target_modules: Any) -> tuple[str, ...]:
        """The Linear names LoRA adapts, from target_modules as PEFT takes it (names, "all-linear", or None: the
        default); the plan counts these and PEFT gets them. A name this family has no Linear for is a
        ConfigError naming those it has."""
        linears = self.lora_linears()
        if target_modules is None:
            return LORA_DEFAULT_TARGETS
        if target_modules == "all-linear":
            return linears
        names = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
        unknown = [n for n in names if n not in linears]
        if unknown:
            why = " (its experts are fused 3-D weights and its router is not a Linear)" \
                if self.mlp_kind == "sparse" else ""
            raise ConfigError(f"lora_target_modules {', '.join(map(str, unknown))}: a {self.model_type} layer has "
                              f"no such Linear{why}; target some of {', '.join(linears)}, or all-linear")
        return names

    def active_mlp_numel(self, d: LayerDims) -> int:
        """MLP parameters one token runs through: all of a dense MLP; the router and top_k of the experts."""
        if self.mlp_kind == "dense":
            return 3 * d.hidden * d.intermediate
        return d.experts * d.hidden + d.top_k * 3 * d.hidden * d.intermediate

    def mlp_row_width(self, d: LayerDims) -> int:
        """Intermediate values per token of the MLP, what the tile rules size by: a sparse block's token runs
        top_k experts of one expert's width each."""
        return d.intermediate * (d.top_k if self.mlp_kind == "sparse" else 1)

    def layer_dims(self, config: Any) -> LayerDims:
        """From a transformers config of this family."""
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sparse = self.mlp_kind == "sparse"
        return LayerDims(hidden=config.hidden_size,
                         intermediate=config.moe_intermediate_size if sparse else config.intermediate_size,
                         q_width=config.num_attention_heads * d, kv_width=config.num_key_value_heads * d,
                         head_dim=d, experts=config.num_experts if sparse else 0,
                         top_k=config.num_experts_per_tok if sparse else 0)

    def check_config(self, config: Any) -> str | None:
        """Why this trainer cannot run a config of this family (None: it can)."""
        if self.mlp_kind != "sparse":
            return None
        step = getattr(config, "decoder_sparse_step", 1)
        dense = list(getattr(config, "mlp_only_layers", None) or [])
        if step != 1 or dense:
            return (f"every layer must be sparse (decoder_sparse_step 1, no mlp_only_layers), got "
                    f"decoder_sparse_step={step}, mlp_only_layers={dense}")
        return None
