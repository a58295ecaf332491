"""Mixtral's torch side: its sparse block runs as Qwen3-MoE's (levers/sparse_moe.SparseMoE: transformers' router,
the experts by tiles, the router statistics over the SP group), whose install it takes. INSTALLS is what
families/installs.load_modules registers."""

from __future__ import annotations

from ..qwen3_moe import modules as qwen3_moe_modules

INSTALLS = dict(qwen3_moe_modules.INSTALLS)
