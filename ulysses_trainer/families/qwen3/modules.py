"""Qwen3's torch side: what parallelize swaps in for its gated MLP (INSTALLS, which families/installs.load_modules
registers)."""

from __future__ import annotations

from typing import Any

from ...levers.tiled_mlp import TiledMLP
from . import GatedMlp


def install_gated_mlp(block: GatedMlp, model: Any, layers: Any, tiles: int,
                      experts_implementation: str) -> tuple[Any, float]:
    """Tiled: each layer's MLP becomes a TiledMLP (same state-dict keys); untiled: left as it is."""
    if tiles > 1:
        for layer in layers:
            layer.mlp = TiledMLP(layer.mlp, tiles)
    return None, 0.0


INSTALLS = {GatedMlp: install_gated_mlp}
