"""Gated DeltaNet kernels (Qwen3.5's linear-attention layers): the causal depthwise conv and the gated delta rule,
each over the whole sequence of the heads it is given, with packed documents kept apart.

Two kernels under one name each (vocabulary/names.DELTANET_KERNELS), each a rule and a conv: `fla`,
flash-linear-attention's chunk_gated_delta_rule and causal_conv1d (Triton, CUDA; their varlen paths take
cu_seqlens), and `torch`, the same chunked algorithm in fp32 torch ops and the conv as multiply-adds per tap (any
device; packed documents one at a time). Both take q, k with K key heads and v with V value
heads (value head j reads key head j // (V / K)), L2-normalise q and k, scale q by dk^-0.5, and start every
document from a zero state. The fla call stays in `_fla_rule` alone, so another kernel is one function here.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F
from torch import Tensor

from ...attention import length_tuned

CHUNK = 64  # the torch kernel's chunk length (fla's too)


@functools.cache
def _fla(module: str, name: str):
    """fla's `name` from `module`, None where flash-linear-attention (or Triton) is not installed."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # ImportError, or a Triton that fails to load without a GPU
        return None


def _fla_function():
    """fla's chunk_gated_delta_rule (None without fla)."""
    return _fla("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")


@functools.cache
def _fla_groups_values() -> bool:
    """fla-core >= 0.6 takes fewer key than value heads itself (measured exact on the H200,
    benchmarks/deltanet_kernels.py); older releases get the key heads repeated."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("fla-core", "flash-linear-attention"):
        try:
            major, minor = (int(p) for p in version(dist).split(".")[:2])
            return (major, minor) >= (0, 6)
        except (PackageNotFoundError, ValueError):
            continue
    return False


def _triton_runs_fla() -> bool:
    """Triton older than 3.7.1 computes fla's gated chunk backward wrongly on Hopper (and fla-core refuses it;
    measured on the H200 with torch 2.11's Triton 3.6, benchmarks/deltanet_kernels.py)."""
    try:
        import triton

        version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3])
    except Exception:  # no Triton, or a version string of another form
        return False
    return version >= (3, 7, 1) or torch.cuda.get_device_capability()[0] != 9


def available_deltanet_kernels() -> list[str]:
    """Installed gated-delta-rule kernels, fastest first: fla needs CUDA, flash-linear-attention and a Triton that
    runs it."""
    fla = torch.cuda.is_available() and _fla_function() is not None and _triton_runs_fla()
    return ["fla", "torch"] if fla else ["torch"]


# --------------------------------------------------------------------------------------------------------------
# the causal depthwise conv


def document_starts(cu_seqlens: Tensor, total: int) -> Tensor:
    """[total] int64: each position's offset from its document's first token (cu_seqlens: int starts + end)."""
    cu = cu_seqlens.to(torch.long)
    idx = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu[1:], idx, right=True)  # the document each position belongs to
    return idx - cu[doc]


_SLAB_ELEMENTS = 2**26  # fp32 elements of one slab of channels (256 MiB): the conv's only transient


def _taps(x: Tensor, weight: Tensor, offset: Tensor) -> Tensor:
    """sum_j weight[:, k-1-j] * x[t-j] where offset[t] >= j (taps inside the token's document), fp32 accumulation
    one slab of channels at a time; x [b, C, T], weight [C, k], offset [T] -> [b, C, T] in x's dtype."""
    b, c, t = x.shape
    k = weight.shape[-1]
    out = torch.empty_like(x)
    step = max(1, _SLAB_ELEMENTS // max(1, b * t))
    masks = [(offset[j:] >= j).to(torch.float32) for j in range(1, k)]  # [T - j] each
    for a in range(0, c, step):
        xs, ws = x[:, a:a + step].float(), weight[a:a + step].float()  # [b, n, T], [n, k]
        acc = xs * ws[:, k - 1, None]
        for j in range(1, k):  # tap j reads token t - j
            acc[..., j:] += xs[..., :-j] * ws[:, k - 1 - j, None] * masks[j - 1]
        out[:, a:a + step] = acc.to(x.dtype)
    return out


class _CausalConv(torch.autograd.Function):
    """The depthwise causal conv, keeping only its input (and the weight) for backward: torch's conv1d saves the
    same but its depthwise weight gradient is slow on long sequences; these are a few multiply-adds per tap."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, offset: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight, offset)
        return _taps(x, weight, offset)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, offset = ctx.saved_tensors
        b, c, t = x.shape
        k = weight.shape[-1]
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(c, k, dtype=torch.float32, device=x.device)
        step = max(1, _SLAB_ELEMENTS // max(1, b * t))
        masks = [(offset[j:] >= j).to(torch.float32) for j in range(1, k)]
        for a in range(0, c, step):
            xs, ws, gs = x[:, a:a + step].float(), weight[a:a + step].float(), grad[:, a:a + step].float()
            gx = gs * ws[:, k - 1, None]  # [b, n, T]
            grad_w[a:a + step, k - 1] = (gs * xs).sum(dim=(0, 2))
            for j in range(1, k):  # out[t] += w[k-1-j] x[t-j] (in the document): x[t-j] gets w[k-1-j] g[t]
                gm = gs[..., j:] * masks[j - 1]  # [b, n, T - j]
                gx[..., :-j] += gm * ws[:, k - 1 - j, None]
                grad_w[a:a + step, k - 1 - j] = (gm * xs[..., :-j]).sum(dim=(0, 2))
            if grad_x is not None:
                grad_x[:, a:a + step] = gx.to(x.dtype)
        return grad_x, grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None, None


def _fla_conv_function():
    """fla's causal_conv1d (None without fla)."""
    return _fla("fla.modules.causal_conv1d", "causal_conv1d")


def torch_conv_tokens(x: Tensor, weight: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """causal_conv + SiLU on the tokens-first layout the mixer holds: x [b, s, C] -> [b, s, C]."""
    return causal_conv(x.transpose(1, 2), weight, cu_seqlens).transpose(1, 2)  # [b, C, s] view and back


def fla_conv_tokens(x: Tensor, weight: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """The same through fla's Triton causal_conv1d: bf16 in and out with fp32 sums, one read of x per tap window
    instead of the torch path's fp32 slabs (fla's varlen path takes the batch flattened to one row)."""
    fn = _fla_conv_function()
    if fn is None:
        raise RuntimeError("deltanet kernel fla needs flash-linear-attention on CUDA (pip install "
                           "flash-linear-attention); use deltanet_kernel: torch")
    b, s, c = x.shape
    x = x.contiguous()  # the mixer's view of its packed channels: [b, s, C] with a wider token stride
    if cu_seqlens is not None:
        x = x.reshape(1, b * s, c)  # [b, s, C] -> [1, b*s, C]: documents are contiguous in the flattened batch
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.long)
    y, _ = fn(x, weight, activation="silu", cu_seqlens=cu_seqlens)  # [B, T, C]
    return y.reshape(b, s, c)


def causal_conv(x: Tensor, weight: Tensor, cu_seqlens: Tensor | None, activation: bool = True) -> Tensor:
    """Depthwise causal conv of x [b, C, s] with weight [C, k] (+ SiLU), per channel. With cu_seqlens (over the
    flattened b*s tokens), no window reaches back past its document's first token (the taps that would are
    zero, as for a document run alone)."""
    b, c, s = x.shape
    if cu_seqlens is None:
        offset = torch.arange(s, device=x.device)  # every row one document
        out = _CausalConv.apply(x, weight, offset)  # [b, C, s]
    else:
        flat = x.transpose(0, 1).reshape(1, c, b * s)  # [b, C, s] -> [1, C, b*s]: documents are contiguous
        out = _CausalConv.apply(flat, weight, document_starts(cu_seqlens, b * s))
        out = out.reshape(c, b, s).transpose(0, 1)  # [1, C, b*s] -> [b, C, s]
    return F.silu(out) if activation else out


# --------------------------------------------------------------------------------------------------------------
# the gated delta rule


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _torch_rule_one(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One sequence per row, zero initial state: q, k [b, t, h, dk], v [b, t, h, dv], g, beta [b, t, h] ->
    o [b, t, h, dv] in fp32. Chunks of CHUNK tokens: inside a chunk the delta-rule updates are solved as one
    unit-triangular system (the WY form); the state [dk, dv] per head carries across chunks."""
    t = q.shape[1]
    # [b, t, h, d] -> [b, h, t, d] fp32
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32).contiguous() for x in (q, k, v, beta, g))
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (CHUNK - t % CHUNK) % CHUNK
    if pad:  # padded positions have k = v = 0, g = 0: they change no state and are cut from the output
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    b, h, tp, dk = k.shape
    dv = v.shape[-1]
    n = tp // CHUNK
    kb, vb = k * beta[..., None], v * beta[..., None]
    # [b, h, tp, d] -> [b, h, n, C, d]
    q, k, kb, vb = (x.reshape(b, h, n, CHUNK, x.shape[-1]) for x in (q, k, kb, vb))
    g = g.reshape(b, h, n, CHUNK).cumsum(-1)  # log decay from the chunk start, inclusive
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [b, h, n, C, C]
    system = (kb @ k.transpose(-1, -2)) * decay  # its strictly lower part and a unit diagonal: the WY system
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)  # [b, h, n, C, dv]
    w = torch.linalg.solve_triangular(system, kb * g.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay  # [b, h, n, C, C] causal within the chunk
    q_dec = q * g.exp()[..., None]
    k_dec = k * (g[..., -1:] - g).exp()[..., None]
    step = g[..., -1].exp()[..., None, None]  # [b, h, n, 1, 1] decay over a whole chunk
    state = q.new_zeros(b, h, dk, dv)
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state  # [b, h, C, dv]
        outs.append(q_dec[:, :, i] @ state + inner[:, :, i] @ v_new)
        state = state * step[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(b, h, tp, dv)[:, :, :t]  # [b, h, n, C, dv] -> [b, h, t, dv]
    return o.transpose(1, 2)  # [b, t, h, dv]


def _grouped(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """q, k [b, t, K, dk] -> [b, t, V, dk]: each key head copied to the V / K value heads that read it."""
    m = v.shape[2] // q.shape[2]
    return (q, k) if m == 1 else (q.repeat_interleave(m, dim=2), k.repeat_interleave(m, dim=2))


def torch_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """The torch kernel; with cu_seqlens (over the flattened b*t tokens) each document runs alone."""
    q, k = _grouped(q, k, v)
    if cu_seqlens is None:
        return _torch_rule_one(q, k, v, g, beta).to(v.dtype)
    b, t = q.shape[:2]
    # [b, t, h, d] -> [1, b*t, h, d]: documents are contiguous in the flattened batch
    q, k, v, g, beta = (x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v, g, beta))
    bounds = cu_seqlens.tolist()
    outs = [_torch_rule_one(*(x[:, s:e] for x in (q, k, v, g, beta))) for s, e in zip(bounds[:-1], bounds[1:])
            if e > s]
    return torch.cat(outs, dim=1).reshape(b, t, *v.shape[2:]).to(v.dtype)  # [1, b*t, h, dv] -> [b, t, h, dv]


def _fla_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """flash-linear-attention's chunked kernel; its varlen path takes the batch flattened to one row."""
    fn = _fla_function()
    if fn is None:
        raise RuntimeError("deltanet kernel fla needs flash-linear-attention on CUDA (pip install "
                           "flash-linear-attention); use deltanet_kernel: torch")
    if not _fla_groups_values():
        q, k = _grouped(q, k, v)
    b, t = q.shape[:2]
    # fla tunes its q/k L2 norm per bucket of b*t*heads rows: a shorter warm-up can tune the run's length ahead
    length_tuned.register(("fla q/k l2norm", *q.shape[2:], q.dtype, q.device), _l2norm_tuner(*q.shape[2:], q.dtype,
                                                                                            q.device))
    if cu_seqlens is not None:
        # [b, t, h, d] -> [1, b*t, h, d]
        q, k, v, g, beta = (x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v, g, beta))
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.long)
    o, _ = fn(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, cu_seqlens=cu_seqlens,
              use_qk_l2norm_in_kernel=True)
    return o.reshape(b, t, *v.shape[2:])  # [1, b*t, h, dv] -> [b, t, h, dv]


def _l2norm_tuner(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    """tune(tokens): fla's q/k L2 norm forward and backward once over [tokens, heads, head_dim] (what
    chunk_gated_delta_rule's use_qk_l2norm_in_kernel runs on q and k), which autotunes it for that row count."""
    def tune(tokens: int) -> None:
        fwd, bwd = _fla("fla.modules.norm.l2norm", "l2norm_fwd"), _fla("fla.modules.norm.l2norm", "l2norm_bwd")
        if fwd is None or bwd is None:
            return
        x = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
        y, rstd = fwd(x)
        bwd(y, rstd, torch.randn_like(y))
    return tune


DELTANET_FUNCTIONS = {"fla": _fla_rule, "torch": torch_rule}
# each rule's conv (+ SiLU) on x [b, s, C]: one deltanet_kernel names both, so fla's rule runs with fla's conv
CONV_FUNCTIONS = {"fla": fla_conv_tokens, "torch": torch_conv_tokens}
