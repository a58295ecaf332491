"""Host memory of one training step: the pinned pool of offloaded checkpoints and ZeRO-Offload's optimizer
buffers (the planner's host terms; the GPU terms are in plan/memory.py)."""

from __future__ import annotations

from .inputs import ModelShape, Settings
from .layer_terms import FP32
from .partitions import _sub_group_numels, _trainable_shard_numel, pinned_bytes

PAGE = 4096  # HostPool slots are page-aligned (levers/recompute.py)


def host_pool_bytes(shape: ModelShape, s: Settings) -> int:
    """Pinned host memory for the offloaded checkpoints: one pool of k page-aligned slots, exactly the
    sum (ours), or each checkpoint rounded up to a power of two (per-tensor pin_memory)."""
    k = s.levers.activation_offload
    if k == 0:
        return 0
    per = s.local_tokens * shape.hidden * s.act_bytes  # one checkpointed layer input
    if s.pinned_rounding == "pow2":
        return k * pinned_bytes(per, "pow2")
    return k * (-(-per // PAGE) * PAGE) + PAGE


def host_optimizer_bytes(shape: ModelShape, s: Settings) -> int:
    """ZeRO-Offload on the host: fp32 master (4 N/W) and Adam m, v (8 N/W), pageable; the fp32 gradient
    buffer of each sub-group and the flat gradient partition in the training dtype, both pinned through
    PyTorch's allocator (power-of-two rounded). DeepSpeed fills a sub-group until it reaches sub_group_size,
    so groups land just over it: at 2**28 every 4B group's buffer rounds to 2 GiB (28.1 GiB, the 1M H200
    run: host 118.19 GiB measured, 118.58 predicted); ds_configs/zero3_offload.json uses 2**28 - 2**25."""
    if not s.levers.optimizer_offload or s.optimizer == "none":
        return 0
    n = _trainable_shard_numel(shape, s)
    grads32 = sum(pinned_bytes(g * FP32, "pow2") for g in _sub_group_numels(shape, s))
    return n * 3 * FP32 + grads32 + pinned_bytes(n * s.act_bytes, "pow2")
