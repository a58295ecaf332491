"""Qwen2-MoE's torch side: its sparse block (shared expert included) runs as Qwen3-MoE's (levers/sparse_moe.SparseMoE),
whose install it takes. INSTALLS is what families/installs.load_modules registers."""

from __future__ import annotations

from ..qwen3_moe import modules as qwen3_moe_modules

INSTALLS = dict(qwen3_moe_modules.INSTALLS)
