"""Count what autograd keeps for backward: the memory side of the levers' tests, on CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def saved_bytes(module: nn.Module, run: Callable[[], Any]) -> tuple[Any, int]:
    """(run()'s result, bytes of the tensors autograd saved while it ran), by storage, so a tensor saved
    twice counts once; `module`'s parameters are not counted."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())
