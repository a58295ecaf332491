"""What `parallelize` changes on a model, recorded before it changes anything, so that `unparallelize` (or a
parallelize that fails half-way) leaves the model as it was: every module's children, its config references,
its checkpointing attributes and its training mode. The caller's config object is never changed: the model runs
on a private copy while it is parallelized (PrivateConfig), and gets the caller's object back on undo."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

# instance attributes parallelize sets on modules: decoder layers' (HF's GradientCheckpointingLayer reads them), a
# rotary embedding's own forward (model/row_rope.py)
_FLAGS = ("gradient_checkpointing", "_gradient_checkpointing_func", "forward")


def _is_config(value: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


class ModelSnapshot:
    """Every module of `model` as it is now: children, config references, checkpointing flags, training mode."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = []
        for m in model.modules():
            attrs = {k: v for k, v in m.__dict__.items() if k in _FLAGS or _is_config(v)}
            self.modules.append((m, dict(m._modules), m.training, attrs))

    def restore(self) -> None:
        """Put every recorded module back as it was (the wrappers parallelize installed are dropped; the
        modules they wrapped share their parameters, so trained weights stay)."""
        for m, children, training, attrs in self.modules:
            m._modules.clear()
            m._modules.update(children)
            m.training = training
            for k in _FLAGS:
                if k not in attrs:
                    m.__dict__.pop(k, None)
            m.__dict__.update(attrs)


def use_private_config(model: nn.Module) -> Any:
    """Give `model` (and every submodule holding its config or one of its sub-configs) a deep copy of its config,
    so what parallelize sets there (the attention implementation, the experts kernel) never reaches the caller's
    object, nor a model built from it later. Returns the copy."""
    memo: dict[int, Any] = {}
    private = copy.deepcopy(model.config, memo)
    for m in model.modules():
        for k, v in list(m.__dict__.items()):
            if _is_config(v) and id(v) in memo:
                m.__dict__[k] = memo[id(v)]
    return private
