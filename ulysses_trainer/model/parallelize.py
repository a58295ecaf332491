"""`parallelize(model, state, setup)` installs the mechanisms on an HF causal LM; `apply(model, setup)` sets them.

Order (each step relies on the ones before it):
  1. Ulysses attention: register the SP attention function and switch the model to it; a Qwen3 attention module
     applies RoPE in one pass over q and k (levers/rope.py).
  2. Loss head: lm_head also returns the chunked (or plain) loss sum, never the L x V logits.
  3. Lean norms: every RMSNorm keeps only its input for backward, not fp32 copies (fused Triton kernel on
     CUDA where liger-kernel is installed).
  4. The family's MLP block (families/; what is swapped in: its folder's modules.py): each decoder layer's MLP runs by
     sequence tiles (a gated MLP: levers/tiled_mlp.TiledMLP; Qwen3-MoE's block: levers/sparse_moe.SparseMoE,
     experts by tiles, router statistics for the load-balancing loss).
  5. Checkpointing (+ offload): each decoder layer keeps only its input (or, with checkpoint_every=k,
     every k-th layer does and backward rebuilds the rest), on device or in pinned host memory, and
     recomputes in backward; there the tiled MLP skips its forward (its backward recomputes each tile).
  6. The attention-output stash: kept outputs let the recompute skip the kernel.
`setup` is a ModelSetup (vocabulary/model_setup.py: the kernels and the bound lever record). The trainer takes it
from its resolved plan (plan/resolve.py) and sets the levers with `apply` once the engine holds the model states;
a loop of your own passes a ParallelizeConfig, whose `auto` values are decided once, by ParallelizeConfig.resolve.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Any

from torch import nn

from ..attention.kernels import available_kernels
from ..attention.stash import AttentionStash
from ..config import FIELDS
from ..errors import ConfigError, close_name
from ..families import family
from ..families.installs import installer, load_modules
from ..levers.host_pool import HostPool
from ..levers.lean_norm import available_norm_kernels, use_lean_norms
from ..levers.recompute import LayerRecompute
from ..levers.rope import use_fused_rope
from ..parallel.integrations import unregister_attention
from ..parallel.state import ParallelState
from ..parallel.ulysses import UlyssesAttention, _no_mask
from ..probe import installed_deltanet_kernels
from ..vocabulary.lever_settings import LEVER_FIELDS, Levers, decode_levers
from ..vocabulary.model_setup import ModelSetup
from ..vocabulary.names import auto_num_tiles, choose_kernels, default_mlp_tiles
from .loss_head import LOSS_TYPES, LossHead
from .row_rope import use_row_rope
from .sp_model import SequenceParallelCausalLM
from .undo import ModelSnapshot, use_private_config

__all__ = ["ParallelizeConfig", "SequenceParallelCausalLM", "apply", "parallelize", "unparallelize"]


# the training config's fields a loop of your own sets besides the levers (names, values, defaults: TrainConfig's)
MECHANISM_FIELDS = ("attn_implementation", "loss_type", "loss_chunk_size", "lean_norm", "norm_kernel",
                    "experts_implementation", "deltanet_kernel", "host_memory_gb")
# the lever fields it sets (its optimizer is its own: no optimizer_offload)
OWN_LOOP_LEVERS = tuple(n for n in LEVER_FIELDS if n != "optimizer_offload")


@dataclass(frozen=True, init=False)
class ParallelizeConfig:
    """The settings of a loop of your own, given by the training config's names with its values and defaults
    (`ParallelizeConfig(tiled_mlp=4, local_seq_len=L // sp)`). The levers are decoded once, by the trainer's
    decoder, into `levers` (vocabulary/lever_settings.Levers, None = auto); a lever left auto is installed unset
    (no input offloaded, no attention output kept, every layer keeps its input) until `apply(model, setup)` sets it
    from a resolved plan. The kernels and the loss stay as given: `resolve` decides their `auto`."""

    levers: Levers  # the memory levers decoded (gradient_checkpointing ... tiled_mlp; None = auto)
    attn_implementation: str  # attention kernel, or auto (the fastest installed)
    loss_type: str
    loss_chunk_size: int
    lean_norm: bool  # RMSNorms save their input only (levers/lean_norm.py)
    norm_kernel: str  # triton (Liger's fused RMSNorm) | torch | auto (triton where installed)
    experts_implementation: str  # a sparse model's experts kernel: eager | batched_mm | grouped_mm | auto
    deltanet_kernel: str  # a Gated DeltaNet layer's rule kernel (Qwen3.5): fla | torch | auto
    host_memory_gb: float | None  # None: detected
    local_seq_len: int | None  # tokens per rank per row; needed for tiling decisions
    ranks_per_node: int  # ranks sharing this host's RAM (splits the offload budget)

    def __init__(self, *, local_seq_len: int | None = None, ranks_per_node: int = 1, levers: Levers | None = None,
                 **settings: Any) -> None:
        """settings: MECHANISM_FIELDS and OWN_LOOP_LEVERS by name (the rest at the training config's defaults);
        levers: a decoded record in place of the lever fields. ConfigError for a lever value that cannot run."""
        known = [*MECHANISM_FIELDS, *OWN_LOOP_LEVERS]
        for name in settings:
            if name not in known:
                close = close_name(name, known)
                raise TypeError(f"ParallelizeConfig got an unexpected keyword argument {name!r}; "
                                + (f"did you mean {close!r}?" if close else f"it takes {', '.join(known)}"))
        given = [n for n in OWN_LOOP_LEVERS if n in settings]
        if levers is not None and given:
            raise TypeError(f"ParallelizeConfig takes levers= or the lever fields, not both ({given[0]} given)")
        values = {n: settings.get(n, FIELDS[n].default) for n in (*MECHANISM_FIELDS, *OWN_LOOP_LEVERS)}
        set_field = object.__setattr__  # frozen: set once, here
        set_field(self, "levers", levers or decode_levers(SimpleNamespace(**values)))
        for name in MECHANISM_FIELDS:
            set_field(self, name, values[name])
        set_field(self, "local_seq_len", local_seq_len)
        set_field(self, "ranks_per_node", ranks_per_node)

    def resolve(self, config: Any) -> ModelSetup:
        """The ModelSetup of these settings for an HF model config: `auto` decided with the kernels installed
        here and the tile rules. ConfigError for values that cannot run."""
        fx = self._bound(config)
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type {self.loss_type!r} is unknown; use one of {', '.join(LOSS_TYPES)}")
        # the planner's one kernel decision (vocabulary/names.choose_kernels), with the kernels installed here
        kernels = choose_kernels(self.attn_implementation, self.norm_kernel, self.experts_implementation,
                                 self.lean_norm, tuple(available_kernels()), tuple(available_norm_kernels()),
                                 self.deltanet_kernel, installed_deltanet_kernels())
        width = _row_width(config)
        auto_tiles = default_mlp_tiles(self.local_seq_len, width) if self.local_seq_len else 1
        # auto levers are installed unset until apply (ModelSetup.of); auto tiles: the shape rule
        return ModelSetup.of(replace(fx, tiled_mlp=auto_tiles if fx.tiled_mlp is None else fx.tiled_mlp),
                             config.num_hidden_layers, **asdict(kernels),
                             loss_type=self.loss_type, loss_chunk_size=self.loss_chunk_size, lean_norm=self.lean_norm,
                             host_memory_gb=self.host_memory_gb, ranks_per_node=self.ranks_per_node)

    def _bound(self, config: Any) -> Levers:
        """The levers bound to the HF model config (None = auto): `tiled_mlp: true` is the lever's own count
        for local_seq_len tokens (1 without it)."""
        def true_tiles() -> int:
            if self.local_seq_len is None:
                return 1
            return auto_num_tiles(self.local_seq_len, config.hidden_size, _row_width(config))

        return self.levers.bind(config.num_hidden_layers, true_tiles)


def _row_width(config: Any) -> int:
    """The MLP's intermediate values per token that the tile rules size by (a sparse block: top_k experts')."""
    fam = family(getattr(config, "model_type", "qwen3"))
    return fam.mlp_row_width(fam.layer_dims(config))


def apply(model: SequenceParallelCausalLM, setup: ModelSetup) -> None:
    """Set the levers parallelize installed: the thinning, the offloaded layer inputs (their pinned pool is
    allocated now when the plan gives the bytes, so a shortage is an error before step 1, not mid-run) and
    the layers keeping their attention outputs. `setup`: a ModelSetup (a resolved Plan's: Plan.model_setup)."""
    ck, stash = model.checkpointer, model.attention.stash
    tiles, installed = setup.levers.tiled_mlp, model.setup.levers.tiled_mlp
    if tiles != installed:
        raise ValueError(f"the plan has {tiles} MLP tiles but parallelize installed {installed}; tiles are "
                         f"installed with the model: pass tiled_mlp={tiles} to ParallelizeConfig")
    offload, kept = tuple(setup.offload_layers), tuple(setup.kept_attention_layers)
    if ck is None:
        if offload or kept or setup.checkpoint_every != 1:
            raise ValueError("activation offload, checkpoint_every > 1 and kept attention outputs need "
                             "gradient_checkpointing=True")
        return
    ck.configure(setup.checkpoint_every, offload)
    if offload and setup.checkpoint_bytes_per_layer > 0:
        ck.pool.allocate(setup.checkpoint_bytes_per_layer, len(offload))
    if stash is None:
        if kept:
            raise ValueError("kept attention outputs need keep_attention_outputs other than False at parallelize")
        return
    stash.set_layers(kept)


def _check(model: nn.Module, setup: ModelSetup) -> nn.ModuleList:
    """Everything parallelize needs of the model and the setup, checked before it changes anything: its decoder
    layers, a bias-free lm_head, the loss and the stash's need; ConfigError / TypeError naming the fix."""
    if isinstance(model, SequenceParallelCausalLM) or getattr(model, _PARALLELIZED, False):
        raise TypeError("this model is already parallelized; parallelize the stock model once "
                        "(ulysses_trainer.unparallelize gives it back)")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        raise TypeError(f"parallelize takes an HF causal LM with .model.layers and an nn.Linear lm_head (the "
                        f"architectures of docs/models.md), got {type(model).__name__}")
    if model.lm_head.bias is not None:
        raise TypeError("an lm_head with a bias is not supported (the chunked loss reads its weight only)")
    if setup.loss_type not in LOSS_TYPES:
        raise ConfigError(f"loss_type {setup.loss_type!r} is unknown; use one of {', '.join(LOSS_TYPES)}")
    if setup.loss_chunk_size < 1:
        raise ConfigError(f"loss_chunk_size must be >= 1, got {setup.loss_chunk_size}")
    if setup.attention_stash and not setup.levers.gradient_checkpointing:
        raise ConfigError("keeping attention outputs needs gradient_checkpointing (only a recompute reuses them): "
                          "set gradient_checkpointing true or keep_attention_outputs false")
    return layers


_PARALLELIZED = "_ulysses_parallelized"  # set on the HF model while it is parallelized


def parallelize(model: nn.Module, state: ParallelState,
                setup: ModelSetup | ParallelizeConfig) -> SequenceParallelCausalLM:
    """Apply SP attention, the loss head, lean norms, tiled MLP and checkpointing/offload, in that order.

    Every input is checked before the model is changed (ConfigError / TypeError naming the fix); the caller's
    config object is never changed (the model runs on a private copy); `unparallelize` (or a failure half-way)
    puts the model back as it was."""
    # a loop of your own's config becomes the ModelSetup it names (its auto decided here); from here on `setup` is one
    setup = setup.resolve(model.config) if isinstance(setup, ParallelizeConfig) else setup
    layers = _check(model, setup)
    c = model.config
    fam = family(getattr(c, "model_type", "qwen3"))
    load_modules(fam)  # its torch side registers what is swapped in
    installs = (installer(fam.mlp), installer(fam.mixer) if fam.mixer is not None else None)  # before any change
    attention = UlyssesAttention(state, setup.attn_implementation, c.num_attention_heads, c.num_key_value_heads)
    snapshot = ModelSnapshot(model)  # before any change: what unparallelize restores
    try:
        use_private_config(model)
        sp_model = _install(model, layers, state, setup, fam, installs, attention)
    except BaseException:
        snapshot.restore()
        unregister_attention(attention.name, attention, _no_mask)
        raise
    sp_model.snapshot = snapshot
    setattr(model, _PARALLELIZED, True)
    return sp_model


def _install(model: nn.Module, layers: nn.ModuleList, state: ParallelState, setup: ModelSetup, fam: Any,
             installs: tuple[Any, Any], attention: UlyssesAttention) -> SequenceParallelCausalLM:
    # 1. attention (on the model's private config: use_private_config), and the family's other token mixer where
    # it has one (Qwen3.5: Gated DeltaNet, split by head)
    model.set_attn_implementation(attention.register(model))
    install_mlp, install_mixer = installs
    if install_mixer is not None:
        install_mixer(fam.mixer, layers, state, setup)
    use_fused_rope(model)  # RoPE in one pass over q and k (Triton on CUDA; HF's ops elsewhere)
    use_row_rope(model, state)  # LongRoPE / dynamic: frequencies chosen on the whole row, as one process does
    # 2. loss head
    model.lm_head = LossHead(model.lm_head, setup.loss_type, setup.loss_chunk_size,
                             getattr(model.config, "final_logit_softcapping", None),  # Gemma's, where set
                             float(getattr(model.config, "logits_scaling", None) or 1.0))  # Granite's head divides
    # 3. lean norms (before tiling and checkpointing, which only wrap what is there)
    if setup.lean_norm:
        use_lean_norms(model, setup.norm_kernel, fam.norm_offset, fam.norm_fp32_weight)
    # 4. the family's MLP block: tiled, and its load-balancing statistics where it has them (sparse: router)
    tiles = setup.levers.tiled_mlp
    stats, coef = install_mlp(fam.mlp, model, layers, tiles, setup.experts_implementation)
    # 5. checkpointing (+ offload, set by apply)
    checkpointer = None
    if setup.levers.gradient_checkpointing:
        pool = HostPool(host_memory_gb=setup.host_memory_gb, ranks_per_node=setup.ranks_per_node,
                        held_slots=setup.host_held_slots)
        # a tiled MLP's recompute needs its graph, not its output: skipped where the family allows it
        skips = tiles > 1 and fam.recompute_skips_mlp()
        checkpointer = LayerRecompute(len(layers), [], pool, recompute_skips_mlp=skips)
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = True  # HF decoder layers call _gradient_checkpointing_func
            layer._gradient_checkpointing_func = checkpointer.for_layer(i)
    # 6. the stash for kept attention outputs (only a recompute can reuse them: checked in _check)
    if setup.attention_stash:  # decided once (vocabulary/lever_settings.Levers.attention_stash)
        attention.stash = AttentionStash()
    model.train()
    sp_model = SequenceParallelCausalLM(model, state, attention, checkpointer, setup, stats, coef)
    apply(sp_model, setup)
    return sp_model


def unparallelize(model: SequenceParallelCausalLM) -> nn.Module:
    """The stock HF model back from what parallelize returned: its own modules (the wrappers dropped; they share
    the parameters, so trained weights stay), its config object (the caller's, as it was), its checkpointing
    flags and training mode, and transformers' attention registry without the SP entry. The wrapper cannot run
    afterwards. For a model no DeepSpeed engine partitions: before deepspeed.initialize, or without an engine;
    for the weights an engine trained, save `stock_state_dict(engine)` and load it into a stock model."""
    if not isinstance(model, SequenceParallelCausalLM):
        raise TypeError(f"unparallelize takes what parallelize returned, got {type(model).__name__}")
    if model._undone:
        return model.causal_lm
    partitioned = [n for n, p in model.named_parameters()
                   if getattr(getattr(p, "ds_status", None), "name", "") == "NOT_AVAILABLE"]
    if partitioned:
        raise RuntimeError(f"the parameters are partitioned by a DeepSpeed ZeRO-3 engine ({partitioned[0]}, ...): "
                           f"the stock model would hold no weights; save stock_state_dict(engine) and load it into a "
                           f"stock model instead")
    model.snapshot.restore()
    unregister_attention(model.attention.name, model.attention, _no_mask)
    hf = model.causal_lm
    hf.__dict__.pop(_PARALLELIZED, None)
    model._undone = True
    return hf

