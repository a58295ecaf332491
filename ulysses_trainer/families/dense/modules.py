"""The dense families' torch side: their MLP is Qwen3's gated MLP (tiled by levers/tiled_mlp.TiledMLP); attention
needs nothing beyond the Ulysses attention every family runs. INSTALLS is what families/installs.load_modules
registers."""

from __future__ import annotations

from ..qwen3 import modules as qwen3_modules

INSTALLS = dict(qwen3_modules.INSTALLS)
