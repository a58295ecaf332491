"""OLMo 2's torch side: its MLP is Qwen3's gated MLP (tiled by levers/tiled_mlp.TiledMLP); its post-norms and its
whole-projection q/k norms are transformers' own modules, which run on each rank's tokens with all heads before the
all-to-all. INSTALLS is what families/installs.load_modules registers."""

from __future__ import annotations

from ..qwen3 import modules as qwen3_modules

INSTALLS = dict(qwen3_modules.INSTALLS)
