"""Causal attention over the full sequence for a slice of heads, with packed documents kept apart.

Every kernel takes q [b, s, hq, d] and k, v [b, s, hkv, d] (hq a multiple of hkv) and returns
[b, s, hq, d]. `cu_seqlens` (int32 segment starts over the flattened [b*s] batch, plus the end)
says where documents begin; with one document per row the dense causal kernel runs. `pad_spans` (host
(start, end) pairs, parallel/sharding.ShardContext.pad_spans): the rows' pads, segments of their own in cu_seqlens;
the per-document paths skip them (output 0), a varlen kernel runs them at one tile a segment.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..vocabulary.names import STANDIN, STANDIN_FA4
from .grouped import BACKENDS, Documents, default_backend, grouped_attention, runs_grouped
from .standin import standin_attention, standin_attention_fa4
from .windowed import window_blocks


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_kernels() -> list[str]:
    """Installed kernels, fastest first (H200 fwd+bwd: FA4 ~660, SDPA-cuDNN ~570 TFLOP/s)."""
    found = []
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability()[0]
        if major in (9, 10) and _has("flash_attn.cute"):
            found.append("flash_attention_4")
        if _has("flash_attn") and _has("flash_attn.flash_attn_interface"):
            found.append("flash_attention_2")
    found.append("sdpa")
    return found


def _single_doc_per_row(cu_seqlens: torch.Tensor | None, b: int) -> bool:
    return cu_seqlens is None or cu_seqlens.numel() - 1 == b


def _sdpa_dense(q, k, v, scale, stash=None, layer=None):
    backend = default_backend(q.device)
    # PyTorch's SDPA kernels one KV-head group at a time (attention/grouped.py); with one group that saves
    # nothing, so F.sdpa runs, unless the kernel's outputs are to be kept for the recompute (stash)
    if backend is not None and runs_grouped(k.shape[2], stash):
        return grouped_attention(q, k, v, scale, backend, stash, layer)
    # [b, s, h, d] -> [b, h, s, d] for SDPA, and back
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1, *t.shape[2:])  # [b, s, h, d] -> [1, b*s, h, d]: cu_seqlens index the flattened batch


def sdpa_attention(q, k, v, *, scale: float, cu_seqlens=None, max_seqlen=None, stash=None,
                   layer=None, pad_spans=()) -> torch.Tensor:
    """SDPA; packed documents run one at a time (no s x s mask is ever built), and like dense rows one KV-head
    group at a time with the explicit-LSE kernels where the planner's rule says so (attention/grouped.py), so
    `stash`/`layer` keep/reuse the kernel's outputs across a checkpoint's recompute (attention/stash.py)."""
    b, s = q.shape[:2]
    if _single_doc_per_row(cu_seqlens, b):
        return _sdpa_dense(q, k, v, scale, stash, layer)
    backend = default_backend(q.device)
    docs = Documents(cu_seqlens, max_seqlen, pad_spans)
    if backend is not None and runs_grouped(k.shape[2], stash):
        return grouped_attention(_flat(q), _flat(k), _flat(v), scale, backend, stash, layer, docs).reshape(q.shape)
    qf, kf, vf = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))  # [b, s, h, d] -> [b*s, h, d]
    outs = [qf.new_zeros(e - a, *qf.shape[1:]) if pad else _sdpa_dense(qf[None, a:e], kf[None, a:e], vf[None, a:e],
                                                                        scale)[0]
            for a, e, pad in docs.pieces()]  # the pads' output is 0: no kernel runs on them
    return torch.cat(outs).reshape(q.shape)  # [b*s, h, d] -> [b, s, h, d]


def flash4_attention(q, k, v, *, scale: float, cu_seqlens=None, max_seqlen=None, stash=None,
                     layer=None, pad_spans=()) -> torch.Tensor:
    """flash-attn-4, one KV-head group at a time through its explicit-LSE forward and backward (attention/grouped.py:
    the same transients-per-group saving as sdpa, and the outputs can be kept for the recompute); packed documents
    through its varlen (cu_seqlens) kernels, one call per group over all documents."""
    b = q.shape[0]
    if _single_doc_per_row(cu_seqlens, b):
        return grouped_attention(q, k, v, scale, BACKENDS["fa4"], stash, layer)
    docs = Documents(cu_seqlens, max_seqlen, pad_spans)
    return grouped_attention(_flat(q), _flat(k), _flat(v), scale, BACKENDS["fa4"], stash, layer, docs).reshape(q.shape)


def flash2_attention(q, k, v, *, scale: float, cu_seqlens=None, max_seqlen=None, pad_spans=()) -> torch.Tensor:
    """flash-attn 2: packed rows (and rows with pads, whose segments are at most PAD_SEGMENT tokens) through its
    varlen kernel over every segment."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    b, s = q.shape[:2]
    if _single_doc_per_row(cu_seqlens, b):
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    qf, kf, vf = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))  # [b, s, h, d] -> [b*s, h, d]
    out = flash_attn_varlen_func(qf, kf, vf, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                 softmax_scale=scale, causal=True)
    return out.reshape(q.shape)


def _windowed_document(q, k, v, scale: float, window: int) -> torch.Tensor:
    """One document [n, h, d]: each query sees itself and the window - 1 keys before it (attention/windowed.py)."""
    if q.shape[0] <= window:  # the window reaches the document's start from every query: plain causal attention
        return _sdpa_dense(q[None], k[None], v[None], scale)[0]
    return window_blocks(q, k, v, scale, window)


def windowed_attention(q, k, v, *, scale: float, window: int, cu_seqlens=None, max_seqlen=None,
                       pad_spans=()) -> torch.Tensor:
    """Sliding-window causal attention (a layer whose config gives it `sliding_window`) over the full sequence of
    the given heads, packed documents kept apart: a window never reaches across a document start, a pad's output
    is 0. SDPA with block masks, whatever the planned kernel (exact on any device; the flash kernels' own windows
    are not wired yet)."""
    b, s = q.shape[:2]
    qf, kf, vf = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))  # [b, s, h, d] -> [b*s, h, d]
    if _single_doc_per_row(cu_seqlens, b):
        pieces = [(r * s, (r + 1) * s, False) for r in range(b)]
    else:
        pieces = Documents(cu_seqlens, max_seqlen, pad_spans).pieces()
    outs = [qf.new_zeros(e - a, *qf.shape[1:]) if pad else _windowed_document(qf[a:e], kf[a:e], vf[a:e], scale,
                                                                                window)
            for a, e, pad in pieces]
    return torch.cat(outs).reshape(q.shape)  # [b*s, h, d] -> [b, s, h, d]


def _sink_document(q, k, v, sinks, scale: float):
    """One document [n, h, d] (k, v [n, hk, d]) with an attention sink per query head as a key of its own: a zero
    query row and a sink key row go first, q gets sinks / scale in an extra column that only the sink key reads
    (k gets 0 there, the sink key 1 and 0 elsewhere), the sink's value is 0. So every query's softmax has
    exp(sink) in its denominator and nothing in its numerator (gpt-oss's sinks), through any causal kernel;
    the width is padded to a multiple of 8 with zeros (the flash kernels' head sizes). [n, h, d] -> [n+1, h, w]."""
    n, h, d = q.shape
    w = -(-(d + 1) // 8) * 8
    col = (sinks.to(q.dtype) / scale)[None, :, None].expand(n, h, 1)  # [n, h, 1]
    qa = F.pad(torch.cat([q, col], dim=-1), (0, w - d - 1, 0, 0, 1, 0))  # [n+1, h, w], row 0: the dummy query
    sink_key = F.pad(k.new_ones(1, k.shape[1], 1), (d, w - d - 1))  # [1, hk, w]: 1 in column d
    ka = torch.cat([sink_key, F.pad(k, (0, w - d))])  # [n+1, hk, w]
    va = F.pad(v, (0, w - d, 0, 0, 1, 0))  # [n+1, hk, w], row 0: the sink's zero value
    return qa, ka, va


def _sink_windowed(qa, ka, va, scale: float, window: int) -> torch.Tensor:
    """A windowed document with its sink (_sink_document's rows): real query i sees the sink and the real keys
    (i - window, i] (attention/windowed.py, the sink a key every block reaches)."""
    return window_blocks(qa[1:], ka[1:], va[1:], scale, window, sink_k=ka[:1], sink_v=va[:1])


def sink_attention(q, k, v, sinks, *, scale: float, attend: Callable[..., torch.Tensor], window: int | None = None,
                   cu_seqlens=None, max_seqlen=None, pad_spans=()) -> torch.Tensor:
    """Causal attention with a learned sink logit per query head in every softmax's denominator (gpt-oss's
    attention sinks, `sinks` [h] for the given heads), packed documents kept apart, a pad's output 0: each document
    through `attend` (a kernel of KERNEL_FUNCTIONS) with the sink as a key of its own (_sink_document), or with a
    sliding `window` through SDPA block masks that always reach the sink. Exact: the sink's gradient is the extra
    query column's."""
    b, s, _, d = q.shape
    qf, kf, vf = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))  # [b, s, h, d] -> [b*s, h, d]
    if _single_doc_per_row(cu_seqlens, b):
        pieces = [(r * s, (r + 1) * s, False) for r in range(b)]
    else:
        pieces = Documents(cu_seqlens, max_seqlen, pad_spans).pieces()
    outs = []
    for a, e, pad in pieces:
        if pad:
            outs.append(qf.new_zeros(e - a, *qf.shape[1:]))
            continue
        qa, ka, va = _sink_document(qf[a:e], kf[a:e], vf[a:e], sinks, scale)
        if window is not None:
            out = _sink_windowed(qa, ka, va, scale, window)  # [n, h, w]
        else:
            out = attend(qa[None], ka[None], va[None], scale=scale)[0, 1:]  # [n+1, h, w] -> [n, h, w]
        outs.append(out[..., :d])
    return torch.cat(outs).reshape(q.shape)  # [b*s, h, d] -> [b, s, h, d]


KERNEL_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa": sdpa_attention,
    "flash_attention_2": flash2_attention,
    "flash_attention_4": flash4_attention,
    STANDIN: standin_attention,
    STANDIN_FA4: standin_attention_fa4,
}
