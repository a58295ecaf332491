"""Packed rows (several documents in one row, cu_seqlens) through the grouped attention path: one KV-head group at a
time, each document on its own (or one varlen call per group), the kept outputs and log-sum-exp reused in the
recompute as for dense rows. Same results as stock SDPA with a block-diagonal causal mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import JOB_TIMEOUT_S, run_ranks
from ulysses_trainer.attention import grouped
from ulysses_trainer.attention.grouped import Backend, Documents, grouped_attention
from ulysses_trainer.attention.kernels import sdpa_attention
from ulysses_trainer.attention.stash import AttentionStash


def _cu(b: int, s: int, row_docs: list[list[int]]) -> torch.Tensor:
    """cu_seqlens over the flattened [b*s] batch from each row's document lengths."""
    starts, base = [], 0
    for docs in row_docs:
        assert sum(docs) == s
        for n in docs:
            starts.append(base)
            base += n
    return torch.tensor(starts + [b * s], dtype=torch.int32)


def _block_causal_ref(q, k, v, cu, scale):
    """Stock SDPA on the flattened batch with a boolean mask: causal and within one document."""
    b, s, hq, d = q.shape
    n = b * s
    doc = torch.zeros(n, dtype=torch.long)
    for i, a in enumerate(cu[1:-1].tolist()):
        doc[a:] = i + 1
    pos = torch.arange(n)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    qf, kf, vf = (t.reshape(1, n, t.shape[2], d).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(b, s, hq, d)


def _qkv(b, s, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).requires_grad_() for h in (hq, hkv, hkv)]


def _grads(out, dout, leaves):
    out.backward(dout)
    got = [out.detach().clone()] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return got


def _rel(a, r) -> float:
    return float((a - r).norm() / r.norm())


class _Counting:
    """Wraps a backend; records (kind, query heads, sequence length) of every kernel call."""

    def __init__(self, inner: Backend):
        self.inner, self.calls = inner, []
        self.backend = Backend("counting", self._fwd, self._bwd)

    def _fwd(self, q, k, v, scale):
        self.calls.append(("fwd", q.shape[1], q.shape[2]))
        return self.inner.fwd(q, k, v, scale)

    def _bwd(self, g, q, k, v, out, lse, aux, scale):
        self.calls.append(("bwd", q.shape[1], q.shape[2]))
        return self.inner.bwd(g, q, k, v, out, lse, aux, scale)


CASES = [  # (b, s, hq, hkv, d, documents per row): odd sizes, GQA, one-token documents, several rows
    (1, 37, 6, 2, 16, [[9, 16, 12]]),
    (1, 23, 4, 1, 8, [[1, 21, 1]]),
    (2, 19, 8, 4, 16, [[7, 12], [19]]),
    (1, 31, 6, 3, 8, [[1] * 5 + [26]]),
]


@pytest.mark.parametrize("b, s, hq, hkv, d, docs", CASES)
def test_packed_sdpa_matches_block_diagonal_reference(b, s, hq, hkv, d, docs):
    q, k, v = _qkv(b, s, hq, hkv, d, seed=1)
    cu = _cu(b, s, docs)
    dout = torch.randn(b, s, hq, d, generator=torch.Generator().manual_seed(2))
    mine = _grads(sdpa_attention(q, k, v, scale=0.3, cu_seqlens=cu, max_seqlen=max(map(max, docs))), dout, (q, k, v))
    ref = _grads(_block_causal_ref(q, k, v, cu, 0.3), dout, (q, k, v))
    for a, r in zip(mine, ref):
        assert _rel(a, r) <= 1e-5


@pytest.mark.parametrize("b, s, hq, hkv, d, docs", CASES)
def test_packed_groups_see_one_kv_head_and_one_document_per_call(b, s, hq, hkv, d, docs):
    q, k, v = _qkv(b, s, hq, hkv, d, seed=3)
    cu = _cu(b, s, docs)
    counting = _Counting(grouped.BACKENDS["cpu"])
    flat = [t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v)]
    out = grouped_attention(*flat, 0.3, counting.backend, docs=Documents(cu)).reshape(b, s, hq, d)
    out.sum().backward()
    r, lengths = hq // hkv, [n for row in docs for n in row]
    # every call: the group's r heads over one document; a one-token document needs no kernel (out = v)
    per_group = [(r, n) for n in lengths if n > 1]
    assert [c[1:] for c in counting.calls if c[0] == "fwd"] == per_group * hkv
    assert [c[1:] for c in counting.calls if c[0] == "bwd"] == per_group * hkv


def _varlen_cpu_backend(calls: list) -> Backend:
    """A varlen "bshd" backend like flash-attn-4's (one call per group over all documents, q [1, total, r, d], the
    group's one KV head, lse [1, r, total]), made of the CPU flash kernel run per document inside the call:
    exercises the varlen plumbing where FA4 cannot run."""
    cpu = grouped.BACKENDS["cpu"]

    def fwd(q, k, v, scale, docs):
        calls.append(("fwd", q.shape[2], k.shape[2]))
        r = q.shape[2]
        out, lse = torch.empty_like(q), torch.empty(1, r, q.shape[1], dtype=torch.float32)
        for a, e in docs.segments:  # a varlen kernel runs every segment, pads' included
            o, lg, _ = cpu.fwd(q[:, a:e].transpose(1, 2), k[:, a:e].transpose(1, 2).expand(-1, r, -1, -1),
                               v[:, a:e].transpose(1, 2).expand(-1, r, -1, -1), scale)
            out[:, a:e], lse[..., a:e] = o.transpose(1, 2), lg
        return out, lse, ()

    def bwd(g, q, k, v, out, lse, aux, scale, docs):
        calls.append(("bwd", q.shape[2], k.shape[2]))
        r = q.shape[2]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for a, e in docs.segments:  # a varlen kernel runs every segment, pads' included
            t = [x[:, a:e].transpose(1, 2) for x in (g, q, k, v, out)]
            t[2], t[3] = t[2].expand(-1, r, -1, -1), t[3].expand(-1, r, -1, -1)
            gq, gk, gv = cpu.bwd(*t[:5], lse[..., a:e].contiguous(), (), scale)
            dq[:, a:e] = gq.transpose(1, 2)
            dk[:, a:e], dv[:, a:e] = gk.sum(1, keepdim=True).transpose(1, 2), gv.sum(1, keepdim=True).transpose(1, 2)
        return dq, dk, dv

    def never(*args):
        raise AssertionError("a varlen backend is called once per group, not per document")

    return Backend("cpu_varlen", never, never, layout="bshd", fwd_varlen=fwd, bwd_varlen=bwd)


@pytest.mark.parametrize("b, s, hq, hkv, d, docs", CASES)
def test_varlen_backend_one_call_per_group_with_kept_outputs(b, s, hq, hkv, d, docs):
    q, k, v = _qkv(b, s, hq, hkv, d, seed=4)
    cu = _cu(b, s, docs)
    dout = torch.randn(b, s, hq, d, generator=torch.Generator().manual_seed(5))
    calls: list = []
    backend, stash = _varlen_cpu_backend(calls), AttentionStash([0])
    flat = [t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v)]
    with torch.no_grad():  # a checkpoint's first forward: records
        grouped_attention(*flat, 0.3, backend, stash, 0, Documents(cu))
    out = grouped_attention(*flat, 0.3, backend, stash, 0, Documents(cu)).reshape(b, s, hq, d)  # replays
    assert stash.replays == 1
    mine = _grads(out, dout, (q, k, v))
    ref = _grads(_block_causal_ref(q, k, v, cu, 0.3), dout, (q, k, v))
    for a, r in zip(mine, ref):
        assert _rel(a, r) <= 1e-5
    r = hq // hkv  # one forward per group (the replay ran none) and one backward per group, each one KV head
    assert calls == [("fwd", r, 1)] * hkv + [("bwd", r, 1)] * hkv


def test_packed_kept_outputs_skip_the_kernel_and_give_bitwise_equal_grads():
    b, s, hq, hkv, d, docs = 1, 41, 6, 3, 8, [[13, 1, 20, 7]]
    q, k, v = _qkv(b, s, hq, hkv, d, seed=6)
    cu = _cu(b, s, docs)
    dout = torch.randn(b, s, hq, d, generator=torch.Generator().manual_seed(7))
    counting = _Counting(grouped.BACKENDS["cpu"])
    stash = AttentionStash([3])
    flat = [t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v)]
    with torch.no_grad():
        first = grouped_attention(*flat, 0.5, counting.backend, stash, 3, Documents(cu))
    forwards = len(counting.calls)
    assert stash.records == 1 and forwards == hkv * 3  # 3 groups x 3 documents (the one-token one needs no kernel)
    # what is kept is a dense row's: out [1, s, hq, d] and an fp32 lse per head and token
    assert stash.held_bytes() == s * hq * d * 4 + hq * s * 4
    out = grouped_attention(*flat, 0.5, counting.backend, stash, 3, Documents(cu))
    assert stash.replays == 1 and len(counting.calls) == forwards and stash.held_bytes() == 0
    assert torch.equal(out.detach(), first)
    got = _grads(out.reshape(b, s, hq, d), dout, (q, k, v))[1:]
    plain = grouped_attention(*flat, 0.5, grouped.BACKENDS["cpu"], docs=Documents(cu)).reshape(b, s, hq, d)
    for a, r in zip(got, _grads(plain, dout, (q, k, v))[1:]):
        assert torch.equal(a, r)


def _tiny(keep, layers=2):
    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.model.load import build_model

    cfg = preset_config("tiny")
    cfg.num_hidden_layers = layers
    cfg.layer_types = ["full_attention"] * layers
    return parallelize(build_model(cfg, torch.float32, seed=5), make_parallel_state(1), ParallelizeConfig(
        attn_implementation="sdpa", tiled_mlp=False, keep_attention_outputs=keep))


def test_packed_model_with_kept_outputs_equals_without():
    from tests.test_offload import _assert_close
    from ulysses_trainer import shard_batch

    ids = torch.randint(0, 1000, (1, 33), generator=torch.Generator().manual_seed(8))
    pos = torch.cat([torch.arange(n) for n in (10, 1, 22)])[None]
    out = []
    for keep in (False, True):
        model = _tiny(keep)
        model.zero_grad(set_to_none=True)
        loss = model(**shard_batch(ids, sp_size=1, sp_rank=0, position_ids=pos).model_inputs())
        loss.backward()
        out.append((loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, model))
    (ref_loss, ref_grads, _), (loss, grads, model) = out
    _assert_close(loss, grads, ref_loss, ref_grads, tol=1e-6)
    assert model.attention.stash.replays == 2  # both layers' recomputes skipped the kernel on a packed row


# sp=2 through the real SP path (all-to-all, ZeRO-3), 32 tokens = two shards of 16: a document of exactly one shard
# followed by a one-token document; a document crossing the shard edge with one-token documents around it
BOUNDARY_DOCS = ([16, 1, 15], [5, 20, 1, 6])


def _sp2_packed(rank, world_size):
    from tests.dist_utils import sp_zero3_step
    from tests.test_sp_exact import build_model, make_batch
    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize

    results = []
    for docs in BOUNDARY_DOCS:
        ids, pos = make_batch(1, sum(docs), doc_lengths=docs, seed=3)
        state = make_parallel_state(world_size)
        # 4 KV heads over sp=2: two KV-head groups per rank, kept outputs on both layers
        model = parallelize(build_model(kv_heads=4), state, ParallelizeConfig(
            attn_implementation="sdpa", tiled_mlp=False, keep_attention_outputs=True))
        step = sp_zero3_step(model, state, ids, position_ids=pos)
        results.append({"loss": step["loss"], "grads": step["grads"], "replays": model.attention.stash.replays,
                        "cu": step["shard"].context.cu_seqlens.tolist()})
    return results


@pytest.mark.slow
def test_sp2_packed_boundaries_with_kept_outputs_equal_reference():
    from tests.test_sp_exact import make_batch, reference

    per_rank = run_ranks(2, _sp2_packed, timeout=JOB_TIMEOUT_S)
    for i, docs in enumerate(BOUNDARY_DOCS):
        ids, pos = make_batch(1, sum(docs), doc_lengths=docs, seed=3)
        ref_loss, ref_grads = reference(ids, pos, 4)
        for rank in per_rank:
            r = rank[i]
            assert r["replays"] == 2  # both layers reused their kept outputs on the packed row
            assert r["cu"] == per_rank[0][i]["cu"]  # every rank attends over the same document boundaries
            assert abs(r["loss"] - ref_loss) / abs(ref_loss) <= 1e-5
            for name, g in ref_grads.items():
                assert float((r["grads"][name] - g).norm() / g.norm()) <= 1e-5, name
