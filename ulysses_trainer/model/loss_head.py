"""The lm_head that can also return the loss: it owns the same weight, so ZeRO-3 gathers it.

ZeRO-3 gathers a module's own parameters when that module's forward runs; computing the chunked
loss inside the lm_head's forward is what lets it use the full weight without building logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..levers.chunked_loss import chunked_bucket_sums, chunked_nll_sum, nll_sum, softcapped

LOSS_TYPES = ("chunked_nll", "nll")


class LossHead(nn.Module):
    """Replaces `lm_head` (same `weight` Parameter, same state_dict key). forward(hidden) gives
    logits as before; forward(hidden, labels) gives the fp32 sum of token NLLs over valid labels;
    forward(hidden, labels, buckets, num_buckets) evaluation's [num_buckets, 3] sums (chunked_bucket_sums).
    `softcap`: the config's final_logit_softcapping (Gemma), applied to the logits wherever they are made;
    logits_scaling: every logit divided by it first, as the model's own head does (Granite's config field; 1: none)."""

    def __init__(self, lm_head: nn.Linear, loss_type: str = "chunked_nll", chunk_size: int = 256,
                 softcap: float | None = None, logits_scaling: float = 1.0):
        super().__init__()
        assert getattr(lm_head, "bias", None) is None, "lm_head with a bias is not supported"
        assert loss_type in LOSS_TYPES, f"loss_type {loss_type!r}: use one of {LOSS_TYPES}"
        self.weight = lm_head.weight  # shared Parameter: tied embeddings stay tied
        self.in_features, self.out_features = lm_head.in_features, lm_head.out_features
        self.loss_type, self.chunk_size = loss_type, chunk_size
        self.softcap = softcap or None
        self.logits_scaling = float(logits_scaling)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, buckets: torch.Tensor | None = None,
                num_buckets: int = 0) -> torch.Tensor:
        s = self.logits_scaling
        if labels is None:
            logits = F.linear(hidden, self.weight)
            return softcapped(logits / s if s != 1.0 else logits, self.softcap)
        kw = dict(softcap=self.softcap, logits_scaling=s)
        if buckets is not None:  # plain nll: every row in one chunk, the full logits as its loss builds them
            chunk = self.chunk_size if self.loss_type == "chunked_nll" else max(1, labels.numel())
            return chunked_bucket_sums(hidden, self.weight, labels, buckets, num_buckets, chunk, **kw)
        if self.loss_type == "chunked_nll":
            return chunked_nll_sum(hidden, self.weight, labels, self.chunk_size, **kw)
        return nll_sum(hidden, self.weight, labels, **kw)
