"""What `parallelize(model, state, setup)` installs on a model and which layers `apply(model, setup)` sets: the
kernels by name and the one lever record, bound (a tile count; an auto lever installed unset until `apply`). Made
of the lever record (`ModelSetup.of`): the trainer's from its resolved plan (plan/types.Plan.model_setup), a loop of
your own's from ParallelizeConfig.resolve. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .lever_settings import EVERY_LAYER, Levers


class LayerLists:
    """The layers each lever covers, by the record's own rule on the model's depth: for a record with `levers` and
    `num_layers` (ModelSetup, the planner's Plan)."""

    levers: Levers
    num_layers: int

    @property
    def saved_layers(self) -> tuple[int, ...]:
        """The layers whose input is kept for backward."""
        return self.levers.saved_layers(self.num_layers)

    @property
    def offload_layers(self) -> tuple[int, ...]:
        """Of the saved layers, those whose input lives in pinned host memory."""
        return self.levers.offload_layers(self.num_layers)

    @property
    def kept_attention_layers(self) -> tuple[int, ...]:
        """The layers keeping their attention output for the recompute."""
        return self.levers.kept_attention_layers()


@dataclass(frozen=True)
class ModelSetup(LayerLists):
    """The mechanisms (kernel, loss head, norms) and the lever record set on them: the layers each lever covers
    are the record's own rule (Levers.saved_layers ...) on the model's `num_layers`."""

    attn_implementation: str = "sdpa"  # attention kernel (names.ATTENTION_KERNELS, or the stand-in)
    loss_type: str = "chunked_nll"
    loss_chunk_size: int = 256
    # the levers, bound (Levers.bind; tiles a count): an auto lever (None) is installed unset until `apply` sets a
    # plan's (every layer keeps its input, none offloaded, none keeps its output)
    levers: Levers = EVERY_LAYER
    num_layers: int = 0  # the model's decoder layers
    lean_norm: bool = True  # RMSNorms keep only their input for backward (levers/lean_norm.py)
    norm_kernel: str = "torch"  # their kernel: triton | torch
    # the attention-output stash is installed (the levers may name kept layers later, apply)
    attention_stash: bool = False
    checkpoint_bytes_per_layer: int = 0  # > 0: pin the host pool for the offloaded inputs now
    host_memory_gb: float | None = None  # host RAM the offload may pin; None: detected
    ranks_per_node: int = 1  # ranks sharing this host's RAM (splits the offload budget)
    # a memory rehearsal's host stand-in: the offload pool holds this many slots (HostPool.held_slots); None in training
    host_held_slots: int | None = None
    experts_implementation: str = "grouped_mm"  # a sparse model's experts kernel (transformers' name)
    deltanet_kernel: str = "torch"  # a Gated DeltaNet layer's rule kernel (names.DELTANET_KERNELS): fla | torch

    def __post_init__(self) -> None:
        if not isinstance(self.levers.tiled_mlp, int):
            raise ValueError(f"tiled_mlp {self.levers.tiled_mlp!r} is not a tile count: bind the levers and decide "
                             f"the tiles first")

    @property
    def checkpoint_every(self) -> int:
        """Every k-th layer keeps its input; backward rebuilds the others (auto: every layer until apply)."""
        return self.levers.checkpoint_every or 1

    @classmethod
    def of(cls, levers: Levers, num_layers: int, **mechanisms: Any) -> ModelSetup:
        """The ModelSetup of a bound lever record (Levers.bind, its tiles decided) on a model of `num_layers`
        layers, the mechanisms (kernels, loss, host, and attention_stash where it is not the record's) as given.
        The trainer's plan (plan/types.Plan.model_setup) and a loop of your own (ParallelizeConfig.resolve) make
        theirs here."""
        return cls(**{"levers": levers, "num_layers": num_layers, "attention_stash": levers.attention_stash,
                      **mechanisms})
