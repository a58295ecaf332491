"""What `parallelize` swaps into a model for a family's MLP block and token mixer: the model's side of a family.

families/ holds a family's torch-free facts (below the planner); the modules swapped in are runtime code (levers/,
parallel/), above it, so the installs live here, keyed by the block's or mixer's class (the nearest registered
class in its MRO: Qwen3.5-MoE's SharedExpertMoeMlp runs as Qwen3-MoE's SparseMoeMlp). parallelize asks
`installer(block)` before it changes the model and never which family it has. A family of your own registers its
block's install with `register_install` (tests/plain_mlp_family.py does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..families.qwen3 import GatedMlp
from ..families.qwen3_5 import GatedDeltaNet
from ..families.qwen3_moe import SparseMoeMlp
from ..levers.sparse_moe import RouterStats, SparseMoE
from ..levers.tiled_mlp import TiledMLP
from ..parallel.ulysses_deltanet import UlyssesGatedDeltaNet

# (block, model, layers, tiles, experts_implementation) -> (load-balancing statistics or None, their coefficient)
MlpInstall = Callable[[Any, Any, Any, int, str], tuple[Any, float]]
# (mixer, layers, state, kernel) -> how many layers it swapped
MixerInstall = Callable[[Any, Any, Any, str], int]


def _gated_mlp(block: GatedMlp, model: Any, layers: Any, tiles: int, experts_implementation: str) -> tuple[Any, float]:
    """Tiled: each layer's MLP becomes a TiledMLP (same state-dict keys); untiled: left as it is."""
    if tiles > 1:
        for layer in layers:
            layer.mlp = TiledMLP(layer.mlp, tiles)
    return None, 0.0


def _sparse_moe(block: SparseMoeMlp, model: Any, layers: Any, tiles: int,
                experts_implementation: str) -> tuple[Any, float]:
    """Each layer's block becomes a SparseMoE (tiled or not) sharing one RouterStats when the config asks for
    router logits (the load-balancing loss, router_aux_loss_coef times); the experts kernel is set."""
    c = model.config
    d = block.dims(c)
    stats, coef = None, 0.0
    if getattr(c, "output_router_logits", False):
        stats, coef = RouterStats(d["experts"], d["top_k"]), float(getattr(c, "router_aux_loss_coef", 0.0))
    for layer in layers:
        # a config without norm_topk_prob (Qwen3.5-MoE) has a router that always renormalises
        layer.mlp = SparseMoE(layer.mlp, tiles, stats, d["top_k"], bool(getattr(c, "norm_topk_prob", True)))
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts_implementation)
    elif experts_implementation != "eager":  # a transformers without the choice runs its loop
        raise ConfigError(f"experts_implementation {experts_implementation} needs a transformers with "
                          f"set_experts_implementation; use eager or upgrade transformers")
    return stats, coef


def _gated_deltanet(mixer: GatedDeltaNet, layers: Any, state: Any, kernel: str) -> int:
    """Each DeltaNet layer's linear_attn becomes an UlyssesGatedDeltaNet (same state-dict keys)."""
    n = 0
    for layer in layers:
        net = getattr(layer, "linear_attn", None)
        if net is not None and not isinstance(net, UlyssesGatedDeltaNet):
            layer.linear_attn = UlyssesGatedDeltaNet(net, state, kernel)
            n += 1
    return n


_INSTALLS: dict[type, MlpInstall | MixerInstall] = {GatedMlp: _gated_mlp, SparseMoeMlp: _sparse_moe,
                                                   GatedDeltaNet: _gated_deltanet}


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
                      f"register one (ulysses_trainer.model.install.register_install)")
