"""Names and rules that the planner and the runtime code both read, torch-free: the attention and RMSNorm
kernels (and how `auto` picks one), their install hints, the MLP tile rules, the attention grouping rule and
ZeRO-3's `auto` sizes. Runtime code (attention/, levers/, parallel/, ds_config.py) imports these from here, not
from the planner's modules; nothing here imports any other part of the package but errors.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

GIB = 2**30  # bytes in a GiB: every byte count the package prints or budgets is in these

# --------------------------------------------------------------------------------------------
# Kernels

ATTENTION_KERNELS = ("sdpa", "flash_attention_2", "flash_attention_4")  # what attn_implementation names
STANDIN = "standin_memory_only"  # benchmarks and rehearsals only (attention/standin.py): memory real, time not
STANDIN_FA4 = "standin_memory_only_fa4"  # the same, on flash-attn-4's path (every layer group by group)
STANDINS = (STANDIN, STANDIN_FA4)
PLANNED_KERNELS = (*ATTENTION_KERNELS, *STANDINS)  # what the memory model plans
KEEPING_KERNELS = ("sdpa", "flash_attention_4", *STANDINS)  # kernels whose outputs can be kept (attention/grouped.py)
NORM_KERNELS = ("triton", "torch")  # the lean RMSNorms' kernels (levers/lean_norm.py)
DELTANET_KERNELS = ("fla", "torch")  # a Gated DeltaNet layer's rule kernels (families/qwen3_5/deltanet_kernels.py)
INSTALL_HINT = {"flash_attention_2": "pip install 'ulysses_trainer[flash]' (needs CUDA)",
                "flash_attention_4": "pip install 'ulysses_trainer[fa4]' (flash_attn.cute; Hopper/Blackwell GPUs)",
                "triton": "pip install 'ulysses_trainer[liger]' (Liger-Kernel's Triton RMSNorm; needs CUDA)",
                "fla": "pip install flash-linear-attention (Triton kernels; needs CUDA)"}


def _installed_choice(field: str, name: str, known: tuple[str, ...], installed: tuple[str, ...],
                      default: str) -> str:
    """`auto` -> the first installed (fastest first; `default` if none); a named one must be known and installed."""
    if name == "auto":
        return installed[0] if installed else default
    if name not in known:
        raise ConfigError(f"{field}={name!r} is unknown; use one of auto, {', '.join(known)}")
    if name not in installed:
        raise ConfigError(f"{field}={name!r} is not installed here ({INSTALL_HINT[name]}); "
                          f"installed: {', '.join(installed)} (or use auto)")
    return name


def choose_kernel(name: str, installed: tuple[str, ...]) -> str:
    """`auto` -> the fastest installed kernel (flash-attn-4 whenever it is there); a named one must be installed."""
    if name in STANDINS:
        return name
    return _installed_choice("attn_implementation", name, ATTENTION_KERNELS, installed, "sdpa")


def choose_norm_kernel(name: str, installed: tuple[str, ...], lean_norm: bool = True) -> str:
    """`auto` -> the fused Triton RMSNorm where installed, else torch ops; a named one must be installed.
    Without lean norms HF's own norms stay (torch)."""
    if not lean_norm:
        if name == "triton":
            raise ConfigError("norm_kernel triton is the lean norms' kernel: set lean_norm true or norm_kernel auto")
        return "torch"
    return _installed_choice("norm_kernel", name, NORM_KERNELS, installed, "torch")


def choose_experts_implementation(name: str) -> str:
    """A sparse model's experts kernel (transformers' experts_implementation): `auto` -> grouped_mm
    (transformers' default where torch has grouped_mm; the fastest measured, plan/rates.EXPERTS_TFLOPS);
    a named one as given."""
    return "grouped_mm" if name == "auto" else name


def choose_deltanet_kernel(name: str, installed: tuple[str, ...]) -> str:
    """A Gated DeltaNet layer's rule kernel: `auto` -> fla where flash-linear-attention runs (CUDA), else torch;
    a named one must be installed."""
    return _installed_choice("deltanet_kernel", name, DELTANET_KERNELS, installed, "torch")


@dataclass(frozen=True)
class Kernels:
    """The run's kernels, chosen together (choose_kernels)."""

    attn_implementation: str
    norm_kernel: str  # the lean RMSNorms' kernel (torch without lean norms)
    experts_implementation: str  # a sparse model's (unused by a dense one)
    deltanet_kernel: str = "torch"  # a Gated DeltaNet layer's rule kernel (unused by a model without one)


def choose_kernels(attn_implementation: str, norm_kernel: str, experts_implementation: str, lean_norm: bool,
                   installed: tuple[str, ...], installed_norms: tuple[str, ...], deltanet_kernel: str = "auto",
                   installed_deltanet: tuple[str, ...] = ("torch",)) -> Kernels:
    """Every kernel setting decided in one step from what is installed (ConfigError naming the fix): the
    attention kernel, the RMSNorm kernel, the experts kernel and the Gated DeltaNet rule's kernel."""
    return Kernels(attn_implementation=choose_kernel(attn_implementation, installed),
                   norm_kernel=choose_norm_kernel(norm_kernel, installed_norms, lean_norm),
                   experts_implementation=choose_experts_implementation(experts_implementation),
                   deltanet_kernel=choose_deltanet_kernel(deltanet_kernel, installed_deltanet))


def groups_one_at_a_time(kv_heads: int, keeps_output: bool) -> bool:
    """The sdpa / stand-in rule (attention/grouped.py runs_grouped uses it): group by group pays only with more
    than one KV head per rank; keeping outputs for the recompute needs the explicit-LSE path whatever the count."""
    return kv_heads > 1 or keeps_output


# --------------------------------------------------------------------------------------------
# MLP tiles (levers/tiled_mlp.py runs them; the counts are shape rules)

# A gated MLP keeps about this many [rows, intermediate] tensors alive per tile (gate, up, act, product).
_INTERMEDIATES_PER_ROW = 4


def auto_num_tiles(seq_len: int, hidden_size: int, intermediate_size: int) -> int:
    """Tiles such that one tile's intermediates are about the size of the MLP input (`tiled_mlp: true`).

    One tile of r rows keeps ~4 * r * intermediate values; the input holds seq_len * hidden. Setting
    them equal gives tiles = 4 * intermediate / hidden (16 for Qwen3-4B): the MLP then no longer
    dominates the layer, and more tiles would only shrink it further below the other [seq, hidden]
    tensors while making each matmul smaller. Capped at seq_len so that no tile is empty. A pure
    function of the shapes, so every rank gets the same count for the same shapes.
    """
    if seq_len < 1 or hidden_size < 1 or intermediate_size < 1:
        raise ValueError(f"shapes must be >= 1, got seq_len={seq_len}, hidden_size={hidden_size}, "
                         f"intermediate_size={intermediate_size}")
    tiles = math.ceil(_INTERMEDIATES_PER_ROW * intermediate_size / hidden_size)
    return max(1, min(tiles, seq_len))


def default_mlp_tiles(local_tokens: int, intermediate_size: int) -> int:
    """`tiled_mlp: auto`: tile once the MLP's four intermediate-width bf16 tensors would pass 1 GiB, and then
    keep each tile's near 1 GiB (bigger tiles run faster matmuls; smaller ones save nothing that matters)."""
    return max(1, math.ceil(local_tokens * intermediate_size * _INTERMEDIATES_PER_ROW * 2 / GIB))


# --------------------------------------------------------------------------------------------
# ZeRO-3: the sizes "auto" stands for, and the stage this trainer needs

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's sub_group_size and stage3_max_live_parameters default
# Optimizer sub-groups with offload (ds_configs/zero3_offload.json): DeepSpeed packs parameters until a group
# reaches this size, then pins one fp32 grad buffer per group, which PyTorch rounds up to a power of two.
# 2**28 - 2**25 keeps Qwen3 groups just under 1 GiB (16.5 GiB for 4B; 2**28 itself overshoots to 2 GiB each:
# 28.1 GiB, measured in the 1M run) and AdamW's per-group host temporaries small (1e9 makes 4 GiB groups).
OFFLOAD_SUB_GROUP_SIZE = 2**28 - 2**25


def reduce_bucket_size(hidden: int) -> int:
    """reduce_bucket_size "auto": hidden**2 elements."""
    return hidden * hidden


def prefetch_bucket_size(hidden: int) -> int:
    """stage3_prefetch_bucket_size "auto": 0.9 * hidden**2 elements."""
    return int(0.9 * hidden * hidden)


def param_persistence_threshold(hidden: int) -> int:
    """stage3_param_persistence_threshold "auto": 10 * hidden elements (smaller parameters stay gathered)."""
    return 10 * hidden


ZERO_AUTO_SIZES = {"reduce_bucket_size": reduce_bucket_size, "stage3_prefetch_bucket_size": prefetch_bucket_size,
                   "stage3_param_persistence_threshold": param_persistence_threshold}


def offload_sub_group_size(sub_group_size: Any) -> int:
    """sub_group_size when the plan adds optimizer offload to a ZeRO JSON without it (ds_config.py fills it)."""
    sub = DEFAULT_SUB_GROUP_SIZE if sub_group_size in (None, "auto") else int(float(sub_group_size))
    return min(sub, OFFLOAD_SUB_GROUP_SIZE)


def check_zero_stage(zero: Any, source: str) -> None:
    """ZeRO-3 only: the sequence-parallel model, the collective checkpoint and the final export all
    assume partitioned parameters (stage 1 or 2 would train and then fail at the export)."""
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if stage != 3:
        have = "has no zero_optimization section" if not zero else f"has zero_optimization.stage {json.dumps(stage)}"
        raise ConfigError(f"{source} {have}, but this trainer needs ZeRO stage 3 (its sequence-parallel model "
                          f"and the final HF export assume partitioned parameters); set "
                          f"\"zero_optimization\": {{\"stage\": 3}} as in ds_configs/zero3.json")


# --------------------------------------------------------------------------------------------
TENSORBOARD_DIR = "runs"  # output_dir/runs/, as the HF Trainer's default logging_dir
# report_to (train/run_log.Reporters opens them)

REPORTERS = ("tensorboard", "wandb")


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def resolve_report_to(value: str | list) -> list[str]:
    """The reporters to open. `auto`: tensorboard when its package is installed, else none; `all`: every
    installed one; `none`: none; a name or a list of names: those, each of which must be installed."""
    if value == "auto":
        return ["tensorboard"] if _installed("tensorboard") else []
    if value == "all":
        return [r for r in REPORTERS if _installed(r)]
    names = [value] if isinstance(value, str) else list(value)
    if names == ["none"] or not names:
        return []
    bad = [n for n in names if n not in REPORTERS]
    if bad:
        raise ConfigError(f"report_to {bad[0]!r} is not supported; use none, tensorboard, wandb, a list of them "
                          f"(e.g. [tensorboard, wandb]), all, or auto (tensorboard when installed)")
    for name in names:
        if not _installed(name):
            raise ConfigError(f"report_to {name} needs the {name} package: pip install {name}"
                              + (" (WANDB_MODE=offline logs without an account)" if name == "wandb" else "")
                              + f", or drop {name} from report_to")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------- what a training run writes
CHECKPOINT_MARKER = "ulysses_trainer_checkpoint"  # a file in every checkpoint-<step> the trainer writes
