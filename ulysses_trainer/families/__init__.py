"""The model families: what is family-specific, one module each (a torchtitan TrainSpec in spirit).

Torch-free and below both the planner and the model code (it imports nothing of the package but errors), so the
planner reads the same facts the trainer builds from. A family holds its transformers names (config and causal-LM
classes), its presets (presets.py builds their configs), the decoder layer's parameters in module order (what the
memory model, the ZeRO-3 trace and the FLOP counts assume), whether it has q/k norms, and its MLP block as
behaviour (base.MlpBlock: parameters, memory and time terms, ZeRO-3 trace groups, collectives, LoRA targets, what
training sets on its config). What parallelize swaps in for a block is model/install.py's, keyed by the block's
class. Nothing outside these asks which family it has. Another family is one new module here plus its entry in
FAMILIES, or `register(family)` (and model/install.register_install for a new block) from outside
(tests/test_family_seam.py adds one that way).
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import AllReduce, Family, LayerDims, MlpBlock, MlpRun, TokenMixer
from .qwen3 import QWEN3
from .qwen3_5 import QWEN3_5, QWEN3_5_MOE
from .qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {f.model_type: f for f in (QWEN3, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE)}
# preset name -> its family (a name belongs to one family)
_PRESET_FAMILY: dict[str, Family] = {name: f for f in FAMILIES.values() for name in f.presets}
PRESETS: tuple[str, ...] = tuple(_PRESET_FAMILY)
MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def family(model_type: str) -> Family:
    """The family of a transformers model_type; ConfigError naming the supported ones."""
    f = FAMILIES.get(model_type)
    if f is None:
        raise ConfigError(f"model_type {model_type!r} is not supported; this trainer supports "
                          f"{', '.join(FAMILIES)} (Qwen3, Qwen3-MoE and Qwen3.5 text checkpoints or the presets)")
    return f


def register(fam: Family) -> None:
    """Add a family (and its presets) to those the trainer and the planner accept; ValueError for a model_type
    or preset name already taken."""
    taken = [n for n in (fam.model_type, *fam.presets) if n in FAMILIES or n in _PRESET_FAMILY]
    if taken:
        raise ValueError(f"family {fam.model_type}: {', '.join(taken)} already registered")
    FAMILIES[fam.model_type] = fam
    _PRESET_FAMILY.update({name: fam for name in fam.presets})


def unregister(model_type: str) -> None:
    """Remove a family registered with `register` (and its presets)."""
    fam = FAMILIES.pop(model_type)
    for name in fam.presets:
        _PRESET_FAMILY.pop(name, None)


def preset_family(name: str) -> Family | None:
    """The family a preset name (case-insensitive) belongs to, or None."""
    return _PRESET_FAMILY.get(name.lower())


__all__ = ["FAMILIES", "MODEL_TYPES", "PRESETS", "AllReduce", "Family", "LayerDims", "MlpBlock", "MlpRun", "TokenMixer",
           "family", "preset_family", "register", "unregister"]
