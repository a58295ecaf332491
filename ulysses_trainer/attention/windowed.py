"""Sliding-window causal attention over one document, many query blocks per kernel call.

Query i sees keys (i - window, i] (transformers' sliding_window_overlay: kv > q - window), and with a sink also
one always-reachable key (gpt-oss's). The queries go in blocks of `window`; block j's reachable keys lie in the
2 * window keys before its end, so every block has the same [window, 2 * window] mask relative to its keys. Blocks
are batched (the block index as SDPA's batch), so a 1M-token document costs a few dozen kernel calls, not one per
block; no n x n mask is built.

Invariants: a real query never reaches a key past itself (the padded tail is never seen), the front padding is
masked off (block 0), so each query's softmax runs over exactly its window (and the sink).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# elements of a call's boolean mask (blocks x window x 2 * window): 64M keeps it and its bias copy under ~200 MB
MASK_ELEMENTS = 1 << 26
# queries a call at most: bounds the blocks' gathered keys and values (2 x queries x heads x width each)
CALL_QUERIES = 1 << 16


def blocks_per_call(window: int) -> int:
    """How many query blocks one SDPA call takes at this window."""
    return max(1, min(CALL_QUERIES // window, MASK_ELEMENTS // (2 * window * window)))


def _block_keys(t: torch.Tensor, j0: int, j1: int, window: int) -> torch.Tensor:
    """Blocks j0..j1-1's keys from t front-padded by `window` rows: [(nb+1)*W, hk, w] -> [G, 2W, hk, w]."""
    rows = t[j0 * window:(j1 + 1) * window]  # [(G+1)*W, hk, w]
    return rows.unfold(0, 2 * window, window).permute(0, 3, 1, 2)  # [G, hk, w, 2W] -> [G, 2W, hk, w]


def _repeat_heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    """[G, m, hk, w] -> [G, m, hk * rep, w]: each KV head for its query heads (the masked kernel takes no GQA)."""
    if rep == 1:
        return t
    g, m, hk, w = t.shape
    return t[:, :, :, None].expand(g, m, hk, rep, w).reshape(g, m, hk * rep, w)


def window_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                  sink_k: torch.Tensor | None = None, sink_v: torch.Tensor | None = None) -> torch.Tensor:
    """One document: q [n, h, w], k, v [n, hk, w] -> [n, h, w], each query over its window of keys, and over
    (sink_k, sink_v) [1, hk, w] too when given."""
    n, h, w = q.shape
    hk, wide = k.shape[1], window
    nb = -(-n // wide)
    qp = F.pad(q, (0, 0, 0, 0, 0, nb * wide - n)).view(nb, wide, h, w)  # [nb, W, h, w]
    kp, vp = (F.pad(t, (0, 0, 0, 0, wide, nb * wide - n)) for t in (k, v))  # [(nb+1)*W, hk, w]: W zero rows first
    r = torch.arange(wide, device=q.device)[:, None]
    c = torch.arange(2 * wide, device=q.device)[None, :]
    base = (c > r) & (c <= r + wide)  # [W, 2W]: key c (absolute a - W + c) against query r (absolute a + r)
    g = blocks_per_call(wide)
    outs = []
    for j0 in range(0, nb, g):
        j1 = min(j0 + g, nb)
        kb, vb = (_block_keys(t, j0, j1, wide) for t in (kp, vp))  # [G, 2W, hk, w]
        mask = base[None, None]  # [1, 1, W, 2W]
        if j0 == 0:  # block 0's first W keys are the front padding
            first = torch.ones(j1 - j0, 1, 1, 2 * wide, dtype=torch.bool, device=q.device)
            first[0, ..., :wide] = False
            mask = mask & first  # [G, 1, W, 2W]
        if sink_k is not None:  # the sink first in every block, reachable from every query
            kb = torch.cat([sink_k[None].expand(j1 - j0, 1, hk, w), kb], dim=1)  # [G, 2W+1, hk, w]
            vb = torch.cat([sink_v[None].expand(j1 - j0, 1, hk, w), vb], dim=1)
            mask = F.pad(mask, (1, 0), value=True)  # [., 1, W, 2W+1]
        kb, vb = (_repeat_heads(t, h // hk) for t in (kb, vb))  # [G, m, h, w]
        # [G, W, h, w] -> [G, h, W, w] for SDPA, and back
        out = F.scaled_dot_product_attention(qp[j0:j1].transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                             attn_mask=mask, scale=scale)
        outs.append(out.transpose(1, 2).reshape(-1, h, w))
    return torch.cat(outs)[:n]
