"""The dense families' torch side: their MLP is Qwen3's gated MLP (tiled by levers/tiled_mlp.TiledMLP); attention
needs nothing beyond the Ulysses attention every family runs. The generic path's plain MLP, down(act(up(x))), tiles
as TiledPlainMLP. INSTALLS is what families/installs.load_modules registers."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ...levers.tiled_mlp import TiledMLP
from ..qwen3 import modules as qwen3_modules
from . import PlainMlp


class TiledPlainMLP(TiledMLP):
    """Drop-in for a plain MLP (up_proj, down_proj, act_fn) that tiles along the rows, state-dict keys unchanged."""

    PARTS = ("up_proj", "down_proj", "act_fn")

    def tile_forward(self, x: Tensor) -> Tensor:
        """down(act(up(x))) on some rows: [r, H] -> [r, I] -> [r, H]."""
        return self.down_proj(self.act_fn(self.up_proj(x)))


def install_plain_mlp(block: PlainMlp, model: Any, layers: Any, tiles: int,
                      experts_implementation: str) -> tuple[Any, float]:
    """Tiled: each layer's MLP becomes a TiledPlainMLP; untiled: left as it is."""
    if tiles > 1:
        for layer in layers:
            layer.mlp = TiledPlainMLP(layer.mlp, tiles)
    return None, 0.0


INSTALLS = {**qwen3_modules.INSTALLS, PlainMlp: install_plain_mlp}
