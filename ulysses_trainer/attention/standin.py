"""A memory-only stand-in for the attention kernel, for benchmarks at lengths where a real step
takes too long. It allocates and keeps exactly what the real kernel path does and does no attention
math. Results computed with it are meaningless; only memory is. Never picked by `auto`.

`standin_attention` mirrors ours (attention/grouped.py: one KV-head group at a time, out + fp32
log-sum-exp kept, an fp32 dq accumulator per group in backward), `standin_attention_fa4` flash-attn-4's
path through the same groups (every layer, even one KV head per rank); `standin_attention_full_heads`
mirrors a kernel called on all heads at once (F.sdpa in the HF and ALST baselines).
"""

from __future__ import annotations

import torch

from .grouped import BACKENDS, grouped_attention, runs_grouped


class _StandInFullHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        b, s, h, _ = q.shape
        out = q.clone()  # [b, s, hq, d], like the kernel's output
        lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)  # kept for backward
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # flash bwd workspace
        dq = grad.clone()
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        del dq_accum
        return dq, dk, dv


def standin_attention(q, k, v, *, scale: float, cu_seqlens=None, max_seqlen=None, stash=None,
                      layer=None, pad_spans=()) -> torch.Tensor:
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d]; memory-faithful to ours, numerically meaningless."""
    if not runs_grouped(k.shape[2], stash):  # ours runs F.sdpa on all heads then (attention/kernels.py)
        return _StandInFullHeads.apply(q, k, v)
    return grouped_attention(q, k, v, scale, BACKENDS["standin"], stash, layer)


def standin_attention_fa4(q, k, v, *, scale: float, cu_seqlens=None, max_seqlen=None, stash=None,
                          layer=None, pad_spans=()) -> torch.Tensor:
    """As standin_attention, on flash-attn-4's path (attention/kernels.py flash4_attention): dense rows one
    KV-head group at a time whatever the count, so a memory-only run at a length flash-attn-4 cannot reach in
    time allocates per layer what the plan counts for it (its group term is the same as the stand-in's)."""
    return grouped_attention(q, k, v, scale, BACKENDS["standin"], stash, layer)


def standin_attention_full_heads(q, k, v, *, scale: float, cu_seqlens=None, max_seqlen=None) -> torch.Tensor:
    """As standin_attention, for a kernel called on all heads at once (the baselines' F.sdpa)."""
    return _StandInFullHeads.apply(q, k, v)
