"""Qwen3.5's torch side: its Gated DeltaNet layers split by head under Ulysses (ulysses_deltanet.py, on the
kernels of deltanet_kernels.py) with their gated norm kept lean (lean_gated_norm.py); its MLP blocks are Qwen3's
gated MLP and Qwen3-MoE's sparse block, whose installs it takes from their torch sides. INSTALLS is what
families/installs.load_modules registers."""

from __future__ import annotations

from typing import Any

from ..qwen3 import modules as qwen3_modules
from ..qwen3_moe import modules as qwen3_moe_modules
from . import GatedDeltaNet
from .lean_gated_norm import use_lean_gated_norms
from .ulysses_deltanet import UlyssesGatedDeltaNet


def install_gated_deltanet(mixer: GatedDeltaNet, layers: Any, state: Any, setup: Any) -> int:
    """Each DeltaNet layer's linear_attn becomes an UlyssesGatedDeltaNet (same state-dict keys) running
    setup.deltanet_kernel; with setup.lean_norm its gated RMSNorm keeps only its input and gate."""
    n = 0
    for layer in layers:
        net = getattr(layer, "linear_attn", None)
        if net is not None and not isinstance(net, UlyssesGatedDeltaNet):
            layer.linear_attn = UlyssesGatedDeltaNet(net, state, setup.deltanet_kernel)
            n += 1
    if setup.lean_norm:
        for layer in layers:
            use_lean_gated_norms(layer)
    return n


# the dense model runs Qwen3's MLP, the MoE model Qwen3-MoE's block (its shared expert included)
INSTALLS = {**qwen3_modules.INSTALLS, **qwen3_moe_modules.INSTALLS, GatedDeltaNet: install_gated_deltanet}
