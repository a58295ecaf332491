"""What `parallelize` swaps into a model for a family's MLP block and token mixer, keyed by the block's class.

A family folder's torch side (its `modules.py`, named by Family.modules) holds its INSTALLS; parallelize imports it
and registers them (`load_modules`), then asks `installer(block)` before it changes the model, never which family
it has. The lookup takes the nearest registered class in the block's MRO (Qwen3.5-MoE's
SharedExpertMoeMlp runs as Qwen3-MoE's SparseMoeMlp). Torch-free: the registry holds callables, the planner never
imports a torch side. A family of your own registers its block's install with `register_install`
(tests/plain_mlp_family.py does).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .base import Family

# (block, model, layers, tiles, experts_implementation) -> (load-balancing statistics or None, their coefficient)
MlpInstall = Callable[[Any, Any, Any, int, str], tuple[Any, float]]
# (mixer, layers, state, setup: vocabulary/model_setup.ModelSetup) -> how many layers it swapped
MixerInstall = Callable[[Any, Any, Any, Any], int]

_INSTALLS: dict[type, MlpInstall | MixerInstall] = {}


def load_modules(fam: Family) -> None:
    """Import the family's torch side (Family.modules) and register its INSTALLS ({block or mixer class: its
    install}), leaving any install registered for a class already in place."""
    if fam.modules:
        for kind, install in getattr(importlib.import_module(fam.modules), "INSTALLS", {}).items():
            _INSTALLS.setdefault(kind, install)


def register_install(kind: type, install: MlpInstall | MixerInstall) -> None:
    """What parallelize swaps in for blocks (an MlpBlock subclass: MlpInstall) or mixers (a TokenMixer subclass:
    MixerInstall) of class `kind`; ValueError when `kind` has one already."""
    if kind in _INSTALLS:
        raise ValueError(f"{kind.__name__} has an install registered already")
    _INSTALLS[kind] = install


def unregister_install(kind: type) -> None:
    """Remove an install registered with `register_install`."""
    del _INSTALLS[kind]


def installer(part: Any) -> Callable[..., Any]:
    """The install of a family's MLP block or token mixer (the nearest class in its MRO that has one); ConfigError
    naming the fix for one without."""
    for kind in type(part).__mro__:
        if kind in _INSTALLS:
            return _INSTALLS[kind]
    raise ConfigError(f"{type(part).__name__} has no install: parallelize does not know what to swap in for it; "
                      f"register one (ulysses_trainer.families.installs.register_install)")
