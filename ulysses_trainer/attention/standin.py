"""A memory-only stand-in for the attention kernel, for benchmarks at lengths where a real step
takes too long. It allocates and keeps exactly what a flash-style kernel does — the output and
an fp32 log-sum-exp in forward; dq, dk, dv plus an fp32 dq accumulator in backward — and does no
attention math. Results computed with it are meaningless; only memory is. Never picked by `auto`.
"""

from __future__ import annotations

import torch


class _StandIn(torch.autograd.Function):
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


def standin_attention(q, k, v, *, scale: float, cu_seqlens=None, max_seqlen=None) -> torch.Tensor:
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d]; memory-faithful, numerically meaningless."""
    return _StandIn.apply(q, k, v)
