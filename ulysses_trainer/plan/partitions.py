"""The sizes the planner derives from a shape and the run's settings beyond the shape's own counts: the LoRA
adapters' tensors, the tensors that train, this rank's ZeRO-3 partitions and optimizer sub-groups, and what a
pinned buffer occupies on the host."""

from __future__ import annotations

from typing import Any

from .inputs import ModelShape, Settings


def _shard_numel(shape: ModelShape, s: Settings) -> int:
    """Elements of this rank's ZeRO-3 partition: each tensor is padded to a multiple of W and split."""
    if s.zero_stage == 0:
        return shape.num_params
    return sum(-(-n // s.world_size) for n in shape.param_numels)


def lora_numels(shape: ModelShape, target_modules: Any, r: int) -> tuple[int, ...]:
    """The LoRA adapters' tensors (A [r, in], B [out, r] per adapted projection and layer); target_modules
    as the family reads it (Family.lora_targets)."""
    names = shape.family.lora_targets(target_modules)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    q_out = 2 * q if shape.family.gated_attention else q  # an output gate doubles q_proj's width (Qwen3.5)
    dims = {"q_proj": (shape.hidden, q_out), "k_proj": (shape.hidden, kv), "v_proj": (shape.hidden, kv),
            "o_proj": (q, shape.hidden), "gate_proj": (shape.hidden, shape.intermediate),
            "up_proj": (shape.hidden, shape.intermediate), "down_proj": (shape.intermediate, shape.hidden),
            # the fused projections (Phi-3)
            "qkv_proj": (shape.hidden, q + 2 * kv), "gate_up_proj": (shape.hidden, 2 * shape.intermediate)}
    mixer = shape.family.mixer
    own = mixer.lora_shapes(shape.dims) if mixer is not None else {}  # the mixer's Linears (Gated DeltaNet)
    dims.update(own)
    per_layer = [(name, n) for name in shape.family.lora_linears() if name in names
                 for n in (r * dims[name][0], dims[name][1] * r)]
    mixed = set(shape.mixer_layers)  # a mixer layer has its own Linears instead of q/k/v/o_proj
    attention = shape.family.attention_linears
    return tuple(n for i in range(shape.layers) for name, n in per_layer
                 if (name not in attention or i not in mixed) and (name not in own or i in mixed))


def trainable_numels(shape: ModelShape, s: Settings) -> list[int]:
    """The tensors that get gradients and optimizer states: every parameter, or the LoRA adapters."""
    return list(shape.param_numels if s.trainable_numels is None else s.trainable_numels)


def _trainable_shard_numel(shape: ModelShape, s: Settings) -> int:
    """Elements of this rank's partition of the trainable tensors (what gradients and Adam states cover)."""
    if s.trainable_numels is None:
        return _shard_numel(shape, s)
    if s.zero_stage == 0:
        return sum(s.trainable_numels)
    return sum(-(-n // s.world_size) for n in s.trainable_numels)


def _persistence_threshold(shape: ModelShape, s: Settings) -> int:
    t = s.zero3.param_persistence_threshold
    return shape.auto_persistence_threshold if t is None else t


def _sub_group_numels(shape: ModelShape, s: Settings) -> list[int]:
    """ZeRO-3 optimizer sub-groups: parameter partitions packed in order until sub_group_size is reached."""
    groups, acc = [], 0
    for n in trainable_numels(shape, s):
        acc += -(-n // s.world_size)
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
