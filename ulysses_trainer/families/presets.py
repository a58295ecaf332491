"""Presets with the real dimensions (random weights), plus `tiny` / `tiny-moe` for CPU tests.

The dimensions live with their family (families/); this builds the transformers config (the planner's
ModelShape.preset and the model's loading both ask here).
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from ..errors import ConfigError
from . import PRESETS, preset_family


def is_preset(name: str) -> bool:
    return preset_family(name) is not None


def preset_config(name: str) -> PretrainedConfig:
    """A fresh config of the preset's family for a preset name (case-insensitive)."""
    fam = preset_family(name)
    if fam is None:
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return AutoConfig.for_model(fam.model_type, **fam.presets[name.lower()])  # the family's config class
