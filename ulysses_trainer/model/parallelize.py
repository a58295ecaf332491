"""`parallelize(model, state, plan)` installs the mechanisms on an HF causal LM; `apply(model, plan)` sets them.

Order (each step relies on the ones before it):
  1. Ulysses attention: register the SP attention function and switch the model to it; a Qwen3 attention module
     applies RoPE in one pass over q and k (levers/rope.py).
  2. Loss head: lm_head also returns the chunked (or plain) loss sum, never the L x V logits.
  3. Lean norms: every RMSNorm keeps only its input for backward, not fp32 copies (fused Triton kernel on
     CUDA where liger-kernel is installed).
  4. The family's MLP block (model/families/): each decoder layer's MLP runs by sequence tiles (a gated MLP:
     levers/tiled_mlp.TiledMLP; Qwen3-MoE's block: levers/sparse_moe.SparseMoE, experts by tiles, router
     statistics for the load-balancing loss).
  5. Checkpointing (+ offload): each decoder layer keeps only its input (or, with checkpoint_every=k,
     every k-th layer does and backward rebuilds the rest), on device or in pinned host memory, and
     recomputes in backward; there the tiled MLP skips its forward (its backward recomputes each tile).
  6. The attention-output stash: kept outputs let the recompute skip the kernel.
`plan` is a ModelPlan (model_plan.py): every value concrete. The trainer takes it from its resolved plan
(plan/resolve.py) and sets the levers with `apply` once the engine holds the model states; a loop of your own
passes a ParallelizeConfig, whose `auto` values are decided once, by ParallelizeConfig.resolve.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..attention.deltanet import available_deltanet_kernels
from ..attention.kernels import available_kernels
from ..attention.stash import AttentionStash
from ..config import FIELDS
from ..lever_settings import Fixed, decode_levers
from ..levers.host_pool import HostPool
from ..levers.lean_norm import available_norm_kernels, use_lean_norms
from ..levers.recompute import LayerRecompute
from ..levers.rope import use_fused_rope
from ..levers.sparse_moe import RouterStats
from ..levers.tiled_mlp import TiledMLP
from ..model_plan import ModelPlan
from ..names import (
    auto_num_tiles,
    choose_deltanet_kernel,
    choose_experts_implementation,
    choose_kernel,
    choose_norm_kernel,
    default_mlp_tiles,
)
from ..parallel.state import ParallelState
from ..parallel.ulysses import UlyssesAttention
from .families import family
from .loss_head import LossHead


def _default(name: str) -> Any:
    """The training config's default for a field of the same name (one copy of each default)."""
    return field(default=FIELDS[name].default)


@dataclass
class ParallelizeConfig:
    """The mechanisms and lever values for a loop of your own, with the training config's names and defaults.
    A lever left at `auto` is installed unset (no input offloaded, no attention output kept, every layer keeps
    its input) until `apply(model, plan)` sets it from a resolved plan."""

    attn_implementation: str = _default("attn_implementation")
    loss_type: str = _default("loss_type")
    loss_chunk_size: int = _default("loss_chunk_size")
    tiled_mlp: bool | int | str = _default("tiled_mlp")  # False | True (auto_num_tiles) | tiles | "auto" (the rule)
    lean_norm: bool = _default("lean_norm")  # RMSNorms save their input only (levers/lean_norm.py)
    norm_kernel: str = _default("norm_kernel")  # triton (Liger's fused RMSNorm) | torch | auto (triton where installed)
    gradient_checkpointing: bool = _default("gradient_checkpointing")
    checkpoint_every: int | str = _default("checkpoint_every")  # keep every k-th layer's input; rebuild the others
    activation_offload: bool | int | str = _default("activation_offload")  # False | True (all kept) | n | "auto"
    # layers whose attention output + LSE are kept from the checkpoint's forward to skip the kernel in the
    # recompute (attention/stash.py): False | True (all layers) | n first layers | "auto" (apply)
    keep_attention_outputs: bool | int | str = _default("keep_attention_outputs")
    # a sparse model's experts kernel (transformers' experts_implementation): eager | batched_mm | grouped_mm | auto
    experts_implementation: str = _default("experts_implementation")
    # a Gated DeltaNet layer's rule kernel (Qwen3.5): fla | torch | auto (fla where installed on a GPU)
    deltanet_kernel: str = _default("deltanet_kernel")
    host_memory_gb: float | None = _default("host_memory_gb")  # None: detected
    local_seq_len: int | None = None  # tokens per rank per row; needed for tiling decisions
    ranks_per_host: int = 1  # ranks sharing this host's RAM (splits the offload budget)

    def resolve(self, config: Any) -> ModelPlan:
        """The ModelPlan of these settings for an HF model config: `auto` decided with the kernels installed
        here and the tile rules. ConfigError for values that cannot run."""
        fx = self.levers(config)
        norm = choose_norm_kernel(self.norm_kernel, tuple(available_norm_kernels())) if self.lean_norm else "torch"
        width = _row_width(config)
        auto_tiles = default_mlp_tiles(self.local_seq_len, width) if self.local_seq_len else 1
        return replace(_fixed_levers(fx, config.num_hidden_layers),
                       kernel=choose_kernel(self.attn_implementation, tuple(available_kernels())),
                       loss_type=self.loss_type, loss_chunk_size=self.loss_chunk_size,
                       tiles=auto_tiles if fx.tiles is None else fx.tiles,
                       experts_implementation=choose_experts_implementation(self.experts_implementation),
                       deltanet_kernel=choose_deltanet_kernel(self.deltanet_kernel,
                                                              tuple(available_deltanet_kernels())),
                       lean_norm=self.lean_norm, norm_kernel=norm, gradient_checkpointing=self.gradient_checkpointing,
                       host_memory_gb=self.host_memory_gb, ranks_per_host=self.ranks_per_host)

    def levers(self, config: Any) -> Fixed:
        """The levers decoded (lever_settings.decode_levers, the trainer's decoder) and bound to the HF model
        config: None = auto. `tiled_mlp: true` is the lever's own count for local_seq_len tokens (1 without it)."""
        def true_tiles() -> int:
            if self.local_seq_len is None:
                return 1
            return auto_num_tiles(self.local_seq_len, config.hidden_size, _row_width(config))

        return decode_levers(self).bind(config.num_hidden_layers, true_tiles)


def _row_width(config: Any) -> int:
    """The MLP's intermediate values per token that the tile rules size by (a sparse block: top_k experts')."""
    fam = family(getattr(config, "model_type", "qwen3"))
    return fam.mlp_row_width(fam.layer_dims(config))


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    assert isinstance(layers, nn.ModuleList), "expected an HF causal LM with .model.layers (Qwen3, Llama...)"
    return layers


class SequenceParallelCausalLM(nn.Module):
    """An HF causal LM under Ulysses SP. forward(shard inputs) -> fp32 sum of token NLLs on this rank.

    The caller divides by the number of valid tokens in the whole optimizer step (all ranks, all
    micro-steps) — see `ulysses_trainer.loss.step_token_count`.
    """

    def __init__(self, causal_lm: nn.Module, state: ParallelState, attention: UlyssesAttention,
                 checkpointer: LayerRecompute | None, tiles: int = 1, router_stats: RouterStats | None = None,
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
        self._tiled = [m for m in causal_lm.modules() if isinstance(m, TiledMLP)]  # they leave pads out

    @property
    def config(self):
        return self.causal_lm.config

    def mark_pads(self, shape: tuple[int, ...], real_rows: int | tuple[int, ...] | None) -> None:
        """Tell the tiled MLPs which rows of the next batch [b, s] are pads (left out of their tiles): kept until
        the next batch, for the checkpoint's recompute and the backward."""
        b, s = shape
        rows = tuple(real_rows) if isinstance(real_rows, (tuple, list)) else (real_rows,) * b
        spans = None
        if real_rows is not None and min(rows) < s:
            spans = tuple((i * s, i * s + n) for i, n in enumerate(rows) if n > 0)  # over [b*s] rows
        for m in self._tiled:
            m.real_spans = (b * s, spans)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                real_rows: int | tuple[int, ...] | None = None, buckets: torch.Tensor | None = None,
                num_buckets: int = 0, pad_spans: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        """`real_rows`: leading positions of each row that are not pads, one count for all rows or one per
        row (parallel/sharding.Shard); the router statistics leave pads out. With `buckets` (labels' shape, each
        token's bucket in [0, num_buckets)) it returns evaluation's [num_buckets, 3] sums on this rank instead:
        NLL, argmax hits, tokens (levers/chunked_loss.chunked_bucket_sums). `pad_spans`: the pads over the
        flattened full batch, which attention leaves out (parallel/sharding.Shard.pad_spans)."""
        self.mark_pads(input_ids.shape, real_rows)
        stats = self.router_stats
        if stats is not None:
            b, s = input_ids.shape
            mask = None
            rows = tuple(real_rows) if isinstance(real_rows, (tuple, list)) else (real_rows,) * b
            if real_rows is not None and min(rows) < s:  # decided on the host: no device sync for rows without pads
                counts = torch.tensor(rows, device=input_ids.device)[:, None]
                mask = (torch.arange(s, device=input_ids.device)[None, :] < counts).float().reshape(-1)  # [b*s]
            stats.begin(mask)
        out = self.causal_lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                   sp_cu_seqlens=cu_seqlens, sp_max_seqlen=max_seqlen, sp_pad_spans=pad_spans)
        hidden = out.last_hidden_state
        if stats is not None:
            group = self.state.sp_group if self.state.sp_size > 1 else None
            hidden, self.aux_loss = stats.aux_loss(hidden, group)
        if buckets is not None:
            return self.causal_lm.lm_head(hidden, labels=labels, buckets=buckets, num_buckets=num_buckets)
        return self.causal_lm.lm_head(hidden, labels=labels)



def apply(model: SequenceParallelCausalLM, plan: Any) -> None:
    """Set the levers parallelize installed: the thinning, the offloaded layer inputs (their pinned pool is
    allocated now when the plan gives the bytes, so a shortage is an error before step 1, not mid-run) and
    the layers keeping their attention outputs. `plan`: a resolved Plan (plan/types.py) or a ModelPlan."""
    ck, stash = model.checkpointer, model.attention.stash
    tiles = plan.tiles
    if tiles != model.tiles:
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


def parallelize(model: nn.Module, state: ParallelState,
                plan: ModelPlan | ParallelizeConfig) -> SequenceParallelCausalLM:
    """Apply SP attention, the loss head, lean norms, tiled MLP and checkpointing/offload, in that order."""
    if isinstance(plan, ParallelizeConfig):
        plan = plan.resolve(model.config)
    c = model.config
    fam = family(getattr(c, "model_type", "qwen3"))
    layers = _decoder_layers(model)
    # 1. attention, and the family's other token mixer where it has one (Qwen3.5: Gated DeltaNet, split by head)
    attention = UlyssesAttention(state, plan.kernel, c.num_attention_heads, c.num_key_value_heads)
    model.set_attn_implementation(attention.register(model))
    if fam.mixer is not None:
        fam.mixer.install(layers, state, plan.deltanet_kernel)
    use_fused_rope(model)  # RoPE in one pass over q and k (Triton on CUDA; HF's ops elsewhere)
    # 2. loss head
    model.lm_head = LossHead(model.lm_head, plan.loss_type, plan.loss_chunk_size)
    # 3. lean norms (before tiling and checkpointing, which only wrap what is there)
    if plan.lean_norm:
        use_lean_norms(model, plan.norm_kernel, fam.norm_offset)
    # 4. the family's MLP block: tiled, and its load-balancing statistics where it has them (sparse: router)
    tiles = plan.tiles
    stats, coef = fam.mlp.install(model, layers, tiles, plan.experts_implementation)
    # 5. checkpointing (+ offload, set by apply)
    checkpointer = None
    if plan.gradient_checkpointing:
        pool = HostPool(host_memory_gb=plan.host_memory_gb, ranks_per_host=plan.ranks_per_host)
        checkpointer = LayerRecompute(len(layers), [], pool)
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = True  # HF decoder layers call _gradient_checkpointing_func
            layer._gradient_checkpointing_func = checkpointer.for_layer(i)
        if tiles > 1:  # the recompute needs the tiled MLP's graph, not its output (TiledMLP.unused_output)
            checkpointer.recompute_context = lambda i: layers[i].mlp.unused_output()
    # 6. the stash for kept attention outputs (only a recompute can reuse them)
    if plan.attention_stash:  # decided once (lever_settings.Fixed.attention_stash)
        assert plan.gradient_checkpointing, "the attention-output stash needs gradient_checkpointing"
        attention.stash = AttentionStash()
    model.train()
    sp_model = SequenceParallelCausalLM(model, state, attention, checkpointer, tiles, stats, coef)
    apply(sp_model, plan)
    return sp_model


def levers_of(cfg: ParallelizeConfig, num_layers: int) -> ModelPlan:
    """The fixed levers of a ParallelizeConfig (`auto` ones unset: left to apply(plan)); ConfigError for values
    that cannot run."""
    return _fixed_levers(decode_levers(cfg).bind(num_layers, lambda: 1), num_layers)


def _fixed_levers(fx: Fixed, num_layers: int) -> ModelPlan:
    """What a loop of your own installs before apply: auto is every layer keeping its input, none offloaded
    or kept (the stash installed when a layer may keep its output)."""
    saved = range(0, num_layers, fx.every or 1)
    return ModelPlan(checkpoint_every=fx.every or 1, offload_layers=tuple(saved[:fx.offload_for(len(saved)) or 0]),
                     kept_attention_layers=tuple(range(fx.keep or 0)), attention_stash=fx.attention_stash)
