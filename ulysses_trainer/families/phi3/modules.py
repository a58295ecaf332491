"""Phi-3's torch side: what parallelize swaps in for its fused gated MLP (INSTALLS, which
families/installs.load_modules registers). Its fused qkv_proj needs nothing: Phi3Attention splits it on this rank's
tokens before it calls the attention function (the all-to-all comes after)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ...levers.tiled_mlp import TiledMLP
from . import FusedGatedMlp


class TiledFusedMLP(TiledMLP):
    """Drop-in for Phi3MLP that tiles along the rows: it adopts gate_up_proj, down_proj and activation_fn under the
    same names (state-dict keys unchanged) and runs Phi3MLP's forward, op for op, on each tile."""

    PARTS = ("gate_up_proj", "down_proj", "activation_fn")

    def tile_forward(self, x: Tensor) -> Tensor:
        """Phi3MLP's forward on some rows: [r, H] -> [r, 2I] -> gate, up [r, I] each -> [r, H]."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


def install_fused_mlp(block: FusedGatedMlp, model: Any, layers: Any, tiles: int,
                      experts_implementation: str) -> tuple[Any, float]:
    """Tiled: each layer's MLP becomes a TiledFusedMLP (same state-dict keys); untiled: left as it is."""
    if tiles > 1:
        for layer in layers:
            layer.mlp = TiledFusedMLP(layer.mlp, tiles)
    return None, 0.0


INSTALLS = {FusedGatedMlp: install_fused_mlp}
