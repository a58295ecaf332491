"""`parallelize(model, state, cfg)`: the one place the levers are applied to an HF causal LM.

Order (each step relies on the ones before it):
  1. Ulysses attention: register the SP attention function and switch the model to it.
  2. Loss head: lm_head also returns the chunked (or plain) loss sum, never the L x V logits.
  3. Lean norms: every RMSNorm keeps only its input for backward, not fp32 copies.
  4. Tiled MLP: each decoder layer's MLP runs by sequence tiles.
  5. Checkpointing (+ offload): each decoder layer keeps only its input (or, with checkpoint_every=k,
     every k-th layer does and backward rebuilds the rest), on device or in pinned host memory, and
     recomputes in backward; there the tiled MLP skips its forward (its backward recomputes each tile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..attention.stash import AttentionStash
from ..errors import ConfigError
from ..levers.host_pool import HostPool
from ..levers.lean_norm import use_lean_norms
from ..levers.offload import LayerCheckpointer
from ..levers.tiled_mlp import TiledMLP, auto_num_tiles
from ..parallel.state import ParallelState
from ..parallel.ulysses import UlyssesAttention
from .loss_head import LossHead


@dataclass
class ParallelizeConfig:
    """The levers, as switches (named as the config fields)."""

    attn_implementation: str = "auto"
    loss_type: str = "chunked_nll"
    loss_chunk_size: int = 256
    tiled_mlp: bool | int | str = "auto"  # False | True (auto tile count) | tiles | "auto" (when it pays)
    lean_norm: bool = True  # RMSNorms save their input only (levers/lean_norm.py)
    gradient_checkpointing: bool = True
    checkpoint_every: int = 1  # keep every k-th layer's input; rebuild the others in backward (levers/offload.py)
    activation_offload: bool | int | str = False  # False | True (all) | n first layers | "auto"
    # layers whose attention output + LSE are kept from the checkpoint's forward to skip the kernel in the
    # recompute (attention/stash.py): False | True (all) | n first layers | "auto" (what fits, see
    # configure_offload)
    keep_attention_outputs: bool | int | str = False
    host_memory_gb: float | None = None  # None: detected
    local_seq_len: int | None = None  # tokens per rank per row; needed for tiling decisions
    ranks_per_host: int = 1  # ranks sharing this host's RAM (splits the offload budget)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    assert isinstance(layers, nn.ModuleList), "expected an HF causal LM with .model.layers (Qwen3, Llama...)"
    return layers


def mlp_tiles(setting: bool | int | str, local_seq_len: int | None, hidden: int, intermediate: int) -> int:
    """Tile count for the MLP (1 = untiled). Same on every rank: it depends on shapes only.

    auto: tile once the MLP's four intermediate-width bf16 tensors would pass 1 GiB, and then keep
    each tile's near 1 GiB (bigger tiles run faster matmuls; smaller ones save nothing that matters).
    True: the lever's own count (levers.tiled_mlp.auto_num_tiles).
    """
    if setting is False or setting == 0:
        return 1
    if local_seq_len is None:
        return 1 if not isinstance(setting, int) or isinstance(setting, bool) else int(setting)
    if setting == "auto":
        return max(1, math.ceil(local_seq_len * intermediate * 4 * 2 / 2**30))
    if setting is True:
        return auto_num_tiles(local_seq_len, hidden, intermediate)
    return int(setting)


def layer_working_set_bytes(config, local_tokens: int, bytes_per_el: int) -> int:
    """Device memory one layer's recompute + backward needs beyond the checkpoints: what `auto` offload
    keeps free. Rough and generous (8 hidden-size and 6 q/k/v-size tensors, plus 4 GiB); the planner
    (`ulysses-trainer plan`) has the term-by-term model."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qkv = local_tokens * (config.num_attention_heads + 2 * config.num_key_value_heads) * d * bytes_per_el
    return int(8 * local_tokens * config.hidden_size * bytes_per_el + 6 * qkv + 4 * 2**30)


class SequenceParallelCausalLM(nn.Module):
    """An HF causal LM under Ulysses SP. forward(shard inputs) -> fp32 sum of token NLLs on this rank.

    The caller divides by the number of valid tokens in the whole optimizer step (all ranks, all
    micro-steps) — see `ulysses_trainer.loss.step_token_count`.
    """

    def __init__(self, causal_lm: nn.Module, state: ParallelState, attention: UlyssesAttention,
                 checkpointer: LayerCheckpointer | None, offload_policy, host_memory_gb: float | None,
                 keep_attention_outputs: bool | int | str = False):
        super().__init__()
        self.keep_attention_outputs = keep_attention_outputs
        self.causal_lm = causal_lm
        self.state = state
        self.attention = attention
        self.checkpointer = checkpointer
        self.offload_policy = offload_policy
        self.host_memory_gb = host_memory_gb

    @property
    def config(self):
        return self.causal_lm.config

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
        out = self.causal_lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                   sp_cu_seqlens=cu_seqlens, sp_max_seqlen=max_seqlen)
        return self.causal_lm.lm_head(out.last_hidden_state, labels=labels)

    def configure_offload(self, bytes_per_layer: int, free_device_bytes: int, reserve_bytes: int,
                          stash_bytes_per_layer: int = 0) -> list[int]:
        """Decide which layers offload (policy `auto` needs free device memory, known only once the
        engine holds its states), then, for keep_attention_outputs `auto`, how many layers keep their
        attention outputs in what is left. Returns the offloaded layer indices."""
        if self.checkpointer is None:
            return []
        ck = self.checkpointer
        layers = ck.apply_offload_policy(self.offload_policy, bytes_per_layer, free_device_bytes, reserve_bytes)
        if layers:  # pin the whole pool now: a shortage is an error before step 1, not mid-run
            ck.pool.allocate(bytes_per_layer, len(layers))
        stash = self.attention.stash
        if stash is not None and self.keep_attention_outputs == "auto" and stash_bytes_per_layer > 0:
            # device-resident inputs: the kept ones not offloaded, plus one block's rebuilt inputs
            resident = (len(ck.saved_layers) - len(layers) + ck.every - 1) * bytes_per_layer
            room = free_device_bytes - reserve_bytes - resident
            stash.set_layers(range(max(0, min(ck.num_layers, room // stash_bytes_per_layer))))
        return layers


def parallelize(model: nn.Module, state: ParallelState, cfg: ParallelizeConfig) -> SequenceParallelCausalLM:
    """Apply SP attention, the loss head, lean norms, tiled MLP and checkpointing/offload, in that order."""
    c = model.config
    layers = _decoder_layers(model)
    # 1. attention
    attention = UlyssesAttention(state, cfg.attn_implementation, c.num_attention_heads, c.num_key_value_heads)
    model.set_attn_implementation(attention.register())
    # 2. loss head
    model.lm_head = LossHead(model.lm_head, cfg.loss_type, cfg.loss_chunk_size)
    # 3. lean norms (before tiling and checkpointing, which only wrap what is there)
    if cfg.lean_norm:
        use_lean_norms(model)
    # 4. tiled MLP
    tiles = mlp_tiles(cfg.tiled_mlp, cfg.local_seq_len, c.hidden_size, c.intermediate_size)
    if tiles > 1:
        for layer in layers:
            layer.mlp = TiledMLP(layer.mlp, tiles)
    # 5. checkpointing + offload (offload layers are decided now unless the policy is "auto")
    checkpointer = None
    if cfg.gradient_checkpointing:
        pool = HostPool(host_memory_gb=cfg.host_memory_gb, ranks_per_host=cfg.ranks_per_host)
        checkpointer = LayerCheckpointer(len(layers), [], pool, cfg.checkpoint_every)
        if cfg.activation_offload != "auto":  # "auto" waits for the free device memory (configure_offload)
            checkpointer.apply_offload_policy(cfg.activation_offload)
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = True  # HF decoder layers call _gradient_checkpointing_func
            layer._gradient_checkpointing_func = checkpointer.for_layer(i)
        if tiles > 1:  # the recompute needs the tiled MLP's graph, not its output (TiledMLP.unused_output)
            checkpointer.recompute_context = lambda i: layers[i].mlp.unused_output()
    elif cfg.activation_offload not in (False, 0, "auto") or cfg.checkpoint_every != 1:
        raise ValueError("activation_offload and checkpoint_every need gradient_checkpointing=True")
    # 6. kept attention outputs (only a recompute can reuse them)
    keep = cfg.keep_attention_outputs
    if keep == "auto" and not cfg.gradient_checkpointing:
        keep = False  # nothing is recomputed
    if keep is not False and keep != 0:
        if not cfg.gradient_checkpointing:
            raise ConfigError("keep_attention_outputs needs gradient_checkpointing=True (only a recompute reuses them)")
        attention.stash = AttentionStash(kept_attention_layers(keep, len(layers)) if keep != "auto" else ())
    model.train()
    return SequenceParallelCausalLM(model, state, attention, checkpointer, cfg.activation_offload,
                                    cfg.host_memory_gb, keep)


def kept_attention_layers(policy: bool | int, num_layers: int) -> list[int]:
    """True: every layer; n: the first n (any n layers hold the same memory at the backward's start)."""
    if policy is True:
        return list(range(num_layers))
    if isinstance(policy, bool) or not isinstance(policy, int) or not 0 <= policy <= num_layers:
        raise ConfigError(f"keep_attention_outputs={policy!r}: give false, true, auto or a layer count 0..{num_layers}")
    return list(range(policy))
