"""Create Adam's m and v inside a ZeRO-3 engine before the first step (memory probes and rehearsals).

DeepSpeed skips an update whose gradient norm is not finite, and a skipped first update never
allocates m and v. A run whose numbers mean nothing (the attention stand-in, the fake process group
of `rehearse`) must still hold them, as every real step after the first does.
"""

from __future__ import annotations

import torch


def materialize_adam_states(engine) -> int:
    """Run the inner optimizer once on zero gradients over every fp32 partition of ZeRO-3 (on the GPU or,
    with optimizer offload, on the host: torch AdamW or DeepSpeed's CPU Adam alike). The weights move by
    weight decay only. Returns the bytes of the optimizer states created."""
    zero = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3
    inner = zero.optimizer  # Stage3 lends it one flat fp32 partition per sub-group at a time
    for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
        group = inner.param_groups[zero.sub_group_to_group_id[i]]
        kept = flat.grad  # with optimizer offload Stage3 keeps a pinned host grad buffer here
        flat.grad = torch.zeros_like(flat) if kept is None else kept.zero_()
        group["params"] = [flat]
        inner.step()
        group["params"] = []
        flat.grad = kept
    return sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)
