"""The planner's inputs: a model's shape (plan/model_shape.py), the run's settings, and the sizes derived from them
(padded length, tokens per rank; the parameter counts as functions are in plan/counts.py, the ZeRO-3 partitions
in plan/partitions.py). plan/memory.py turns them into terms.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..errors import ConfigError
from ..families import MlpRun
from ..vocabulary.layout import Layout, check_heads, padded_length
from ..vocabulary.layout import kv_repeat as layout_kv_repeat
from ..vocabulary.lever_settings import EVERY_LAYER, Levers
from ..vocabulary.names import DEFAULT_SUB_GROUP_SIZE, PLANNED_KERNELS
from .model_shape import ModelShape

__all__ = ["ModelShape", "Settings", "Zero3Knobs", "check_settings", "forward_passes", "kv_repeat",
           "layer_forward_passes", "local_tokens", "mlp_run", "saved_layer_count"]


@dataclass(frozen=True)
class Zero3Knobs:
    """The DeepSpeed ZeRO-3 settings that set buffer sizes (ds_configs/zero3.json; "auto" = per hidden)."""

    reduce_bucket_size: int | None = None  # elements; None: hidden**2 (what "auto" is filled with)
    prefetch_bucket_size: int | None = None  # elements; None: 0.9 * hidden**2
    param_persistence_threshold: int | None = None  # elements; None: 10 * hidden
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE  # elements of one optimizer sub-group
    max_live_parameters: int = DEFAULT_SUB_GROUP_SIZE  # elements gathered at most (stage3_max_live_parameters)
    # elements fetched in between within which a parameter stays gathered (stage3_max_reuse_distance): it times
    # ZeRO-3's gathers (plan/comm_model.py), it sizes no memory term
    max_reuse_distance: int = DEFAULT_SUB_GROUP_SIZE

    def memory_sizes(self) -> dict[str, int | None]:
        """The sizes the memory terms read (MemoryEstimate.to_dict writes these)."""
        return {k: v for k, v in self.__dict__.items() if k != "max_reuse_distance"}


# Settings.flat: the lever written after each of these fields (the order the settings' JSON has always had)
_LEVERS_AFTER = {"zero3_trace": ("optimizer_offload", "gradient_checkpointing", "activation_offload",
                                 "checkpoint_every", "tiled_mlp"),
                 "grouped_attention": ("keep_attention_outputs",)}


@dataclass(frozen=True)
class Settings:
    """One run's layout and levers. Field names follow the training config where it has them; the levers are the
    one lever record (vocabulary/lever_settings.Levers), decided."""

    max_length: int
    layout: Layout = Layout(1, 1)  # the ranks: dp groups of sp (vocabulary/layout.resolve_layout decides it)
    micro_batch: int = 1
    bf16: bool = True
    zero_stage: Literal[0, 3] = 3  # 0: plain torch (no sharding; used for the HF / ALST baselines)
    optimizer: Literal["adamw", "none"] = "adamw"  # none: forward+backward only (baseline runs)
    optimizer_fused: bool = True  # DeepSpeed FusedAdam / torch fused AdamW: no full-size temporaries
    # The first step: Adam's m, v are created inside the optimizer step (torch and DeepSpeed), so they
    # are absent during forward/backward (also true of a run whose steps are all skipped); without
    # ZeRO the .grad tensors are created during backward, so the top layers' backward runs without them
    first_step: bool = False
    # From the second step on ZeRO-3's prefetcher follows the trace of the first and keeps parameters
    # gathered up to stage3_max_live_parameters; False: a first step measured alone (no trace yet)
    zero3_trace: bool = True
    # the memory levers, decided (Levers.decided): gradient checkpointing, every k-th layer keeping its input,
    # the inputs offloaded to pinned host memory, the layers keeping their attention output, the MLP tiles and
    # ZeRO-Offload (fp32 master, Adam m, v and fp32 grads on the host); `with_levers` changes them
    levers: Levers = EVERY_LAYER
    lean_norm: bool = True  # RMSNorms keep only their input (ours); False: HF's fp32 copies (alst, hf)
    norm_kernel: str = "torch"  # the lean norms' kernel (levers/lean_norm.py): torch ops or triton (fused)
    # attention/grouped.py: the kernel runs one KV-head group at a time (ours; with one KV head per rank only
    # for layers keeping their output, see layer_terms.attention_runs_grouped); False: on all heads at once
    grouped_attention: bool = True
    # packed rows: their causal varlen attention, sum(l_i^2) over documents, as a share of one document of
    # max_length (mean over the data's rows, plan/attention_share.py); 1.0: one document, the worst case
    attention_fraction: float = 1.0
    loss_type: Literal["chunked_nll", "nll"] = "chunked_nll"
    loss_chunk_size: int = 256
    # All kernels are modelled alike (flash-style: output + fp32 LSE saved, fp32 dq accumulator in
    # backward); on the H200, SDPA (cuDNN) and the memory-only stand-in measured the same working set on the
    # KV-group path; on all heads with fewer KV than query heads cuDNN's backward takes more (layer_terms.py).
    attn_implementation: str = "sdpa"
    # a sparse model's experts kernel (transformers' experts_implementation; plan/rates.EXPERTS_TFLOPS)
    experts_implementation: str = "grouped_mm"
    deltanet_kernel: str = ""  # a Gated DeltaNet layer's rule kernel ("": the model has none)
    pad_to_multiple_of: int | None = None
    pinned_rounding: Literal["exact", "pow2"] = "exact"  # our HostPool vs per-tensor pin_memory()
    prefetch_offloaded: bool = True  # ours fetches the next offloaded layer one layer ahead
    zero3: Zero3Knobs = field(default_factory=Zero3Knobs)
    # LoRA: the trainable tensors' sizes (the adapters); the base weights are frozen (no gradient, no fp32
    # master, no Adam state). None: every weight trains
    trainable_numels: tuple[int, ...] | None = None
    gpus_per_node: int | None = None  # ranks sharing one host's RAM; None: all ranks on one host
    allocator_slack: float = 0.05  # caching-allocator fragmentation on top of the allocated peak
    cuda_context_gb: float = 1.0  # CUDA context, cuBLAS workspace, NCCL buffers (outside torch's count)
    host_baseline_gb: float = 2.5  # resident memory of one process apart from pinned buffers (H200: 2.1-2.3)

    def __post_init__(self) -> None:
        if not self.levers.decided:
            raise ValueError(f"the planner's settings hold a decided lever record (Levers.bind, the search), "
                             f"got {self.levers}")

    @property
    def sp_size(self) -> int:
        return self.layout.sp_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def act_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node or self.world_size

    @property
    def padded_length(self) -> int:
        """Sequence length after padding to a multiple of lcm(sp, pad_to_multiple_of) (layout.padded_length)."""
        return padded_length(self.max_length, self.sp_size, self.pad_to_multiple_of)

    @property
    def local_tokens(self) -> int:
        """t: tokens one rank holds per micro-step (batch x padded length / sp)."""
        return self.micro_batch * self.padded_length // self.sp_size

    def with_levers(self, **levers: Any) -> Settings:
        """These settings with the named levers of their record changed (`with_levers(tiled_mlp=8)`)."""
        return replace(self, levers=replace(self.levers, **levers))

    def flat(self) -> dict[str, Any]:
        """The settings under their training-config names, the levers' among them where `plan --json` has always
        written them (MemoryEstimate.to_dict, the replan's line)."""
        out: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if name == "layout":  # under the config's names
                out["sp_size"], out["dp_size"] = value.sp_size, value.dp_size
            elif name != "levers":
                out[name] = value
            for lever in _LEVERS_AFTER.get(name, ()):
                out[lever] = getattr(self.levers, lever)
        return out


def saved_layer_count(shape: ModelShape, checkpoint_every: int) -> int:
    """Layers that keep their input (the block starts 0, k, 2k, ...), the candidates for offload."""
    return -(-shape.layers // checkpoint_every)


def check_settings(shape: ModelShape, s: Settings) -> None:
    """ConfigError naming the fix for settings the model cannot run."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(s.max_length >= 2, f"max_length must be >= 2 tokens, got {s.max_length}")
    need(s.sp_size >= 1 and s.dp_size >= 1 and s.world_size == s.sp_size * s.dp_size,
         f"sp_size must divide the world size, both >= 1: got sp_size={s.sp_size}, world {s.world_size}")
    mixer = shape.family.mixer
    check_heads(s.sp_size, shape.heads, shape.kv_heads,
                mixer.sp_heads(shape.dims) if mixer is not None and shape.mixer_layers else ())
    need(s.micro_batch >= 1, f"per_device_train_batch_size must be >= 1, got {s.micro_batch}")
    lv = s.levers
    need(lv.checkpoint_every >= 1, f"checkpoint_every must be >= 1, got {lv.checkpoint_every}")
    need(0 <= lv.keep_attention_outputs <= shape.layers
         and (lv.keep_attention_outputs == 0 or lv.gradient_checkpointing),
         f"kept_attention_layers must be 0..{shape.layers} and needs gradient_checkpointing, "
         f"got {lv.keep_attention_outputs}")
    need(lv.checkpoint_every == 1 or lv.gradient_checkpointing, "checkpoint_every > 1 needs gradient_checkpointing")
    saved = saved_layer_count(shape, lv.checkpoint_every)
    need(0 <= lv.activation_offload <= saved,
         f"activation_offload={lv.activation_offload} must be between 0 and {saved} layers (the layers that keep "
         f"an input: {shape.layers} / checkpoint_every {lv.checkpoint_every}, rounded up)")
    need(lv.activation_offload == 0 or lv.gradient_checkpointing,
         "activation_offload needs gradient_checkpointing: true (it offloads the checkpoints)")
    need(lv.tiled_mlp >= 1, f"tiled_mlp must be >= 1 tiles, got {lv.tiled_mlp}")
    need(s.loss_chunk_size >= 1, f"loss_chunk_size must be >= 1, got {s.loss_chunk_size}")
    need(s.attn_implementation in PLANNED_KERNELS,
         f"attention kernel {s.attn_implementation!r} is unknown; use one of {PLANNED_KERNELS}")
    need(s.zero_stage in (0, 3), f"zero_stage {s.zero_stage} is not modelled; use 3 (or 0 for plain torch)")
    need(not (lv.optimizer_offload and s.zero_stage != 3), "optimizer offload needs ZeRO stage 3")
    need(0 <= s.allocator_slack < 1, f"allocator_slack must be in [0, 1), got {s.allocator_slack}")


# --------------------------------------------------------------------------------------------
# Shapes


def local_tokens(s: Settings) -> int:
    """t: tokens one rank holds per micro-step (Settings.local_tokens)."""
    return s.local_tokens


def forward_passes(shape: ModelShape, s: Settings) -> float:
    """Forwards per layer, on average: 1, plus the recompute with checkpointing, plus the rebuild of
    (c-1) of every c layers under checkpoint_every c."""
    if not s.levers.gradient_checkpointing:
        return 1.0
    c = s.levers.checkpoint_every
    rebuilt = shape.layers - -(-shape.layers // c)  # layers that are not block tops
    return 2.0 + rebuilt / shape.layers


def layer_forward_passes(shape: ModelShape, s: Settings, layer: int) -> int:
    """Forwards of decoder layer `layer` in one micro-step: 1, plus its recompute with checkpointing, plus one
    rebuild unless it is its block's top (levers/recompute.py: the backward of a block's top re-runs the layers
    below it in the block once, no graph). Which layers are tops matters where only some layers attend: Qwen3.5's
    full layers (every 4th, indices 3 mod 4) are all tops under checkpoint_every 2, so they run 2 forwards, not
    the average's 2.5."""
    if not s.levers.gradient_checkpointing:
        return 1
    c = s.levers.checkpoint_every
    top = min(layer - layer % c + c, shape.layers) - 1
    return 2 + int(layer != top)


def mlp_run(shape: ModelShape, s: Settings, layers: Collection[int] = ()) -> MlpRun:
    """What the family's MLP block terms read of these settings (families/base.MlpRun); with `layers`, their
    mean forwards (layer_forward_passes) instead of every layer's."""
    passes = (sum(layer_forward_passes(shape, s, i) for i in layers) / len(layers) if layers else
              forward_passes(shape, s))
    return MlpRun(tokens=s.local_tokens, act_bytes=s.act_bytes, levers=s.levers, forward_passes=passes,
                  experts_implementation=s.experts_implementation, lean_norm=s.lean_norm,
                  weights_frozen=s.trainable_numels is not None)


def kv_repeat(shape: ModelShape, sp_size: int) -> int:
    """How many times each KV head is copied before the all-to-all (vocabulary/layout.kv_repeat's rule)."""
    return layout_kv_repeat(sp_size, shape.kv_heads)
