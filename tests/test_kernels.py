"""Attention kernels: packed documents never attend across boundaries, and the flash-attn glue passes
the right shapes (checked on CPU against stand-in modules with the libraries' call signatures)."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from ulysses_trainer.attention import kernels
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.vocabulary.names import choose_kernel


def _qkv(b=2, s=12, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))


def _reference(q, k, v, cu, scale):
    """Per-document causal attention with KV heads repeated, written independently of the kernels."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    qf, kf, vf = (t.reshape(b * s, t.shape[2], d) for t in (q, k, v))
    out = torch.empty_like(qf)
    bounds = cu.tolist()
    for a, e in zip(bounds[:-1], bounds[1:]):
        qq = qf[a:e].transpose(0, 1)  # [h, n, d]
        kk = kf[a:e].repeat_interleave(rep, dim=1).transpose(0, 1)
        vv = vf[a:e].repeat_interleave(rep, dim=1).transpose(0, 1)
        scores = qq @ kk.transpose(1, 2) * scale
        mask = torch.ones(e - a, e - a, dtype=torch.bool).tril()
        out[a:e] = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vv).transpose(0, 1)
    return out.reshape(q.shape)


def test_sdpa_packed_documents_stay_apart():
    q, k, v = _qkv()
    cu = torch.tensor([0, 5, 12, 15, 24], dtype=torch.int32)  # row 0: docs of 5 and 7; row 1: 3 and 9
    out = kernels.sdpa_attention(q, k, v, scale=0.3, cu_seqlens=cu, max_seqlen=9)
    assert torch.allclose(out, _reference(q, k, v, cu, 0.3), atol=1e-12)
    dense = kernels.sdpa_attention(q, k, v, scale=0.3)  # one document per row
    assert not torch.allclose(out, dense)  # the boundaries matter, so the test could fail
    assert torch.allclose(dense, _reference(q, k, v, torch.tensor([0, 12, 24], dtype=torch.int32), 0.3),
                          atol=1e-12)


def _fake_flash_modules(monkeypatch, calls):
    """Install modules with flash-attn 4's and 2's call signatures, computing with the reference."""

    def dense(q, k, v, softmax_scale=None, causal=False, **kw):
        calls.append(("dense", q.shape, k.shape, causal))
        b, s = q.shape[:2]
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32)
        return _reference(q, k, v, cu, softmax_scale)

    def varlen4(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                softmax_scale=None, causal=False, **kw):
        calls.append(("varlen", q.shape, cu_seqlens_q.dtype, max_seqlen_q, causal))
        assert q.dim() == 3 and torch.equal(cu_seqlens_q, cu_seqlens_k)
        out = _reference(q[None], k[None], v[None], cu_seqlens_q, softmax_scale)[0]
        return out, torch.zeros(q.shape[1], q.shape[0])  # FA4 returns (out, lse)

    def varlen2(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, **kw):
        return varlen4(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)[0]

    def lse_of(q, k, scale):  # [b, s, r, d], [b, s, 1, d] -> [b, r, s]
        scores = torch.einsum("bshd,btd->bhst", q, k[:, :, 0]) * scale
        mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
        return scores.masked_fill(~mask, float("-inf")).logsumexp(-1)

    def varlen_lse(q, k, cu, scale):  # [total, r, d], [total, 1, d] -> [r, total], per document
        b = cu.tolist()
        return torch.cat([lse_of(q[None, a:e], k[None, a:e], scale)[0] for a, e in zip(b[:-1], b[1:])], dim=1)

    def fa4_fwd(q, k, v, softmax_scale=None, causal=False, return_lse=False, cu_seqlens_q=None,
                cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **kw):
        assert return_lse  # the LSE is kept for backward
        if cu_seqlens_q is not None:  # varlen: [total, r, d], the group's one KV head
            calls.append(("varlen", q.shape, k.shape, cu_seqlens_q.dtype, max_seqlen_q, causal))
            assert q.dim() == 3 and k.shape[1] == 1 and torch.equal(cu_seqlens_q, cu_seqlens_k)
            out = _reference(q[None], k[None], v[None], cu_seqlens_q, softmax_scale)[0]
            return out, varlen_lse(q, k, cu_seqlens_q, softmax_scale), None, None, None
        calls.append(("dense", q.shape, k.shape, causal))
        assert k.shape[2] == 1  # one group, its own KV head
        b, s = q.shape[:2]
        out = _reference(q, k, v, torch.arange(0, b * s + 1, s, dtype=torch.int32), softmax_scale)
        return out, lse_of(q, k, softmax_scale), None, None, None

    def fa4_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, cu_seqlens_q=None, **kw):
        assert lse.dtype == torch.float32
        if cu_seqlens_q is not None:
            calls.append(("varlen_bwd", q.shape, k.shape, causal))
            assert torch.allclose(lse.double(), varlen_lse(q.double(), k.double(), cu_seqlens_q, softmax_scale),
                                  atol=1e-5)
            leaves = [t.detach().double()[None].requires_grad_() for t in (q, k, v)]
            cu = cu_seqlens_q
        else:
            calls.append(("dense_bwd", q.shape, k.shape, causal))
            assert torch.allclose(lse.double(), lse_of(q.double(), k.double(), softmax_scale), atol=1e-5)
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            b, s = q.shape[:2]
            cu = torch.arange(0, b * s + 1, s, dtype=torch.int32)
        with torch.enable_grad():  # called from inside an autograd backward
            ref = _reference(*leaves, cu, softmax_scale)
            grads = torch.autograd.grad(ref, leaves, dout.double().reshape(ref.shape))
            return [g.reshape(t.shape).to(q.dtype) for g, t in zip(grads, (q, k, v))]

    cute = types.ModuleType("flash_attn.cute.interface")
    cute._flash_attn_fwd, cute._flash_attn_bwd = fa4_fwd, fa4_bwd
    cute.flash_attn_func = lambda *a, **kw: (dense(*a, **kw), None)
    cute.flash_attn_varlen_func = varlen4
    fa2 = types.ModuleType("flash_attn")
    fa2.flash_attn_func = dense
    fa2.flash_attn_varlen_func = varlen2
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", cute)


@pytest.mark.parametrize("name", ["flash_attention_4", "flash_attention_2"])
def test_flash_glue_shapes_and_varlen(monkeypatch, name):
    calls = []
    _fake_flash_modules(monkeypatch, calls)
    fn = kernels.KERNEL_FUNCTIONS[name]
    q, k, v = _qkv(seed=1)
    cu = torch.tensor([0, 4, 12, 20, 24], dtype=torch.int32)
    packed = fn(q, k, v, scale=0.25, cu_seqlens=cu, max_seqlen=8)
    assert packed.shape == q.shape
    assert torch.allclose(packed, kernels.sdpa_attention(q, k, v, scale=0.25, cu_seqlens=cu, max_seqlen=8),
                          atol=1e-12)
    dense = fn(q, k, v, scale=0.25, cu_seqlens=torch.tensor([0, 12, 24], dtype=torch.int32), max_seqlen=12)
    assert torch.allclose(dense, kernels.sdpa_attention(q, k, v, scale=0.25), atol=1e-12)
    if name == "flash_attention_2":
        assert calls[0] == ("varlen", (24, 4, 8), torch.int32, 8, True)  # [b*s, h, d], int32 offsets, causal
        assert calls[1][0] == "dense" and calls[1][1] == q.shape and calls[1][3] is True
    else:  # FA4 runs one KV group at a time: packed, one varlen call per group ([b*s, 2 query heads, d], its one
        # KV head, int32 offsets, causal); dense rows 2 query heads with their one KV head
        assert calls[:2] == [("varlen", (24, 2, 8), (24, 1, 8), torch.int32, 8, True)] * 2
        assert calls[2:] == [("dense", (2, 12, 2, 8), (2, 12, 1, 8), True)] * 2


def test_flash4_dense_grads_and_kept_outputs(monkeypatch):
    from ulysses_trainer.attention.stash import AttentionStash

    calls = []
    _fake_flash_modules(monkeypatch, calls)
    q, k, v = (t.float().requires_grad_() for t in _qkv(seed=3))  # fp32: the LSE is kept in fp32
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    stash = AttentionStash([3])
    with torch.no_grad():
        kernels.flash4_attention(q, k, v, scale=0.25, stash=stash, layer=3)
    out = kernels.flash4_attention(q, k, v, scale=0.25, stash=stash, layer=3)  # the recompute: kept output
    out.backward(dout)
    got = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = kernels.sdpa_attention(q, k, v, scale=0.25)
    ref.backward(dout)
    for a, r in zip(got, [ref.detach()] + [t.grad for t in (q, k, v)]):
        assert torch.allclose(a, r, atol=1e-5)
    assert [c[0] for c in calls] == ["dense"] * 2 + ["dense_bwd"] * 2  # no second forward: replayed


def test_auto_takes_the_fastest_installed_kernel():
    # the published order (H200 fwd+bwd: FA4 ~660, SDPA-cuDNN ~570 TFLOP/s): flash-attn-4 wherever it is installed
    assert choose_kernel("auto", ("flash_attention_4", "flash_attention_2", "sdpa")) == "flash_attention_4"
    assert choose_kernel("auto", ("flash_attention_2", "sdpa")) == "flash_attention_2"
    assert choose_kernel("auto", ()) == "sdpa"  # nothing reported: the kernel every torch has
    assert choose_kernel("auto", tuple(kernels.available_kernels())) in kernels.KERNEL_FUNCTIONS  # runnable here
    assert choose_kernel("sdpa", ("flash_attention_4", "sdpa")) == "sdpa"  # a named one is kept
    with pytest.raises(ConfigError, match="unknown"):
        choose_kernel("flash_attention_3", ("sdpa",))
    with pytest.raises(ConfigError, match=r"not installed here \(pip install 'ulysses_trainer\[fa4\]'"):
        choose_kernel("flash_attention_4", ("sdpa",))


def test_sdpa_is_installed_everywhere():
    assert "sdpa" in kernels.available_kernels()
    if not torch.cuda.is_available():
        assert kernels.available_kernels() == ["sdpa"]  # the flash kernels need CUDA


def test_sdpa_matches_torch_math_with_gqa():
    q, k, v = _qkv(b=1, s=9, hq=6, hkv=3, seed=2)
    out = kernels.sdpa_attention(q, k, v, scale=0.5)
    kk, vv = (t.repeat_interleave(2, dim=2) for t in (k, v))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                         is_causal=True, scale=0.5).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-12)


@pytest.mark.parametrize("kernel", ["flash_attention_4", "flash_attention_2", "sdpa"])
def test_every_kernel_registers_under_a_name_transformers_accepts(kernel):
    # transformers reads an implementation name containing "flash_attention" as a hub kernel to fetch; the
    # FA4 run on the H200 failed that way (ValueError before the first step)
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.model.load import build_model
    from ulysses_trainer.parallel import ulysses
    from ulysses_trainer.parallel.state import single_process_state

    attention = ulysses.UlyssesAttention(single_process_state(), kernel, 4, 2)
    assert "flash" not in attention.name
    model = build_model(preset_config("tiny"), torch.float32)
    model.set_attn_implementation(attention.register(model))
    assert model.config._attn_implementation == attention.name


def test_flash4_packed_grads_and_kept_outputs(monkeypatch):
    """Packed rows on flash-attn-4: one varlen call per KV-head group, the kept output and LSE replayed in the
    recompute (no second forward), grads those of SDPA one document at a time."""
    from ulysses_trainer.attention.stash import AttentionStash

    calls = []
    _fake_flash_modules(monkeypatch, calls)
    q, k, v = (t.float().requires_grad_() for t in _qkv(seed=5))
    cu = torch.tensor([0, 1, 12, 13, 24], dtype=torch.int32)  # one-token documents, row 0: 1 + 11, row 1: 1 + 11
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    stash = AttentionStash([0])
    with torch.no_grad():
        kernels.flash4_attention(q, k, v, scale=0.25, cu_seqlens=cu, max_seqlen=11, stash=stash, layer=0)
    out = kernels.flash4_attention(q, k, v, scale=0.25, cu_seqlens=cu, max_seqlen=11, stash=stash, layer=0)
    out.backward(dout)
    got = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = kernels.sdpa_attention(q, k, v, scale=0.25, cu_seqlens=cu, max_seqlen=11)
    ref.backward(dout)
    for a, r in zip(got, [ref.detach()] + [t.grad for t in (q, k, v)]):
        assert torch.allclose(a, r, atol=1e-5)
    assert stash.replays == 1
    assert [c[0] for c in calls] == ["varlen"] * 2 + ["varlen_bwd"] * 2  # per group; no second forward
