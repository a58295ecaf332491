"""`parallelize(model, state, cfg)` installs the mechanisms on an HF causal LM; `apply(model, plan)` sets them.

Order (each step relies on the ones before it):
  1. Ulysses attention: register the SP attention function and switch the model to it.
  2. Loss head: lm_head also returns the chunked (or plain) loss sum, never the L x V logits.
  3. Lean norms: every RMSNorm keeps only its input for backward, not fp32 copies (fused Triton kernel on
     CUDA where liger-kernel is installed).
  4. Tiled MLP: each decoder layer's MLP runs by sequence tiles; a sparse family's MoE block is replaced by
     levers/sparse_moe.SparseMoE (experts by tiles, router statistics for the load-balancing loss).
  5. Checkpointing (+ offload): each decoder layer keeps only its input (or, with checkpoint_every=k,
     every k-th layer does and backward rebuilds the rest), on device or in pinned host memory, and
     recomputes in backward; there the tiled MLP skips its forward (its backward recomputes each tile).
  6. The attention-output stash: kept outputs let the recompute skip the kernel.
Which layers offload, keep their attention outputs, and the thinning are set by `apply` from a plan
(`ulysses_trainer.plan.resolve_plan`, which the trainer runs once the engine holds the model states) or,
for fixed values in ParallelizeConfig, by `parallelize` itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..attention.stash import AttentionStash
from ..errors import ConfigError
from ..levers.host_pool import HostPool
from ..levers.lean_norm import resolve_norm_kernel, use_lean_norms
from ..levers.offload import LayerCheckpointer
from ..levers.sparse_moe import RouterStats, SparseMoE
from ..levers.tiled_mlp import TiledMLP
from ..parallel.state import ParallelState
from ..parallel.ulysses import UlyssesAttention
from ..plan.inputs import ModelShape, auto_num_tiles, choose_experts_implementation, default_mlp_tiles
from .families import family
from .loss_head import LossHead


@dataclass
class ParallelizeConfig:
    """The mechanisms, and lever values for a loop of your own. Defaults are the training config's; a lever
    left at `auto` is installed unset (no input offloaded, no attention output kept, every layer keeps its
    input) until `apply(model, plan)` sets it from a resolved plan."""

    attn_implementation: str = "auto"
    loss_type: str = "chunked_nll"
    loss_chunk_size: int = 256
    tiled_mlp: bool | int | str = "auto"  # False | True (auto_num_tiles) | tiles | "auto" (the shape rule)
    lean_norm: bool = True  # RMSNorms save their input only (levers/lean_norm.py)
    norm_kernel: str = "auto"  # their kernel: triton (Liger's fused RMSNorm) | torch | auto (triton where installed)
    gradient_checkpointing: bool = True
    checkpoint_every: int | str = "auto"  # keep every k-th layer's input; rebuild the others (levers/offload.py)
    activation_offload: bool | int | str = "auto"  # False | True (all kept inputs) | n first | "auto" (apply)
    # layers whose attention output + LSE are kept from the checkpoint's forward to skip the kernel in the
    # recompute (attention/stash.py): False | True (all layers) | n first layers | "auto" (apply)
    keep_attention_outputs: bool | int | str = "auto"
    # a sparse model's experts kernel (transformers' experts_implementation): eager | batched_mm | grouped_mm |
    # auto (plan.inputs.choose_experts_implementation)
    experts_implementation: str = "auto"
    host_memory_gb: float | None = None  # None: detected
    local_seq_len: int | None = None  # tokens per rank per row; needed for tiling decisions
    ranks_per_host: int = 1  # ranks sharing this host's RAM (splits the offload budget)


@dataclass(frozen=True)
class Levers:
    """What `apply` sets (a resolved plan has these fields too)."""

    checkpoint_every: int = 1
    offload_layers: tuple[int, ...] = ()
    kept_attention_layers: tuple[int, ...] = ()
    checkpoint_bytes_per_layer: int = 0  # > 0: pin the host pool for the offloaded inputs now
    tiles: int | None = None  # None: whatever parallelize installed


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    assert isinstance(layers, nn.ModuleList), "expected an HF causal LM with .model.layers (Qwen3, Llama...)"
    return layers


def mlp_tiles(setting: bool | int | str, local_seq_len: int | None, hidden: int, intermediate: int) -> int:
    """Tile count for the MLP (1 = untiled). Same on every rank: it depends on shapes only.
    auto: plan.inputs.default_mlp_tiles; True: plan.inputs.auto_num_tiles (the lever's own count)."""
    if setting is False or setting == 0:
        return 1
    if local_seq_len is None:
        return 1 if not isinstance(setting, int) or isinstance(setting, bool) else int(setting)
    if setting == "auto":
        return default_mlp_tiles(local_seq_len, intermediate)
    if setting is True:
        return auto_num_tiles(local_seq_len, hidden, intermediate)
    return int(setting)


class SequenceParallelCausalLM(nn.Module):
    """An HF causal LM under Ulysses SP. forward(shard inputs) -> fp32 sum of token NLLs on this rank.

    The caller divides by the number of valid tokens in the whole optimizer step (all ranks, all
    micro-steps) — see `ulysses_trainer.loss.step_token_count`.
    """

    def __init__(self, causal_lm: nn.Module, state: ParallelState, attention: UlyssesAttention,
                 checkpointer: LayerCheckpointer | None, tiles: int = 1, router_stats: RouterStats | None = None,
                 aux_loss_coef: float = 0.0):
        super().__init__()
        self.causal_lm = causal_lm
        self.state = state
        self.attention = attention
        self.checkpointer = checkpointer
        self.tiles = tiles
        # a sparse model's load-balancing loss (levers/sparse_moe.py): None without one; after each forward,
        # `aux_loss` holds it (over the whole sequence, the same on every SP rank) for the trainer to add
        # aux_loss_coef times (parallel/loss.aux_for_backward)
        self.router_stats = router_stats
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss: torch.Tensor | None = None

    @property
    def config(self):
        return self.causal_lm.config

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                real_rows: int | None = None) -> torch.Tensor:
        """`real_rows`: leading positions of each row that are not pads (parallel/sharding.Shard); the router
        statistics leave pads out."""
        stats = self.router_stats
        if stats is not None:
            b, s = input_ids.shape
            mask = None
            if real_rows is not None and real_rows < s:
                mask = (torch.arange(s, device=input_ids.device) < real_rows).float().repeat(b)  # [b * s]
            stats.begin(mask)
        out = self.causal_lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                   sp_cu_seqlens=cu_seqlens, sp_max_seqlen=max_seqlen)
        hidden = out.last_hidden_state
        if stats is not None:
            group = self.state.sp_group if self.state.sp_size > 1 else None
            hidden, self.aux_loss = stats.aux_loss(hidden, group)
        return self.causal_lm.lm_head(hidden, labels=labels)



def apply(model: SequenceParallelCausalLM, plan) -> None:
    """Set the levers parallelize installed: the thinning, the offloaded layer inputs (their pinned pool is
    allocated now when the plan gives the bytes, so a shortage is an error before step 1, not mid-run) and
    the layers keeping their attention outputs. `plan`: a resolved Plan (plan/resolve.py) or Levers."""
    ck, stash = model.checkpointer, model.attention.stash
    tiles = getattr(plan, "tiles", None)
    if tiles is not None and tiles != model.tiles:
        raise ValueError(f"the plan has {tiles} MLP tiles but parallelize installed {model.tiles}; tiles are "
                         f"installed with the model: pass tiled_mlp={tiles} to ParallelizeConfig")
    offload, kept = tuple(plan.offload_layers), tuple(plan.kept_attention_layers)
    if ck is None:
        if offload or kept or plan.checkpoint_every != 1:
            raise ValueError("activation offload, checkpoint_every > 1 and kept attention outputs need "
                             "gradient_checkpointing=True")
        return
    ck.configure(plan.checkpoint_every, offload)
    if offload and plan.checkpoint_bytes_per_layer > 0:
        ck.pool.allocate(plan.checkpoint_bytes_per_layer, len(offload))
    if stash is None:
        if kept:
            raise ValueError("kept attention outputs need keep_attention_outputs other than False at parallelize")
        return
    stash.set_layers(kept)


def parallelize(model: nn.Module, state: ParallelState, cfg: ParallelizeConfig) -> SequenceParallelCausalLM:
    """Apply SP attention, the loss head, lean norms, tiled MLP and checkpointing/offload, in that order."""
    c = model.config
    fam = family(getattr(c, "model_type", "qwen3"))
    layers = _decoder_layers(model)
    # 1. attention
    attention = UlyssesAttention(state, cfg.attn_implementation, c.num_attention_heads, c.num_key_value_heads)
    model.set_attn_implementation(attention.register())
    # 2. loss head
    model.lm_head = LossHead(model.lm_head, cfg.loss_type, cfg.loss_chunk_size)
    # 3. lean norms (before tiling and checkpointing, which only wrap what is there)
    if cfg.lean_norm:
        use_lean_norms(model, resolve_norm_kernel(cfg.norm_kernel))
    # 4. tiled MLP (dense), or the sparse block with its router statistics (tiled or not)
    d = fam.layer_dims(c)
    # the tile rules size by a row's intermediates (a sparse block: top_k experts' worth, ModelShape.mlp_row_width)
    tiles = mlp_tiles(cfg.tiled_mlp, cfg.local_seq_len, c.hidden_size, ModelShape.from_config(c).mlp_row_width)
    stats, coef = None, 0.0
    if fam.mlp_kind == "sparse":
        if getattr(c, "output_router_logits", False):
            stats, coef = RouterStats(d.experts, d.top_k), float(getattr(c, "router_aux_loss_coef", 0.0))
        for layer in layers:
            layer.mlp = SparseMoE(layer.mlp, tiles, stats, d.top_k, bool(c.norm_topk_prob))
        impl = choose_experts_implementation(cfg.experts_implementation)
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation(impl)
        elif impl != "eager":  # a transformers without the choice runs its loop
            raise ConfigError(f"experts_implementation {impl} needs a transformers with set_experts_implementation; "
                              f"use eager or upgrade transformers")
    elif tiles > 1:
        for layer in layers:
            layer.mlp = TiledMLP(layer.mlp, tiles)
    # 5. checkpointing (+ offload, set below or by apply)
    checkpointer = None
    if cfg.gradient_checkpointing:
        pool = HostPool(host_memory_gb=cfg.host_memory_gb, ranks_per_host=cfg.ranks_per_host)
        checkpointer = LayerCheckpointer(len(layers), [], pool)
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = True  # HF decoder layers call _gradient_checkpointing_func
            layer._gradient_checkpointing_func = checkpointer.for_layer(i)
        if tiles > 1:  # the recompute needs the tiled MLP's graph, not its output (TiledMLP.unused_output)
            checkpointer.recompute_context = lambda i: layers[i].mlp.unused_output()
    # 6. the stash for kept attention outputs (only a recompute can reuse them)
    keep = cfg.keep_attention_outputs
    if keep not in (False, 0) and cfg.gradient_checkpointing:
        attention.stash = AttentionStash()
    model.train()
    sp_model = SequenceParallelCausalLM(model, state, attention, checkpointer, tiles, stats, coef)
    apply(sp_model, levers_of(cfg, len(layers)))
    return sp_model


def levers_of(cfg: ParallelizeConfig, num_layers: int) -> Levers:
    """The fixed levers of a ParallelizeConfig (`auto` ones unset: left to apply(plan)). ValueError/TypeError
    for values that cannot run."""
    every = 1 if cfg.checkpoint_every == "auto" else cfg.checkpoint_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise TypeError(f"checkpoint_every must be an int >= 1 or 'auto', got {cfg.checkpoint_every!r}")
    saved = list(range(0, num_layers, every))
    off, keep = cfg.activation_offload, cfg.keep_attention_outputs
    if not cfg.gradient_checkpointing:
        for name, v, off_value in (("activation_offload", off, (False, 0, "auto")), ("checkpoint_every", every, (1,)),
                                   ("keep_attention_outputs", keep, (False, 0, "auto"))):
            if v not in off_value:
                raise ValueError(f"{name} needs gradient_checkpointing=True (it acts on the recompute), got {v!r}")
    return Levers(checkpoint_every=every, offload_layers=tuple(saved[:_count(off, "activation_offload", len(saved))]),
                  kept_attention_layers=tuple(range(_count(keep, "keep_attention_outputs", num_layers))))


def _count(value: bool | int | str, name: str, most: int) -> int:
    """False / "auto" -> 0, True -> most, n -> n (0..most)."""
    if value is True:
        return most
    if value is False or value == "auto":
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ValueError(f"{name}={value!r}: give false, true, auto or a layer count 0..{most}")
    return value
