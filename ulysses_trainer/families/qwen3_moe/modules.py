"""Qwen3-MoE's torch side: its sparse block runs as levers/sparse_moe.SparseMoE (INSTALLS, which
families/installs.load_modules registers)."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ...levers.sparse_moe import RouterStats, SparseMoE
from . import SparseMoeMlp


def install_sparse_moe(block: SparseMoeMlp, model: Any, layers: Any, tiles: int, experts_implementation: str,
                       moe_class: type[SparseMoE] = SparseMoE) -> tuple[Any, float]:
    """Each layer's block becomes a SparseMoE (tiled or not; a family's subclass: `moe_class`) sharing one
    RouterStats when the config asks for router logits (the load-balancing loss, router_aux_loss_coef times); the
    experts kernel is set."""
    c = model.config
    d = block.dims(c)
    stats, coef = None, 0.0
    if getattr(c, "output_router_logits", False):
        stats, coef = RouterStats(d["experts"], d["top_k"]), float(getattr(c, "router_aux_loss_coef", 0.0))
    for layer in layers:
        # a config without norm_topk_prob (Qwen3.5-MoE) has a router that always renormalises
        layer.mlp = moe_class(layer.mlp, tiles, stats, d["top_k"], bool(getattr(c, "norm_topk_prob", True)))
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts_implementation)
    elif experts_implementation != "eager":  # a transformers without the choice runs its loop
        raise ConfigError(f"experts_implementation {experts_implementation} needs a transformers with "
                          f"set_experts_implementation; use eager or upgrade transformers")
    return stats, coef


INSTALLS = {SparseMoeMlp: install_sparse_moe}
