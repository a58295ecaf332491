"""The weights of a parallelized model with the stock model's keys: what `from_pretrained`'s model and
`load_state_dict` of a stock HF model take (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`), not the
wrapper's (`causal_lm.` first, as `engine.save_16bit_model` writes them)."""

from __future__ import annotations

import os
from typing import Any

import torch

PREFIX = "causal_lm."  # SequenceParallelCausalLM holds the HF model as `causal_lm`


def stock_state_dict(model: Any) -> dict[str, torch.Tensor] | None:
    """The stock keys' state dict of what parallelize returned, or of the DeepSpeed engine holding it.
    An engine under ZeRO-3 is collective (every rank calls it): DeepSpeed consolidates the 16-bit weights on rank 0,
    as engine.save_16bit_model does, and the other ranks get None. Without an engine: the model's own tensors.
    The wrapper's own state (none beside the HF model) is left out."""
    if hasattr(model, "zero_optimization_partition_weights"):  # a DeepSpeed engine
        state = (model._zero3_consolidated_16bit_state_dict() if model.zero_optimization_partition_weights()
                 else model.module.state_dict())
    else:
        state = model.state_dict()
    if state is None:
        return None
    return {k.removeprefix(PREFIX): v for k, v in state.items() if k.startswith(PREFIX)}


def save_stock_model(engine: Any, save_dir: str, save_filename: str = "pytorch_model.bin") -> str | None:
    """engine.save_16bit_model with the stock model's keys: every rank calls it (collective under ZeRO-3); rank 0
    writes save_dir/save_filename (torch.save, tied weights kept shared) and gets its path, the others None.
    A stock model of the same config loads it: model.load_state_dict(torch.load(path)) (no missing or unexpected
    keys)."""
    state = stock_state_dict(engine)
    if engine.global_rank != 0:
        return None
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, save_filename)
    torch.save(state, path)
    return path
