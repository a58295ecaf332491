"""Causal attention run one KV-head group at a time, forward and backward, with an explicit log-sum-exp.

Why: a kernel called on all heads at once allocates its workspace for all heads (the fp32 dq accumulator
of a flash-style backward is 2x q; cuDNN and torch-flash need k, v expanded to every query head). One
group of hq/hkv query heads and its single KV head at a time keeps those transients to 1/hkv; the outputs
(out, dq, dk, dv) are written into full-size buffers. Same math, same speed (H200, 128K tokens, 32/8
heads: cuDNN 537 vs 539 TFLOP/s fwd+bwd, 6.3 vs 10.5 GiB peak; benchmarks/results/kernel_api_probe.json).

The backends are attention ops that return the log-sum-exp and take it back in backward: PyTorch's
`cudnn` and `flash` on CUDA, `cpu` (the CPU flash kernel: what the tests run), `standin`, the memory-only
stand-in of attention/standin.py (allocates what cuDNN would, computes nothing), and `fa4`, flash-attn-4's
forward and backward (flash_attn.cute; Hopper/Blackwell), which take [b, s, h, d] and a group's single KV
head as it is (no repeat), with tiles chosen for head_dim 128 on Hopper (FA4_SM90_FWD / FA4_SM90_BWD).

Packed rows (several documents in one flattened row, `Documents`): the same groups, and within a group either
one varlen call over all documents (flash-attn-4's cu_seqlens kernel: `Backend.fwd_varlen`) or one call per
document (the others); out and lse are written in place, so the kept outputs and the transients are those of a
dense row of the same length. A row's pads are segments of their own (parallel/sharding.py): the varlen call runs
them at one tile each, the per-document calls skip them, so no real document's attention spans them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..vocabulary.names import groups_one_at_a_time
from .stash import AttentionStash

OPS = torch.ops.aten


@dataclass(frozen=True)
class Backend:
    """fwd(q, k, v, scale) -> (out, lse [b, h, s] fp32, aux); bwd(dout, q, k, v, out, lse, aux, scale)
    -> (dq, dk, dv). layout "bhsd": all tensors [b, h, s, d] views (any strides with a unit last stride), k
    and v with q's head count (the group's KV head repeated). layout "bshd": [b, s, h, d], k and v (and dk,
    dv) with the group's one KV head."""

    name: str
    fwd: Callable
    bwd: Callable
    layout: str = "bhsd"
    # packed rows in one call: fwd_varlen(q, k, v, scale, docs), bwd_varlen(..., scale, docs), the tensors
    # [1, total, h, d] (bshd); None: one call per document
    fwd_varlen: Callable | None = None
    bwd_varlen: Callable | None = None


class Documents:
    """The documents of one flattened row [1, total, h, d]: cu_seqlens (int32 starts + end, on the kernel's
    device: every segment, the pads' included), the longest segment, the pads' (start, end) spans (host ints:
    parallel/sharding.ShardContext.pad_spans), and the documents' (start, end) spans, the pads' segments left out, read
    from the device only when asked for. A varlen kernel runs every segment of cu_seqlens (a pad segment is at
    most one tile); the per-document paths run `spans` and leave the pads' output, lse and grads 0."""

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int | None = None,
                 pad_spans: tuple[tuple[int, int], ...] = ()):
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.pad_spans = tuple(pad_spans)
        self._bounds: list[int] | None = None
        self.max_seqlen = int(max_seqlen) if max_seqlen is not None else max(e - a for a, e in self.segments)

    @property
    def segments(self) -> list[tuple[int, int]]:
        """Every segment of cu_seqlens, the pads' included."""
        if self._bounds is None:
            self._bounds = self.cu_seqlens.tolist()
        return list(zip(self._bounds[:-1], self._bounds[1:]))

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The documents' segments: those inside a pad span left out."""
        if not self.pad_spans:
            return self.segments
        return [(a, e) for a, e in self.segments if not any(p <= a < q for p, q in self.pad_spans)]

    def pieces(self) -> list[tuple[int, int, bool]]:
        """(start, end, is_pad) covering the row in order: each document, and each pad span as one piece."""
        out = [(a, e, False) for a, e in self.spans] + [(a, e, True) for a, e in self.pad_spans]
        return sorted(out)


def _cudnn_fwd(q, k, v, scale):
    o = OPS._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    return o[0], o[1].squeeze(-1), o[2:8]  # lse [b, h, s, 1] -> [b, h, s]


def _cudnn_bwd(g, q, k, v, out, lse, aux, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return OPS._scaled_dot_product_cudnn_attention_backward(
        g, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True,
        scale=scale)


def _flash_fwd(q, k, v, scale):
    o = OPS._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    return o[0], o[1], o[2:8]


def _flash_bwd(g, q, k, v, out, lse, aux, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return OPS._scaled_dot_product_flash_attention_backward(
        g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)


def _cpu_fwd(q, k, v, scale):
    out, lse = OPS._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _cpu_bwd(g, q, k, v, out, lse, aux, scale):
    return OPS._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, True, scale=scale)


def _standin_fwd(q, k, v, scale):
    b, h, s, _ = q.shape
    return q.clone(), torch.zeros(b, h, s, dtype=torch.float32, device=q.device), ()


def _standin_bwd(g, q, k, v, out, lse, aux, scale):
    # what cuDNN's backward allocates for one group (measured peak matches the real kernel's): an fp32
    # dq accumulator and the three grads
    accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq, dk, dv = g.clone(), torch.zeros_like(k), torch.zeros_like(v)
    del accum
    return dq, dk, dv


# flash-attn-4's Hopper tiles for head_dim 128, causal, chosen by measurement at the shape of the reference run's
# rank (1M tokens, 4 query heads over one KV head, random data; benchmarks/fa4_options.py,
# benchmarks/results/fa4_tiles_h200.json): forward 192 x 128 with P.V read from shared memory, backward 80-row
# query blocks with dQ swapped (the library's own non-causal choice), 6.151 s fwd+bwd against the library's
# causal defaults' 6.238. Other head sizes and devices keep the library's choice.
FA4_SM90_FWD = {"tile_mn": (192, 128), "mma_pv_is_rs": False}
FA4_SM90_BWD = {"m_block_size": 80, "dQ_swapAB": True}


def _tuned(q: torch.Tensor) -> bool:
    return q.is_cuda and q.shape[-1] == 128 and torch.cuda.get_device_capability(q.device)[0] == 9


@contextlib.contextmanager
def _sm90_bwd_tiles(fields: dict):
    """The library's Hopper backward takes its tiles from its table (`_tile_size_bwd_sm90`), not from its
    arguments: for the call inside this block only, the table answers with `fields` replaced for head_dim 128
    (FA4_LOCK is held around it, so no other thread calls the table meanwhile)."""
    import flash_attn.cute.interface as fa

    table = fa._tile_size_bwd_sm90

    def tuned(head_dim, head_dim_v, *args, **kwargs):
        cfg = table(head_dim, head_dim_v, *args, **kwargs)
        return dataclasses.replace(cfg, **fields) if head_dim == head_dim_v == 128 else cfg

    fa._tile_size_bwd_sm90 = tuned
    try:
        yield
    finally:
        fa._tile_size_bwd_sm90 = table


# flash-attn-4 compiles a kernel on its first call for a shape, and its CuTe DSL compiler keeps process-wide state
# that two threads compiling at once corrupt (H100: "'Assign' object has no attribute '_new_value'", then a
# segfault, with verify_sp's ranks as threads of one process); its calls go one at a time. A trainer rank is a
# process of its own, so nothing else ever waits on this lock there.
FA4_LOCK = threading.RLock()


def _fa4_fwd(q, k, v, scale, tuned: bool = True):
    from flash_attn.cute.interface import _flash_attn_fwd

    kw = FA4_SM90_FWD if tuned and _tuned(q) else {}
    with FA4_LOCK:
        out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True, **kw)[:2]
    return out, lse, ()  # out [b, s, r, d], lse [b, r, s] fp32


def _fa4_bwd(g, q, k, v, out, lse, aux, scale, tuned: bool = True):
    from flash_attn.cute.interface import _flash_attn_bwd

    tiles = _sm90_bwd_tiles(FA4_SM90_BWD) if tuned and _tuned(q) else contextlib.nullcontext()
    with FA4_LOCK, tiles:
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, g, lse.contiguous(), softmax_scale=scale, causal=True)[:3]
    return dq, dk, dv


# flash-attn-4's varlen kernels take the trainer's tiles too (the same head_dim-128 Hopper kernels with a
# cu_seqlens scheduler); False: the library's choice for packed rows
FA4_VARLEN_TUNED = True


def _fa4_varlen_fwd(q, k, v, scale, docs: Documents):
    from flash_attn.cute.interface import _flash_attn_fwd

    kw = FA4_SM90_FWD if FA4_VARLEN_TUNED and _tuned(q) else {}
    # [1, total, h, d] -> [total, h, d]: the varlen layout; lse comes back [h, total]
    with FA4_LOCK:
        out, lse = _flash_attn_fwd(q[0], k[0], v[0], cu_seqlens_q=docs.cu_seqlens, cu_seqlens_k=docs.cu_seqlens,
                                   max_seqlen_q=docs.max_seqlen, max_seqlen_k=docs.max_seqlen, softmax_scale=scale,
                                   causal=True, return_lse=True, **kw)[:2]
    return out[None], lse[None], ()  # out [1, total, r, d], lse [1, r, total]


def _fa4_varlen_bwd(g, q, k, v, out, lse, aux, scale, docs: Documents):
    from flash_attn.cute.interface import _flash_attn_bwd

    use = FA4_VARLEN_TUNED and _tuned(q)
    tiles = _sm90_bwd_tiles(FA4_SM90_BWD) if use else contextlib.nullcontext()
    with FA4_LOCK, tiles:
        dq, dk, dv = _flash_attn_bwd(q[0], k[0], v[0], out[0], g[0], lse[0].contiguous(), softmax_scale=scale,
                                     causal=True, cu_seqlens_q=docs.cu_seqlens, cu_seqlens_k=docs.cu_seqlens,
                                     max_seqlen_q=docs.max_seqlen, max_seqlen_k=docs.max_seqlen)[:3]
    return dq[None], dk[None], dv[None]


def _fa4_library_fwd(q, k, v, scale):
    return _fa4_fwd(q, k, v, scale, tuned=False)


def _fa4_library_bwd(g, q, k, v, out, lse, aux, scale):
    return _fa4_bwd(g, q, k, v, out, lse, aux, scale, tuned=False)


BACKENDS = {
    "fa4": Backend("fa4", _fa4_fwd, _fa4_bwd, layout="bshd", fwd_varlen=_fa4_varlen_fwd, bwd_varlen=_fa4_varlen_bwd),
    "fa4_library": Backend("fa4_library", _fa4_library_fwd, _fa4_library_bwd, layout="bshd"),  # for comparison
    "cudnn": Backend("cudnn", _cudnn_fwd, _cudnn_bwd),
    "flash": Backend("flash", _flash_fwd, _flash_bwd),
    "cpu": Backend("cpu", _cpu_fwd, _cpu_bwd),
    "standin": Backend("standin", _standin_fwd, _standin_bwd),
}


def default_backend(device: torch.device) -> Backend | None:
    """The backend for dense causal attention on this device, None where only F.sdpa applies."""
    if device.type == "cpu":
        return BACKENDS["cpu"]
    if device.type == "cuda":
        if torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device)[0] >= 9:
            return BACKENDS["cudnn"]  # H100/H200: cuDNN ~570 vs torch-flash ~325 TFLOP/s fwd+bwd
        return BACKENDS["flash"]
    return None


def runs_grouped(kv_heads: int, stash: AttentionStash | None) -> bool:
    """The planner's rule (vocabulary/names.groups_one_at_a_time), so the memory model follows the path taken;
    the stand-in follows it too, so it allocates like ours."""
    return groups_one_at_a_time(kv_heads, stash is not None)


def _group(t: torch.Tensor, j: int, width: int, layout: str) -> torch.Tensor:
    # [b, s, h, d] -> heads j*width .. (j+1)*width, a view: [b, s, width, d] (bshd) or [b, width, s, d] (bhsd)
    heads = t[:, :, j * width:(j + 1) * width]
    return heads if layout == "bshd" else heads.transpose(1, 2)


def _kv_group(t: torch.Tensor, j: int, r: int, layout: str) -> torch.Tensor:
    # [b, s, hkv, d] -> KV head j for its r query heads: as it is, [b, s, 1, d] (bshd: the kernel reads it
    # for all r), or repeated, [b, r, s, d] (bhsd: a copy of one head x r)
    head = t[:, :, j:j + 1]
    return head if layout == "bshd" else head.transpose(1, 2).repeat(1, r, 1, 1)


def _spans(s: int, docs: Documents | None, backend: Backend) -> list[tuple[int, int]]:
    """The sequence ranges one kernel call covers: the whole row (dense, or a varlen kernel), else each document."""
    return [(0, s)] if docs is None or backend.fwd_varlen is not None else docs.spans


def _skips_pads(docs: Documents | None, backend: Backend) -> bool:
    """Whether the calls leave the pads out (one call per document with pads in the row)."""
    return docs is not None and bool(docs.pad_spans) and backend.fwd_varlen is None


def _one_token_fwd(q, k, v, scale, lay):
    """A one-token document (cuDNN refuses s_q = s_kv = 1): the softmax over one key is 1, so out = v and
    lse = scale * q.k. q [1, 1, r, d] (bshd) or [1, r, 1, d] (bhsd), k/v the group's (bshd: [1, 1, 1, d])."""
    qq, kk, vv = (t if lay == "bshd" else t.transpose(1, 2) for t in (q, k, v))  # -> [1, 1, r or 1, d]
    out = vv.expand_as(qq).to(q.dtype)
    lse = (qq.float() * kk.float()).sum(-1).transpose(1, 2) * scale  # [1, 1, r] -> [1, r, 1]
    return (out if lay == "bshd" else out.transpose(1, 2)), lse, ()


def _one_token_bwd(g, q, k, v, lay):
    """Its grads: dv = dout (summed over the group's heads by the caller's bhsd plumbing), dq = dk = 0."""
    dv = g if lay != "bshd" else g.sum(2, keepdim=True)
    return torch.zeros_like(q), torch.zeros_like(k), dv.to(v.dtype)


class GroupedAttention(torch.autograd.Function):
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> out [b, s, hq, d]; keeps q, k, v, out and lse [b, hq, s].

    `docs`: packed documents of a flattened row (b = 1), each attended on its own. `kept`: (out, lse, aux) of an
    earlier forward on the same q, k, v (attention/stash.py): the kernel's forward is skipped and they are used as
    they are. `record`: a list the (out, lse, aux) are appended to. aux: one entry per kernel span (_spans).
    """

    @staticmethod
    def forward(ctx, q, k, v, scale: float, backend: Backend, kept: tuple | None, record: list | None,
                docs: Documents | None = None):
        if kept is not None:
            out, lse, aux = kept
        else:
            out, lse, aux = _forward(q, k, v, scale, backend, docs)
            if record is not None:
                record.append((out, lse, aux))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.backend, ctx.aux, ctx.docs = scale, backend, aux, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        hq, hkv = q.shape[2], k.shape[2]
        r = hq // hkv
        dout = dout.contiguous()  # [b, s, hq, d], the layout of out
        backend, docs = ctx.backend, ctx.docs
        lay = backend.layout
        varlen = docs is not None and backend.bwd_varlen is not None
        # pads the per-document calls leave out get no gradient (none flows to them: no real token reads them)
        new = torch.zeros_like if _skips_pads(docs, backend) else torch.empty_like
        dq, dk, dv = new(q), new(k), new(v)
        for j in range(hkv):
            for (a, e), aux in zip(_spans(q.shape[1], docs, backend), ctx.aux):
                args = (_group(dout[:, a:e], j, r, lay), _group(q[:, a:e], j, r, lay),
                        _kv_group(k[:, a:e], j, r, lay), _kv_group(v[:, a:e], j, r, lay),
                        _group(out[:, a:e], j, r, lay), lse[:, j * r:(j + 1) * r, a:e], aux, ctx.scale)
                if varlen:
                    gq, gk, gv = backend.bwd_varlen(*args, docs)
                elif docs is not None and e - a == 1:
                    gq, gk, gv = _one_token_bwd(args[0], args[1], args[2], args[3], lay)
                else:
                    gq, gk, gv = backend.bwd(*args)
                _group(dq[:, a:e], j, r, lay).copy_(gq)
                if lay == "bshd":  # the kernel's dk, dv are for the one KV head: [b, s, 1, d]
                    _kv_group(dk[:, a:e], j, r, lay).copy_(gk)
                    _kv_group(dv[:, a:e], j, r, lay).copy_(gv)
                else:  # the group's KV head was repeated r times: its grad is the sum over the copies
                    dk[:, a:e, j] = gk.sum(1, dtype=torch.float32)  # [b, r, s, d] -> [b, s, d], summed in fp32
                    dv[:, a:e, j] = gv.sum(1, dtype=torch.float32)
                del gq, gk, gv
        return dq, dk, dv, None, None, None, None, None


def _forward(q, k, v, scale, backend, docs=None):
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    r = hq // hkv
    skips = _skips_pads(docs, backend)  # the pads' output and lse stay 0
    out = q.new_zeros(b, s, hq, d) if skips else q.new_empty(b, s, hq, d)
    lse = (torch.zeros if skips else torch.empty)(b, hq, s, dtype=torch.float32, device=q.device)
    spans = _spans(s, docs, backend)
    varlen = docs is not None and backend.fwd_varlen is not None
    aux: list = [()] * len(spans)
    lay = backend.layout
    for j in range(hkv):  # one KV group at a time: the kernel's transients are for r heads, not hq
        for i, (a, e) in enumerate(spans):  # the whole row, or one packed document at a time
            args = (_group(q[:, a:e], j, r, lay), _kv_group(k[:, a:e], j, r, lay), _kv_group(v[:, a:e], j, r, lay),
                    scale)
            if varlen:
                og, lg, aux[i] = backend.fwd_varlen(*args, docs)
            elif docs is not None and e - a == 1:
                og, lg, aux[i] = _one_token_fwd(*args, lay)
            else:
                og, lg, aux[i] = backend.fwd(*args)
            _group(out[:, a:e], j, r, lay).copy_(og)  # the group's heads of [b, s, hq, d]
            lse[:, j * r:(j + 1) * r, a:e] = lg
            del og, lg
    return out, lse, aux


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: Backend,
                      stash: AttentionStash | None = None, layer: int | None = None,
                      docs: Documents | None = None) -> torch.Tensor:
    """Causal attention, one KV-head group at a time (see the module docstring); `docs`: the packed documents of
    a flattened row (q [1, total, hq, d]), none attending across a boundary. With a stash, the forward without
    grad (a checkpoint's first) keeps the kernel's outputs for `layer`, and the forward with grad (its
    recompute) reuses them instead of running the kernel."""
    assert q.shape[2] % k.shape[2] == 0, f"query heads {q.shape[2]} must be a multiple of KV heads {k.shape[2]}"
    assert docs is None or q.shape[0] == 1, "packed documents come as one flattened row [1, total, h, d]"
    if stash is None or layer is None:
        return GroupedAttention.apply(q, k, v, scale, backend, None, None, docs)
    if torch.is_grad_enabled():
        return GroupedAttention.apply(q, k, v, scale, backend, stash.take(layer), None, docs)
    record: list = []
    out = GroupedAttention.apply(q, k, v, scale, backend, None, record, docs)
    stash.put(layer, record[0])
    return out
