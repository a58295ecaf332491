"""The model families, each one folder (a torchtitan TrainSpec in spirit), registered here once.

A family's folder holds two layers. Its `__init__` is its torch-free facts, below both the planner and the model code
(it imports nothing of the package but errors, the plan's vocabulary and other families' facts), so the planner reads
the same facts the trainer builds from: its transformers names (config and causal-LM classes), its presets (presets.py
builds their configs), the decoder layer's parameters in module order (what the memory model, the ZeRO-3 trace and the
FLOP counts assume), whether it has q/k norms, its MLP block and token mixer as behaviour (base.MlpBlock,
base.TokenMixer: parameters, memory and time terms, ZeRO-3 trace groups, collectives, LoRA targets, what training sets
on its config). Its `modules.py` (Family.modules) is its torch side, on the runtime code: what parallelize swaps in for
its block and mixer, and its Ulysses pieces (Qwen3.5's Gated DeltaNet split by head, its kernels, its lean gated norm),
registered through installs.py when a model of the family is parallelized. Nothing outside asks which family it has.
Another family is one new folder here plus its entry in FAMILIES, or `register(family)` (and installs.register_install
for a new block) from outside (tests/test_family_seam.py adds one that way). """

from __future__ import annotations

from ..errors import ConfigError
from .base import AllReduce, Family, LayerDims, MlpBlock, MlpRun, TokenMixer
from .dense import LLAMA, MINISTRAL, MISTRAL, QWEN2
from .gemma3 import GEMMA3
from .gpt_oss import GPT_OSS
from .granite import GRANITE
from .mixtral import MIXTRAL
from .olmo2 import OLMO2
from .phi3 import PHI3
from .qwen2_moe import QWEN2_MOE
from .qwen3 import QWEN3
from .qwen3_5 import QWEN3_5, QWEN3_5_MOE
from .qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {f.model_type: f for f in (QWEN3, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE, LLAMA, MISTRAL,
                                                         MINISTRAL, QWEN2, GEMMA3, GRANITE, OLMO2, PHI3, MIXTRAL,
                                                         QWEN2_MOE, GPT_OSS)}
# preset name -> its family (a name belongs to one family)
_PRESET_FAMILY: dict[str, Family] = {name: f for f in FAMILIES.values() for name in f.presets}
PRESETS: tuple[str, ...] = tuple(_PRESET_FAMILY)
MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def family(model_type: str) -> Family:
    """The family of a transformers model_type; ConfigError naming the supported ones."""
    f = FAMILIES.get(model_type)
    if f is None:
        raise ConfigError(f"model_type {model_type!r} is not supported; this trainer supports "
                          f"{supported()}")
    return f


def supported() -> str:
    """The model types this trainer runs, for a refusal (docs/models.md tables what was proven for each)."""
    return f"{', '.join(FAMILIES)} (checkpoints of these architectures or the presets; docs/models.md)"


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
           "family", "preset_family", "register", "supported", "unregister"]
