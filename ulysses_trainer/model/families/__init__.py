"""The model families: what is family-specific, one module each (a torchtitan TrainSpec in spirit).

Torch-free, so the planner reads the same facts the trainer builds from. A family holds its
transformers names (config and causal-LM classes), its presets, the decoder layer's parameters in
module order (what the memory model, the ZeRO-3 trace and the FLOP counts assume), its MLP kind and
whether it has q/k norms. Another family is one new module here plus its entry in FAMILIES.
"""

from __future__ import annotations

from ...errors import ConfigError
from .base import Family, LayerDims
from .qwen3 import QWEN3
from .qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {f.model_type: f for f in (QWEN3, QWEN3_MOE)}
# preset name -> its family (a name belongs to one family)
_PRESET_FAMILY: dict[str, Family] = {name: f for f in FAMILIES.values() for name in f.presets}
PRESETS: tuple[str, ...] = tuple(_PRESET_FAMILY)
MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def family(model_type: str) -> Family:
    """The family of a transformers model_type; ConfigError naming the supported ones."""
    f = FAMILIES.get(model_type)
    if f is None:
        raise ConfigError(f"model_type {model_type!r} is not supported; this trainer supports "
                          f"{', '.join(MODEL_TYPES)} (Qwen3 and Qwen3-MoE checkpoints or the presets)")
    return f


def preset_family(name: str) -> Family | None:
    """The family a preset name (case-insensitive) belongs to, or None."""
    return _PRESET_FAMILY.get(name.lower())


__all__ = ["FAMILIES", "MODEL_TYPES", "PRESETS", "Family", "LayerDims", "family", "preset_family"]
