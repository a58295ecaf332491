"""Gemma 3's torch side: its MLP is a gated MLP (GELU-tanh, tiled by levers/tiled_mlp.TiledMLP through the model's own
act_fn); its attention, norms and embedding need nothing beyond the Ulysses attention and lean norms every family
runs. INSTALLS is what families/installs.load_modules registers."""

from __future__ import annotations

from ..qwen3 import modules as qwen3_modules

INSTALLS = dict(qwen3_modules.INSTALLS)
