"""What a model family declares (torch-free): the Family record, its MLP block's behaviour, the dimensions they read.

A family owns what differs between families: the MLP (or expert) block (its parameters, how the planner counts its
memory, time, ZeRO-3 uses and collectives, what training sets on its config) and its LoRA targets. The planner and
the model code call these methods; neither asks which family it has. What parallelize swaps into a model for a
block or a mixer is the family's torch side (its folder's modules.py, registered in families/installs.py keyed by
the block's class): this module and the facts of every family import nothing of the trainer but its errors and the
plan's vocabulary (torch-free), so the planner below the model reads them without torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..vocabulary.lever_settings import Levers

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
# the layer_types entries Ulysses attention runs (a sliding window applies on the whole sequence of a rank's heads)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# LoRA with no target_modules: PEFT's default for Qwen3, given explicitly (PEFT has none for Qwen3-MoE)
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")
FP32 = 4


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
    # a linear-attention mixer's (Qwen3.5's Gated DeltaNet): key / value heads and their widths, conv kernel
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 0
    shared_expert: int = 0  # a sparse block's always-on shared expert width (0: none)


@dataclass(frozen=True)
class MlpRun:
    """What an MLP block's plan terms read of one run on one rank (plan/ fills it from its Settings): the run's
    lever record itself, whose tiles and checkpointing the terms read (`levers.tiled_mlp`,
    `levers.gradient_checkpointing`)."""

    tokens: int  # t: tokens one rank holds per micro-step
    act_bytes: int  # 2 (bf16) or 4
    levers: Levers  # the plan's, every one decided (vocabulary/lever_settings)
    forward_passes: float = 1.0  # forwards per layer on average (recompute and checkpoint_every rebuilds)
    experts_implementation: str = "grouped_mm"
    lean_norm: bool = True  # the norms keep only their inputs (levers/lean_norm.py, lean_gated_norm.py)
    weights_frozen: bool = False  # LoRA: the base weights get no gradient, so the backward skips their matmuls

    def __post_init__(self) -> None:
        if not isinstance(self.levers.tiled_mlp, int):
            raise ValueError(f"an MLP run's tiles are a plan's count, got tiled_mlp {self.levers.tiled_mlp!r}")

    @property
    def backward_flops(self) -> float:
        """Backward FLOPs per weight and token: the input's grad (2) and the weight's (2; none when frozen)."""
        return 2.0 if self.weights_frozen else 4.0


@dataclass(frozen=True)
class AllReduce:
    """A collective a block adds per optimizer step (plan/collectives.Collective with op all_reduce)."""

    name: str
    group: str  # "sp" | "world"
    group_size: int
    bytes: int
    count: int
    crosses_nodes: bool = False


class MlpBlock(ABC):
    """One family's MLP block: the base holds what every block shares; a family's module subclasses it and
    defines the abstract methods (a block missing one is refused when it is made, not when the plan needs it).

    Parameters in module order (`params`: what the memory model, the ZeRO-3 trace and the FLOP counts assume);
    `saved` / `backward_extra`: the plan's memory terms (plan/layer_terms.py) by what keeps them; `time_parts`:
    measured parts in place of the dense rate (plan/step_time.py). What the trainer swaps in for it:
    families/installs.py.
    """

    lora_linears: tuple[str, ...] = ()  # the block's nn.Linear names, in module order
    lora_refusal: str = ""  # why a name is not a Linear here, added to the refusal

    def dims(self, config: Any) -> dict[str, int]:
        """intermediate (and experts, top_k) from a transformers config."""
        return {"intermediate": config.intermediate_size}

    def check_config(self, config: Any) -> str | None:
        """Why this trainer cannot run a config of this family (None: it can)."""
        return None

    def training_config(self, config: Any, model_init_kwargs: dict[str, Any]) -> None:
        """Set what training needs on a loaded config, unless model_init_kwargs sets it."""
        return None  # the default: nothing to set

    @abstractmethod
    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        """The block's tensors and their element counts, in module order."""

    def trace_groups(self, d: LayerDims) -> tuple[list[str], list[str]]:
        """(the block's tensors used once per pass, those used once per tile), in module order."""
        return [], [n for n, _ in self.params(d)]

    def active_numel(self, d: LayerDims) -> int:
        """Parameters one token runs through."""
        return sum(n for _, n in self.params(d))

    def row_width(self, d: LayerDims) -> int:
        """Intermediate values per token, what the tile rules size by."""
        return d.intermediate

    @abstractmethod
    def saved(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """Bytes autograd keeps from the block's (re)computed forward, by what keeps them (a tiled block keeps
        only its input, counted with the post-attention norm's output)."""

    @abstractmethod
    def backward_extra(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """Bytes beyond the saved tensors during the block's backward."""

    @abstractmethod
    def weight_grad_numel(self, d: LayerDims, run: MlpRun) -> int:
        """Full-size weight-grad elements alive at once in the block's backward under ZeRO-3."""

    def time_parts(self, d: LayerDims, run: MlpRun, layers: int, vocab: int,
                   rates: Any) -> tuple[float, dict[str, float], list[str]]:
        """(FLOPs of one micro-step taken out of the dense rate's part, the measured parts (seconds of one
        micro-step) timed instead, notes). `rates`: the planner's measured tables (plan/rates.py). Default:
        everything at the dense rate."""
        return 0.0, {}, []

    def all_reduces(self, d: LayerDims, world_size: int, sp_size: int, gpus_per_node: int,
                    grad_accum: int) -> list[AllReduce]:
        """The block's own collectives per optimizer step (beyond ZeRO-3's gathers of its parameters)."""
        return []


class TokenMixer(ABC):
    """A token mixer that some layers of a family run instead of softmax attention (Qwen3.5's Gated DeltaNet):
    the layers whose config `layer_types` entry is `kind`. Its parameters in module order (the plan's counts and
    ZeRO-3 trace) and the SP sizes it refuses; what parallelize installs on those layers: families/installs.py."""

    kind: str = ""  # the transformers config's layer_types entry of the layers that run it
    lora_linears: tuple[str, ...] = ()  # its nn.Linear names, in module order (what LoRA can adapt)

    def lora_shapes(self, d: LayerDims) -> dict[str, tuple[int, int]]:
        """(in, out) features of each of its lora_linears."""
        return {}

    @abstractmethod
    def dims(self, config: Any) -> dict[str, int]:
        """Its LayerDims fields from a transformers config."""

    @abstractmethod
    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        """Its tensors and their element counts, in the order its forward uses them."""

    def linear_numel(self, d: LayerDims) -> int:
        """Of its parameters, those in a matmul per token."""
        return sum(n for _, n in self.params(d))

    @abstractmethod
    def sp_heads(self, d: LayerDims) -> tuple[int, ...]:
        """Head counts sp must divide."""

    @abstractmethod
    def all_to_alls(self, d: LayerDims) -> list[tuple[str, int]]:
        """The Ulysses all-to-alls of one forward of one layer: (what, input elements per local token), each one
        call (the backward issues their reverse, plan/collectives.ulysses_all_to_alls)."""

    @abstractmethod
    def saved(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """Bytes autograd keeps from the mixer's (re)computed forward on one rank (run.tokens of its tokens, all
        heads; after its all-to-all the same bytes as all tokens of its heads), by what keeps them."""

    @abstractmethod
    def backward_extra(self, d: LayerDims, run: MlpRun, rates: Any) -> dict[str, int]:
        """Bytes beyond the saved tensors during the mixer's backward on one rank (`rates`: plan/rates.py)."""

    @abstractmethod
    def seconds(self, d: LayerDims, run: MlpRun, rates: Any) -> tuple[float, list[str], float]:
        """(seconds of one layer's mixer in one micro-step on one rank: run.forward_passes forwards and a backward,
        notes, the FLOPs of its projections those seconds include): projections not included (0 FLOPs) are
        matmuls, timed with the layer's dense FLOPs."""

    @abstractmethod
    def kernel_seconds(self, d: LayerDims, run: MlpRun, rates: Any) -> tuple[float, list[str]]:
        """(seconds of one layer's mixer kernels alone, the step floor's share of it, in one micro-step on one
        rank, notes)."""


@dataclass(frozen=True)
class Family:
    """One model family.

    `attention_params` and `mlp_params` give (name, numel) in module order: the order the modules fetch
    their parameters in a layer's forward (plan/zero3_trace.py) and the order of a layer's parameters in
    the memory model (plan/counts.layer_param_numels: attention, MLP, then the two layer norms).
    """

    model_type: str  # transformers' config.model_type (its AutoConfig / AutoModelForCausalLM entry)
    config_class: str  # transformers class names
    causal_lm_class: str
    mlp: MlpBlock
    qk_norm: bool
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> config kwargs
    # the attention's output gate (Qwen3.5): q_proj also yields a sigmoid gate per head, twice the query width
    gated_attention: bool = False
    # its attention applies RoPE through levers/rope's one-pass kernel on CUDA (the classes levers/rope.ROPE_ATTENTIONS
    # reproduces); False: HF's rotate_half ops, which the plan's dense rate was fitted with
    fused_rope: bool = False
    # RMSNorms scale by (offset + weight) in fp32 (Qwen3.5's zero-centred norms: 1.0); 0.0: weight, Qwen3's way
    norm_offset: float = 0.0
    # RMSNorms multiply the weight in fp32 and cast after (OLMo 2's); False: cast, then times the weight (Qwen3's)
    norm_fp32_weight: bool = False
    # the layers whose layer_types entry is mixer.kind run it instead of attention (None: every layer attends)
    mixer: TokenMixer | None = None
    # the Qwen BPE its presets (and a checkpoint without tokenizer files) are tokenized with (data/tokenizer.py)
    tokenizer: str = "qwen3"
    # a preset whose vocab_size is below that BPE's ids, or at least this stand-in's where that is larger, is tokenized
    # with this stand-in instead (data/stand_in_bpe.py: the BPE, truncated where smaller, the family's special tokens
    # at its ids); "": none
    stand_in: str = ""
    # its torch side, imported when a model of it is parallelized (families/installs.load_modules): the dotted
    # module that registers what parallelize swaps in for its block and mixer ("": registered by hand)
    modules: str = ""
    # config fields that must be false for this trainer to run the family's layers as it counts them (Llama's
    # attention_bias, mlp_bias), each refused in one line
    refused_flags: tuple[str, ...] = ()
    # q_proj, k_proj and v_proj carry biases (Qwen2); o_proj has none
    qkv_bias: bool = False
    # a decoder layer's norms by name and its blocks ("attention", "mlp") in the order they run: Qwen3's pre-norm
    # layer; Gemma 3 norms each block's output too (the plan's parameter order, ZeRO-3 trace, norm time and memory)
    layer_order: tuple[str, ...] = ("input_norm", "attention", "post_attention_norm", "mlp")
    # the attention's nn.Linear names in module order (Phi-3 fuses q, k, v into qkv_proj) and LoRA's default
    # targets among them (PEFT's default for Qwen3: q_proj, v_proj)
    attention_linears: tuple[str, ...] = ATTENTION_LINEARS
    lora_default: tuple[str, ...] = LORA_DEFAULT_TARGETS
    # one qkv_proj of width q + 2 kv in place of q_proj, k_proj, v_proj (Phi-3)
    fused_qkv: bool = False
    # the attention's tensors (attention_params' names) in the order its module registers them, where that is not
    # its projections then its norms (Phi-3's registers o_proj before qkv_proj): the order of model.parameters(),
    # which ZeRO-3's partitions and optimizer sub-groups follow
    attention_registered: tuple[str, ...] = ()
    # q_norm / k_norm span the whole projection, all heads (OLMo 2: widths q and kv), not one head (Qwen3)
    qk_norm_whole: bool = False
    # a learned sink logit per query head in every softmax (gpt-oss: attention/kernels.sink_attention), which keeps
    # no attention output for the recompute (the plan keeps none)
    attention_sinks: bool = False
    # what the plan says it estimated for this family, as one note (the generic path's: model/generic.py)
    plan_note: str = ""
    # the MLP's output feeds the residual add alone (a pre-norm layer), so a recompute may skip a tiled MLP's
    # forward; False where that is not known (the generic path)
    mlp_output_unread: bool = True

    def layer_norms(self) -> tuple[str, ...]:
        """The decoder layer's own norms (hidden-wide RMSNorms), in the order they run."""
        return tuple(n for n in self.layer_order if n not in ("attention", "mlp"))

    def recompute_skips_mlp(self) -> bool:
        """Whether a checkpoint's recompute may skip a tiled MLP's forward (sharding.mlp_output_unused): only where its
        output feeds the residual add alone, whose backward does not read it; a norm after the MLP (Gemma 3's,
        OLMo 2's) reads it."""
        return self.mlp_output_unread and self.layer_order[-1] == "mlp"

    def attention_params(self, d: LayerDims) -> list[tuple[str, int]]:
        """q, (q_norm,) k, (k_norm,) v, o: the attention's modules in the order they run (a projection's bias right
        after its weight)."""
        h, q, k = d.hidden, d.q_width, d.kv_width
        if self.fused_qkv:
            return [("qkv", h * (q + 2 * k)), ("o", q * h)]
        if self.qk_norm_whole:
            return [("q", h * q), ("q_norm", q), ("k", h * k), ("k_norm", k), ("v", h * k), ("o", q * h)]
        if self.gated_attention:
            return [("q", h * 2 * q), ("q_norm", d.head_dim), ("k", h * k), ("k_norm", d.head_dim), ("v", h * k),
                    ("o", q * h)]
        if self.qk_norm:
            return [("q", h * q), ("q_norm", d.head_dim), ("k", h * k), ("k_norm", d.head_dim), ("v", h * k),
                    ("o", q * h)]
        if self.qkv_bias:
            return [("q", h * q), ("q_bias", q), ("k", h * k), ("k_bias", k), ("v", h * k), ("v_bias", k),
                    ("o", q * h)]
        return [("q", h * q), ("k", h * k), ("v", h * k), ("o", q * h)]

    def mlp_params(self, d: LayerDims) -> list[tuple[str, int]]:
        """The MLP's tensors in the order they are used (MlpBlock.params)."""
        return self.mlp.params(d)

    def lora_linears(self) -> tuple[str, ...]:
        """A decoder layer's nn.Linear modules, what LoRA can adapt ("all-linear"), in module order: the attention
        projections, then the MLP block's."""
        return self.attention_linears + (self.mixer.lora_linears if self.mixer else ()) + self.mlp.lora_linears

    def lora_targets(self, target_modules: Any) -> tuple[str, ...]:
        """The Linear names LoRA adapts, from target_modules as PEFT takes it (names, "all-linear", or None: the
        default); the plan counts these and PEFT gets them. A name this family has no Linear for is a
        ConfigError naming those it has."""
        linears = self.lora_linears()
        if target_modules is None:
            return self.lora_default
        if target_modules == "all-linear":
            return linears
        names = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
        unknown = [n for n in names if n not in linears]
        if unknown:
            raise ConfigError(f"lora_target_modules {', '.join(map(str, unknown))}: a {self.model_type} layer has "
                              f"no such Linear{self.mlp.lora_refusal}; target some of {', '.join(linears)}, or "
                              f"all-linear")
        return names

    def active_mlp_numel(self, d: LayerDims) -> int:
        """MLP parameters one token runs through (MlpBlock.active_numel)."""
        return self.mlp.active_numel(d)

    def mlp_row_width(self, d: LayerDims) -> int:
        """Intermediate values per token of the MLP, what the tile rules size by (MlpBlock.row_width)."""
        return self.mlp.row_width(d)

    def layer_dims(self, config: Any) -> LayerDims:
        """From a transformers config of this family."""
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        mixer = self.mixer.dims(config) if self.mixer is not None else {}
        return LayerDims(hidden=config.hidden_size, q_width=config.num_attention_heads * d,
                         kv_width=config.num_key_value_heads * d, head_dim=d, **self.mlp.dims(config), **mixer)

    def mixer_layers(self, config: Any) -> tuple[int, ...]:
        """The layers that run the family's mixer instead of attention (none without one)."""
        if self.mixer is None:
            return ()
        return tuple(i for i, t in enumerate(config.layer_types[:config.num_hidden_layers]) if t == self.mixer.kind)

    def windowed_layers(self, config: Any) -> tuple[tuple[int, ...], int]:
        """(the layers attending in a sliding window, its width): those whose layer_types entry is
        sliding_attention, or every layer of a config with a sliding_window and no layer_types (Mistral);
        ((), 0) without a window."""
        window = getattr(config, "sliding_window", None)
        if not window:
            return (), 0
        types = getattr(config, "layer_types", None)
        if types is None:
            return tuple(range(config.num_hidden_layers)), int(window)
        layers = tuple(i for i, t in enumerate(types[:config.num_hidden_layers]) if t == "sliding_attention")
        return layers, int(window) if layers else 0

    def check_config(self, config: Any) -> str | None:
        """Why this trainer cannot run a config of this family (None: it can): a layer type it has no Ulysses path
        for (attention, full or windowed, and the family's mixer are what it splits by head), a flag it refuses,
        or what its MLP block refuses."""
        known = ATTENTION_LAYER_TYPES + ((self.mixer.kind,) if self.mixer is not None else ())
        types = list(getattr(config, "layer_types", None) or ())[:config.num_hidden_layers]
        unknown = sorted({t for t in types if t not in known})
        if unknown:
            return (f"its layer type {unknown[0]!r} mixes along the sequence in a way this trainer has no Ulysses "
                    f"path for (a {self.model_type} layer may be {', '.join(known)}); it would train with wrong "
                    f"gradients under sequence parallelism, so it is refused")
        flags = [f for f in self.refused_flags if getattr(config, f, False)]
        if flags:
            return (f"{flags[0]} true is not supported for {self.model_type} (the trainer runs and plans its layers "
                    f"without it); use a checkpoint without it")
        return self.mlp.check_config(config)
