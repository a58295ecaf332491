"""Packed rows on a CUDA device: flash-attn-4's varlen kernels one KV-head group at a time, and cuDNN one document
at a time per group, against stock SDPA run one document at a time on all heads (bf16: rounding-level agreement),
with the kept outputs replayed in the recompute. Runs where CUDA is (flash-attn-4: where it is installed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ulysses_trainer.attention import kernels
from ulysses_trainer.attention.stash import AttentionStash

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DOCS = [1, 700, 129, 1, 2048, 63, 1155]  # one-token documents, odd lengths, none a multiple of a tile


def _reference(q, k, v, docs, scale):
    """Stock F.sdpa, all heads with GQA, one document at a time."""
    outs, a = [], 0
    for n in docs:
        qq, kk, vv = (t[:, a:a + n].transpose(1, 2) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True))
        a += n
    return torch.cat(outs, dim=2).transpose(1, 2)


def _run(fn, q, k, v, dout, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    out.backward(dout)
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kernel", ["sdpa", "flash_attention_4"])
def test_packed_grouped_matches_sdpa_per_document_bf16(kernel):
    if kernel not in kernels.available_kernels():
        pytest.skip(f"{kernel} is not installed here")
    g = torch.Generator(device="cuda").manual_seed(0)
    s, hq, hkv, d = sum(DOCS), 8, 2, 128
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    fn = kernels.KERNEL_FUNCTIONS[kernel]
    ref = _run(lambda q, k, v: _reference(q, k, v, DOCS, scale), q, k, v, dout)
    plain = _run(fn, q, k, v, dout, scale=scale, cu_seqlens=cu, max_seqlen=max(DOCS))
    for a, r in zip(plain, ref):
        assert _rel(a, r) <= 1e-2
    # kept outputs: the recompute replays the first forward's out and lse, the grads are the same numbers
    stash = AttentionStash([0])
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        fn(*leaves, scale=scale, cu_seqlens=cu, max_seqlen=max(DOCS), stash=stash, layer=0)
    out = fn(*leaves, scale=scale, cu_seqlens=cu, max_seqlen=max(DOCS), stash=stash, layer=0)
    out.backward(dout)
    assert stash.replays == 1
    for a, b in zip([out.detach().float()] + [t.grad.float() for t in leaves], plain):
        assert _rel(a, b) <= 1e-3  # deterministic kernels: bitwise in practice; FA4's dq accumulates atomically


@pytest.mark.parametrize("kernel", ["sdpa", "flash_attention_4", "flash_attention_2"])
def test_rows_with_pads_leave_them_out_on_every_kernel(kernel):
    """A packed row whose last 1,500 tokens are pads (parallel/sharding.py: segments of their own): the real tokens'
    outputs and every gradient equal stock SDPA per document (the pads get no gradient: none flows to them), and the
    pads' output is finite (0 on the per-document paths, their own short segments on a varlen kernel)."""
    if kernel not in kernels.available_kernels():
        pytest.skip(f"{kernel} is not installed here")
    from ulysses_trainer.parallel.sharding import document_layout

    g = torch.Generator(device="cuda").manual_seed(1)
    real, hq, hkv, d = sum(DOCS), 8, 2, 128
    s = real + 1500
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    dout[:, real:] = 0  # what flows back to pads in training
    pos = torch.cat([torch.arange(n) for n in DOCS] + [torch.arange(DOCS[-1], DOCS[-1] + 1500)])[None]
    cu, longest, _, pads = document_layout(pos, [real])
    scale = d ** -0.5
    ref = _run(lambda q, k, v: _reference(q[:, :real], k[:, :real], v[:, :real], DOCS, scale), q, k, v, dout[:, :real])
    got = _run(kernels.KERNEL_FUNCTIONS[kernel], q, k, v, dout, scale=scale, cu_seqlens=cu.cuda(),
               max_seqlen=longest, pad_spans=pads)
    assert torch.isfinite(got[0]).all()
    for a, r in zip(got, ref):
        assert _rel(a[:, :real], r[:, :real]) <= 1e-2
    assert all(float(t[:, real:].abs().max()) == 0 for t in got[1:])  # no gradient to a pad
