"""Granite's torch side: its MLP is Qwen3's gated MLP (tiled by levers/tiled_mlp.TiledMLP; the layer scales the
MLP's output by residual_multiplier after it, untouched); its multipliers are transformers' own modules' and the
loss head's (model/loss_head.py). INSTALLS is what families/installs.load_modules registers."""

from __future__ import annotations

from ..qwen3 import modules as qwen3_modules

INSTALLS = dict(qwen3_modules.INSTALLS)
