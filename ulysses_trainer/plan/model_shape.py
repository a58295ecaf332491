"""A model's shape as the planner reads it: its dimensions, its family (module order, MLP block, q/k norms) and the
parameter facts derived from them (plan/inputs.py's Settings are the run's side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..families import Family, LayerDims, family
from ..vocabulary.names import param_persistence_threshold, prefetch_bucket_size, reduce_bucket_size


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the memory model needs, the model's family (families/: module order, MLP block,
    q/k norms), and the parameter facts derived from them once, when the shape is made: the stages of the plan
    read these fields, none re-derives them. `intermediate` is the dense MLP's width, or one expert's for a
    sparse family."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool
    qk_norm: bool = True
    model_type: str = "qwen3"
    experts: int = 0  # sparse MLP: experts per layer, and how many each token runs through
    top_k: int = 0
    shared_expert: int = 0  # a sparse block's always-on shared expert width (0: none)
    # the layers running the family's token mixer instead of attention (Qwen3.5: 3 of every 4 run Gated
    # DeltaNet), and the mixer's heads and widths (LayerDims)
    mixer_layers: tuple[int, ...] = ()
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 0
    # the layers attending in a sliding window of `sliding_window` tokens (Mistral: all; Qwen2, Ministral, Gemma 3:
    # those layer_types says); the time terms count them as the block path runs them (attention_time.windowed_seconds),
    # the memory terms as full causal attention (an over-estimate)
    windowed_layers: tuple[int, ...] = ()
    sliding_window: int = 0
    # the config soft-caps the final logits (Gemma's final_logit_softcapping): the chunked loss keeps a chunk's tanh
    final_logit_softcap: bool = False
    # ---- derived in __post_init__ (also after dataclasses.replace), never passed in
    family: Family = field(init=False, repr=False, compare=False)
    dims: LayerDims = field(init=False, repr=False, compare=False)
    # (name, numel) of one decoder layer's parameters: the family's attention (dense Qwen3: q, k, v, o, q_norm,
    # k_norm), its MLP (gate, up, down; sparse: router, experts' gate_up and down), then its layer norms
    # (Family.layer_order: input_layernorm and post_attention_layernorm; Gemma 3 two more)
    layer_params: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)
    # tensor name -> numel: a layer's (as in layer_params) plus embed, lm_head and final_norm
    numels: dict[str, int] = field(init=False, repr=False, compare=False)
    # every parameter tensor of the causal LM: embedding, the layers, final norm, untied lm_head
    param_numels: tuple[int, ...] = field(init=False, repr=False, compare=False)
    num_params: int = field(init=False, repr=False, compare=False)  # N, tied embeddings counted once
    # parameters of one layer that one token's forward runs through (a sparse MLP: the router and top_k experts)
    active_layer_numel: int = field(init=False, repr=False, compare=False)
    # parameters one token's forward uses (tied embeddings counted once): N for a dense model
    num_active_params: int = field(init=False, repr=False, compare=False)
    # parameters in a matmul per token (linear weights of the layers, active experts, lm_head): train/metrics.py
    matmul_params: int = field(init=False, repr=False, compare=False)
    mlp_row_width: int = field(init=False, repr=False, compare=False)  # what the MLP tile rules size by
    # attending_before[i]: layers below i that run attention (all of them without a mixer): the ones that can keep
    # an attention output for the recompute
    attending_before: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # the layer's tensors in the order its modules use them (ZeRO-3's trace), and of them the MLP's used once a
    # pass and once a tile (MlpBlock.trace_groups)
    forward_order: tuple[str, ...] = field(init=False, repr=False, compare=False)
    # each layer's own order (a mixer layer's differs from an attention layer's): what the ZeRO-3 trace and the
    # gradient buckets walk
    layer_orders: tuple[tuple[str, ...], ...] = field(init=False, repr=False, compare=False)
    mlp_once: tuple[str, ...] = field(init=False, repr=False, compare=False)
    mlp_tiled: tuple[str, ...] = field(init=False, repr=False, compare=False)
    # what ZeRO-3's "auto" sizes stand for with this hidden size (names.ZERO_AUTO_SIZES), in elements
    auto_reduce_bucket: int = field(init=False, repr=False, compare=False)
    auto_prefetch_bucket: int = field(init=False, repr=False, compare=False)
    auto_persistence_threshold: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fam = family(self.model_type)
        d = LayerDims(hidden=self.hidden, intermediate=self.intermediate, q_width=self.heads * self.head_dim,
                      kv_width=self.kv_heads * self.head_dim, head_dim=self.head_dim, experts=self.experts,
                      top_k=self.top_k, linear_k_heads=self.linear_k_heads, linear_v_heads=self.linear_v_heads,
                      linear_k_dim=self.linear_k_dim, linear_v_dim=self.linear_v_dim, linear_conv=self.linear_conv,
                      shared_expert=self.shared_expert)
        attention, mlp = fam.attention_params(d), fam.mlp_params(d)
        norms = tuple((name, self.hidden) for name in fam.layer_norms())  # Qwen3: input, post-attention
        registered = fam.attention_registered
        layer = (*sorted(attention, key=(lambda kv: registered.index(kv[0])) if registered else  # the module's order
                         (lambda kv: kv[0].endswith("_norm"))),  # projections, then q/k norms
                 *mlp, *norms)
        mixed = set(self.mixer_layers)
        mixer = fam.mixer.params(d) if fam.mixer is not None and mixed else []
        mixer_layer = (*mixer, *mlp, *norms)
        kinds = [mixer_layer if i in mixed else layer for i in range(self.layers)]
        # the per-layer terms (memory, ZeRO-3 trace) read the larger of the two kinds: the worst layer
        mixer_first = bool(mixed) and sum(n for _, n in mixer_layer) > sum(n for _, n in layer)
        embed = self.vocab * self.hidden
        head = () if self.tied_embeddings else (embed,)
        every = (embed, *[n for kind in kinds for _, n in kind], self.hidden, *head)
        n_mixer, n_attn = len(mixed), self.layers - len(mixed)
        mixer_active = sum(n for _, n in mixer)
        mixer_linear = fam.mixer.linear_numel(d) if mixer else 0
        # one layer's average over the kinds, so that layers x active is the model's total
        active = (n_attn * sum(n for _, n in attention) + n_mixer * mixer_active) / self.layers \
            + fam.active_mlp_numel(d) + len(norms) * self.hidden
        linear = n_attn * sum(n for name, n in attention if not name.endswith(("_norm", "_bias"))) \
            + n_mixer * mixer_linear \
            + self.layers * fam.active_mlp_numel(d)
        once, tiled = fam.mlp.trace_groups(d)
        token_mixer = mixer if mixer_first else attention
        blocks = lambda names: {"attention": [n for n, _ in names], "mlp": [*once, *tiled]}  # noqa: E731
        order = lambda names: tuple(n for part in fam.layer_order  # noqa: E731
                                    for n in blocks(names).get(part, [part]))
        derived = {
            "family": fam, "dims": d, "layer_params": mixer_layer if mixer_first else layer,
            "numels": {**dict(layer), **dict(mixer), "embed": embed, "lm_head": embed, "final_norm": self.hidden},
            "param_numels": every, "num_params": sum(every), "active_layer_numel": active,
            "num_active_params": round(embed + self.layers * active + self.hidden + sum(head)),
            "matmul_params": linear + embed, "mlp_row_width": fam.mlp_row_width(d),
            "attending_before": tuple(sum(1 for j in range(i) if j not in mixed) for i in range(self.layers + 1)),
            "forward_order": order(token_mixer),
            "layer_orders": tuple(order(mixer if i in mixed else attention) for i in range(self.layers)),
            "mlp_once": tuple(once), "mlp_tiled": tuple(tiled),
            "auto_reduce_bucket": reduce_bucket_size(self.hidden),
            "auto_prefetch_bucket": prefetch_bucket_size(self.hidden),
            "auto_persistence_threshold": param_persistence_threshold(self.hidden)}
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config of a supported family (families/)."""
        fam = family(getattr(config, "model_type", "qwen3"))
        d = fam.layer_dims(config)
        windowed, window = fam.windowed_layers(config)
        return cls(vocab=config.vocab_size, hidden=d.hidden, intermediate=d.intermediate,
                   layers=config.num_hidden_layers, heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads, head_dim=d.head_dim,
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)), qk_norm=fam.qk_norm,
                   model_type=fam.model_type, experts=d.experts, top_k=d.top_k, shared_expert=d.shared_expert,
                   mixer_layers=fam.mixer_layers(config), linear_k_heads=d.linear_k_heads,
                   linear_v_heads=d.linear_v_heads, linear_k_dim=d.linear_k_dim, linear_v_dim=d.linear_v_dim,
                   linear_conv=d.linear_conv, windowed_layers=windowed, sliding_window=window,
                   final_logit_softcap=bool(getattr(config, "final_logit_softcapping", None)))

    @classmethod
    def preset(cls, name: str) -> ModelShape:
        from ..families.presets import preset_config

        return cls.from_config(preset_config(name))

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim
