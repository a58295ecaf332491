"""What `parallelize(model, state, plan)` installs on a model and which layers `apply(model, plan)` sets: every
value concrete (a kernel name, a tile count, layer indices), no `auto` left. Made of the lever record
(`ModelPlan.of`): the trainer's from its resolved plan (plan/types.Plan.model_plan), a loop of your own's from
ParallelizeConfig.resolve. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .lever_settings import Levers


@dataclass(frozen=True)
class ModelPlan:
    """The mechanisms (kernel, loss head, norms, tiles, checkpointing) and the levers set on them."""

    attn_implementation: str = "sdpa"  # attention kernel (names.ATTENTION_KERNELS, or the stand-in)
    loss_type: str = "chunked_nll"
    loss_chunk_size: int = 256
    tiled_mlp: int = 1  # MLP tiles, 1 = untiled
    lean_norm: bool = True  # RMSNorms keep only their input for backward (levers/lean_norm.py)
    norm_kernel: str = "torch"  # their kernel: triton | torch
    gradient_checkpointing: bool = True
    checkpoint_every: int = 1  # every k-th layer keeps its input; backward rebuilds the others
    offload_layers: tuple[int, ...] = ()  # layers whose kept input lives in pinned host memory
    kept_attention_layers: tuple[int, ...] = ()  # layers keeping their attention output for the recompute
    # the attention-output stash is installed (the levers may name kept layers later, apply)
    attention_stash: bool = False
    checkpoint_bytes_per_layer: int = 0  # > 0: pin the host pool for the offloaded inputs now
    host_memory_gb: float | None = None  # host RAM the offload may pin; None: detected
    ranks_per_node: int = 1  # ranks sharing this host's RAM (splits the offload budget)
    # a memory rehearsal's host stand-in: the offload pool holds this many slots (HostPool.held_slots); None in training
    host_held_slots: int | None = None
    experts_implementation: str = "grouped_mm"  # a sparse model's experts kernel (transformers' name)
    deltanet_kernel: str = "torch"  # a Gated DeltaNet layer's rule kernel (names.DELTANET_KERNELS): fla | torch

    @classmethod
    def of(cls, levers: Levers, num_layers: int, **mechanisms: Any) -> ModelPlan:
        """The ModelPlan of a bound lever record (Levers.bind, its tiles decided) on a model of `num_layers`
        layers, the mechanisms (kernels, loss, host, and attention_stash where it is not the record's) as given:
        an auto lever is installed unset until `apply` (Levers.saved_layers). The trainer's plan
        (plan/types.Plan.model_plan) and a loop of your own (ParallelizeConfig.resolve) make theirs here."""
        if not isinstance(levers.tiled_mlp, int):
            raise ValueError(f"tiled_mlp {levers.tiled_mlp!r} is not a tile count: bind the levers and decide the "
                             f"tiles first")
        return cls(**{"tiled_mlp": levers.tiled_mlp, "gradient_checkpointing": levers.gradient_checkpointing,
                      "checkpoint_every": levers.checkpoint_every or 1,
                      "offload_layers": levers.offload_layers(num_layers),
                      "kept_attention_layers": levers.kept_attention_layers(),
                      "attention_stash": levers.attention_stash, **mechanisms})
