"""The planner's inputs: a model's shape, the run's settings, and the sizes derived from them
(padded length, tokens per rank, parameter counts, ZeRO-3 shards). plan/memory.py turns them into terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from ..layout import check_heads
from ..layout import padded_length as layout_padded_length
from ..names import DEFAULT_SUB_GROUP_SIZE, PLANNED_KERNELS, param_persistence_threshold

# --------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the memory model needs (a Qwen3 / Llama-style decoder with q/k RMSNorm)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool
    qk_norm: bool = True

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (Qwen3Config or alike)."""
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(vocab=config.vocab_size, hidden=config.hidden_size, intermediate=config.intermediate_size,
                   layers=config.num_hidden_layers, heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads, head_dim=d,
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   qk_norm=getattr(config, "model_type", "qwen3") == "qwen3")

    @classmethod
    def preset(cls, name: str) -> ModelShape:
        from ..model.presets import preset_config

        return cls.from_config(preset_config(name))

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Zero3Knobs:
    """The DeepSpeed ZeRO-3 settings that set buffer sizes (ds_configs/zero3.json; "auto" = per hidden)."""

    reduce_bucket_size: int | None = None  # elements; None: hidden**2 (what "auto" is filled with)
    prefetch_bucket_size: int | None = None  # elements; None: 0.9 * hidden**2
    param_persistence_threshold: int | None = None  # elements; None: 10 * hidden
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE  # elements of one optimizer sub-group
    max_live_parameters: int = DEFAULT_SUB_GROUP_SIZE  # elements gathered at most (stage3_max_live_parameters)


@dataclass(frozen=True)
class Settings:
    """One run's layout and levers. Field names follow the training config where it has them."""

    max_length: int
    sp: int = 1
    dp: int = 1
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
    offload_optimizer: bool = False  # ZeRO-Offload: fp32 master, Adam m, v and fp32 grads on the host
    gradient_checkpointing: bool = True
    activation_offload: int = 0  # layers whose checkpointed input lives in pinned host memory
    checkpoint_every: int = 1  # only every k-th layer keeps its input; backward rebuilds the others
    tiled_mlp: int = 1  # MLP tiles; 1 = untiled
    lean_norm: bool = True  # RMSNorms keep only their input (ours); False: HF's fp32 copies (alst, hf)
    norm_kernel: str = "torch"  # the lean norms' kernel (levers/lean_norm.py): torch ops or triton (fused)
    # attention/grouped.py: the kernel runs one KV-head group at a time (ours; with one KV head per rank only
    # for layers keeping their output, see layer_terms.attention_runs_grouped); False: on all heads at once
    grouped_attention: bool = True
    # the first n layers keep their attention output + LSE from the checkpoint's forward (attention/stash.py)
    kept_attention_layers: int = 0
    loss_type: Literal["chunked_nll", "nll"] = "chunked_nll"
    loss_chunk_size: int = 256
    # All kernels are modelled alike (flash-style: output + fp32 LSE saved, fp32 dq accumulator in
    # backward); on the H200, SDPA (cuDNN) and the memory-only stand-in measured the same working set on the
    # KV-group path; on all heads with fewer KV than query heads cuDNN's backward takes more (layer_terms.py).
    attention: str = "sdpa"
    pad_to_multiple_of: int | None = None
    pinned_rounding: Literal["exact", "pow2"] = "exact"  # our HostPool vs per-tensor pin_memory()
    prefetch_offloaded: bool = True  # ours fetches the next offloaded layer one layer ahead
    zero3: Zero3Knobs = field(default_factory=Zero3Knobs)
    gpus_per_host: int | None = None  # ranks sharing one host's RAM; None: all ranks on one host
    allocator_slack: float = 0.05  # caching-allocator fragmentation on top of the allocated peak
    cuda_context_gb: float = 1.0  # CUDA context, cuBLAS workspace, NCCL buffers (outside torch's count)
    host_baseline_gb: float = 2.5  # resident memory of one process apart from pinned buffers (H200: 2.1-2.3)

    @property
    def world(self) -> int:
        return self.sp * self.dp

    @property
    def act_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def ranks_per_host(self) -> int:
        return self.gpus_per_host or self.world


def saved_layer_count(shape: ModelShape, checkpoint_every: int) -> int:
    """Layers that keep their input (the block starts 0, k, 2k, ...), the candidates for offload."""
    return -(-shape.layers // checkpoint_every)


def check_settings(shape: ModelShape, s: Settings) -> None:
    """ConfigError naming the fix for settings the model cannot run."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(s.max_length >= 2, f"max_length must be >= 2 tokens, got {s.max_length}")
    need(s.sp >= 1 and s.dp >= 1, f"sp and dp must be >= 1, got sp={s.sp}, dp={s.dp}")
    check_heads(s.sp, shape.heads, shape.kv_heads)
    need(s.micro_batch >= 1, f"per_device_train_batch_size must be >= 1, got {s.micro_batch}")
    need(s.checkpoint_every >= 1, f"checkpoint_every must be >= 1, got {s.checkpoint_every}")
    need(0 <= s.kept_attention_layers <= shape.layers and (s.kept_attention_layers == 0 or s.gradient_checkpointing),
         f"kept_attention_layers must be 0..{shape.layers} and needs gradient_checkpointing, "
         f"got {s.kept_attention_layers}")
    need(s.checkpoint_every == 1 or s.gradient_checkpointing, "checkpoint_every > 1 needs gradient_checkpointing")
    saved = saved_layer_count(shape, s.checkpoint_every)
    need(0 <= s.activation_offload <= saved,
         f"activation_offload={s.activation_offload} must be between 0 and {saved} layers (the layers that keep "
         f"an input: {shape.layers} / checkpoint_every {s.checkpoint_every}, rounded up)")
    need(s.activation_offload == 0 or s.gradient_checkpointing,
         "activation_offload needs gradient_checkpointing: true (it offloads the checkpoints)")
    need(s.tiled_mlp >= 1, f"tiled_mlp must be >= 1 tiles, got {s.tiled_mlp}")
    need(s.loss_chunk_size >= 1, f"loss_chunk_size must be >= 1, got {s.loss_chunk_size}")
    need(s.attention in PLANNED_KERNELS, f"attention kernel {s.attention!r} is unknown; use one of {PLANNED_KERNELS}")
    need(s.zero_stage in (0, 3), f"zero_stage {s.zero_stage} is not modelled; use 3 (or 0 for plain torch)")
    need(not (s.offload_optimizer and s.zero_stage != 3), "optimizer offload needs ZeRO stage 3")
    need(0 <= s.allocator_slack < 1, f"allocator_slack must be in [0, 1), got {s.allocator_slack}")


# --------------------------------------------------------------------------------------------
# Shapes


def padded_length(s: Settings) -> int:
    """Sequence length after padding to a multiple of lcm(sp, pad_to_multiple_of) (layout.padded_length)."""
    return layout_padded_length(s.max_length, s.sp, s.pad_to_multiple_of)


def local_tokens(s: Settings) -> int:
    """t: tokens one rank holds per micro-step (batch x padded length / sp)."""
    return s.micro_batch * padded_length(s) // s.sp


def kv_repeat(shape: ModelShape, sp: int) -> int:
    """How many times each KV head is copied before the all-to-all (parallel/ulysses.py)."""
    return max(1, sp // shape.kv_heads)


def _layer_linear_numels(shape: ModelShape) -> list[int]:
    """One decoder layer's linear weights: q, k, v, o, gate, up, down."""
    h, i, q, k = shape.hidden, shape.intermediate, shape.q_width, shape.kv_width
    return [h * q, h * k, h * k, q * h, h * i, h * i, i * h]


def layer_param_numels(shape: ModelShape) -> list[int]:
    """Parameters of one decoder layer, in module order: q, k, v, o, q_norm, k_norm, gate, up, down,
    input_layernorm, post_attention_layernorm."""
    q, k, v, o, gate, up, down = _layer_linear_numels(shape)
    norms = [shape.head_dim] * 2 if shape.qk_norm else []
    return [q, k, v, o, *norms, gate, up, down, shape.hidden, shape.hidden]


def matmul_params(shape: ModelShape) -> int:
    """Parameters that take part in a matmul per token: every layer's linear weights plus lm_head (embedding
    lookups and norms do no matmul); what the model FLOPs count (train/metrics.py)."""
    return shape.layers * sum(_layer_linear_numels(shape)) + shape.vocab * shape.hidden


def param_numels(shape: ModelShape) -> list[int]:
    """Every parameter tensor of the causal LM: embedding, the layers, final norm, untied lm_head."""
    out = [shape.vocab * shape.hidden]
    for _ in range(shape.layers):
        out += layer_param_numels(shape)
    out.append(shape.hidden)
    if not shape.tied_embeddings:
        out.append(shape.vocab * shape.hidden)
    return out


def num_params(shape: ModelShape) -> int:
    """N: parameters, tied embeddings counted once."""
    return sum(param_numels(shape))


def _shard_numel(shape: ModelShape, s: Settings) -> int:
    """Elements of this rank's ZeRO-3 partition: each tensor is padded to a multiple of W and split."""
    if s.zero_stage == 0:
        return num_params(shape)
    return sum(-(-n // s.world) for n in param_numels(shape))


def _persistence_threshold(shape: ModelShape, s: Settings) -> int:
    t = s.zero3.param_persistence_threshold
    return param_persistence_threshold(shape.hidden) if t is None else t


def _sub_group_numels(shape: ModelShape, s: Settings) -> list[int]:
    """ZeRO-3 optimizer sub-groups: parameter partitions packed in order until sub_group_size is reached."""
    groups, acc = [], 0
    for n in param_numels(shape):
        acc += -(-n // s.world)
        if acc >= s.zero3.sub_group_size:
            groups.append(acc)
            acc = 0
    if acc:
        groups.append(acc)
    return groups


def pinned_bytes(nbytes: int, rounding: str) -> int:
    """Host bytes that a pinned buffer of nbytes occupies: exact, or PyTorch's pinned caching allocator,
    which rounds every allocation up to a power of two."""
    if nbytes <= 0:
        return 0
    return nbytes if rounding == "exact" else 1 << (nbytes - 1).bit_length()
