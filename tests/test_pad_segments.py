"""A row's pads cost no attention and no MLP work, and change no result: they are segments of their own in
cu_seqlens (at most PAD_SEGMENT tokens each), the per-document kernel paths skip them, a varlen kernel runs them
at one tile a segment, and the tiled MLP leaves their rows out. Against the old layout (pads continuing the last
document's positions, attended as part of it) the real tokens' outputs and every gradient are the same, and packed
rows with pads run sharded at sp=1, 2 and 4 (a length sp does not divide) give every document's loss and gradients
run alone through plain HF (fp32, 1e-5), with the tiled MLP, checkpoints and kept attention outputs on.
"""

from __future__ import annotations

import pytest
import torch

from tests.sp_rank import parallelize_rank, rank_step, summed_grads
from tests.test_packed_attention import _block_causal_ref, _Counting, _qkv, _rel, _varlen_cpu_backend
from tests.test_packing_exact import _examples, _reference
from tests.test_sp_exact import build_model
from tests.threaded_ranks import run_threads
from ulysses_trainer.attention import grouped
from ulysses_trainer.attention.grouped import Documents, grouped_attention
from ulysses_trainer.attention.kernels import sdpa_attention
from ulysses_trainer.data.rows import build_rows
from ulysses_trainer.data.sequences import SequenceDataset
from ulysses_trainer.parallel.sharding import PAD_SEGMENT, document_layout

S = PAD_SEGMENT + 61  # a row: documents, then pads (more than one pad segment in row 1)
ROWS = [[9, 16], [20]]  # each row's documents; the rest of the row is pads


def _layout(hq, hkv, d=8, seed=1):
    """q, k, v [2, S, h, d], the old cu_seqlens (pads in the last document) and the new layout's."""
    q, k, v = _qkv(2, S, hq, hkv, d, seed=seed)
    real = [sum(r) for r in ROWS]
    pos = torch.stack([torch.cat([torch.arange(n) for n in r] + [torch.arange(r[-1], r[-1] + S - sum(r))])
                       for r in ROWS])  # pads continue the last document's positions, as the rows are built
    old, _, _, no_pads = document_layout(pos)
    new, longest, _, pads = document_layout(pos, real)
    assert no_pads == () and pads == ((25, S), (S + 20, 2 * S))
    return q, k, v, old, new, longest, pads, real


def _pad_mask(real) -> torch.Tensor:
    return torch.stack([torch.arange(S) >= n for n in real])  # [2, S]: True on a pad


@pytest.mark.parametrize("hkv", [1, 2])  # one KV head: one F.sdpa call a document; two: KV-head groups
def test_pads_are_left_out_and_the_real_tokens_see_no_change(hkv):
    q, k, v, old, new, longest, pads, real = _layout(4, hkv)
    pad = _pad_mask(real)
    dout = torch.randn(2, S, 4, 8, generator=torch.Generator().manual_seed(2))
    dout[pad] = 0  # what flows back to a pad in training: nothing downstream of it is trained
    ref = _grad_list(_block_causal_ref(q, k, v, old, 0.3), dout, (q, k, v))
    got = _grad_list(sdpa_attention(q, k, v, scale=0.3, cu_seqlens=new, max_seqlen=longest, pad_spans=pads), dout,
                     (q, k, v))
    assert torch.count_nonzero(got[0][pad]) == 0  # the pads' output is 0: no kernel ran on them
    assert _rel(got[0][~pad], ref[0][~pad]) <= 1e-5
    for a, r in zip(got[1:], ref[1:]):  # the grads: exactly none to the pads, the real tokens' unchanged
        assert _rel(a, r) <= 1e-5


def _grad_list(out, dout, leaves):
    out.backward(dout)
    got = [out.detach().clone()] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return got


def test_per_document_calls_cover_the_documents_only():
    q, k, v, old, new, longest, pads, real = _layout(6, 3, seed=3)
    counting = _Counting(grouped.BACKENDS["cpu"])
    flat = [t.reshape(1, 2 * S, *t.shape[2:]) for t in (q, k, v)]
    out = grouped_attention(*flat, 0.3, counting.backend, docs=Documents(new, longest, pads))
    out.sum().backward()
    per_group = [(2, n) for row in ROWS for n in row]  # (query heads of a group, tokens): the documents alone
    assert [c[1:] for c in counting.calls if c[0] == "fwd"] == per_group * 3
    assert [c[1:] for c in counting.calls if c[0] == "bwd"] == per_group * 3
    assert sum(n for _, _, n in counting.calls) == 2 * 3 * sum(real)  # not one pad token reached a kernel


def test_a_varlen_kernel_runs_the_pads_as_short_segments():
    q, k, v, old, new, longest, pads, real = _layout(4, 2, seed=4)
    pad = _pad_mask(real)
    docs = Documents(new, longest, pads)
    assert max(e - a for a, e in docs.segments if any(p <= a < r for p, r in pads)) <= PAD_SEGMENT
    # what attention costs: sum of segment lengths squared, the pads' at most one PAD_SEGMENT tile each
    cost = sum((e - a) ** 2 for a, e in docs.segments)
    assert cost < sum(n * n for row in ROWS for n in row) + (2 * S - sum(real)) * PAD_SEGMENT
    calls: list = []
    dout = torch.randn(2, S, 4, 8, generator=torch.Generator().manual_seed(5))
    dout[pad] = 0
    flat = [t.reshape(1, 2 * S, *t.shape[2:]) for t in (q, k, v)]
    got = _grad_list(grouped_attention(*flat, 0.3, _varlen_cpu_backend(calls), docs=docs).reshape(2, S, 4, 8), dout,
                     (q, k, v))
    ref = _grad_list(_block_causal_ref(q, k, v, old, 0.3), dout, (q, k, v))
    assert _rel(got[0][~pad], ref[0][~pad]) <= 1e-5
    for a, r in zip(got[1:], ref[1:]):
        assert _rel(a, r) <= 1e-5


L = 30  # not a multiple of 4: sp=4 pads each row by 2 more
LENGTHS = [15, 12, 9, 7, 5, 2]  # bfd -> [15, 12, 2] + 1 pad, [9, 7, 5] + 9 pads


def _rank(models, batch, real, rank, world_size):
    from ulysses_trainer.levers.tiled_mlp import TiledMLP

    model, state = parallelize_rank(models[rank], world_size, loss_chunk_size=5, tiled_mlp=3,
                                    gradient_checkpointing=True, keep_attention_outputs=True)
    mlp = model.causal_lm.model.layers[0].mlp
    assert isinstance(mlp, TiledMLP)
    rows_seen: list[int] = []
    inner = mlp.tile_forward
    mlp.tile_forward = lambda x: (rows_seen.append(x.shape[0]), inner(x))[1]
    step = rank_step(model, state, batch["input_ids"], batch["position_ids"], batch["labels"], real)
    return step, rows_seen, sum(step.shard.context.real_rows)


@pytest.mark.parametrize("sp_size", [1, 2, 4])
def test_packed_rows_with_pads_equal_each_document_alone(sp_size):
    built = build_rows(_examples("assistant", LENGTHS), L, True, "truncate", 0)
    tokens, trained, positions, lengths = built.tokens, built.trained, built.positions, built.lengths
    ds = SequenceDataset(tokens, positions, L, "test", built.counts.documents_used, None, trained=trained,
                         lengths=lengths)
    assert all(n < L for n in lengths)  # every row ends in pads
    docs = []
    for i in range(len(ds)):
        n, pos = int(lengths[i]), positions[i * L:(i + 1) * L]
        starts = [j for j in range(n) if pos[j] == 0] + [n]
        docs.append([(tokens[i * L + a:i * L + e], trained[i * L + a:i * L + e]) for a, e in zip(starts, starts[1:])])
    ref_loss, ref_grads, ref_count = _reference(docs)
    rows = [ds[i] for i in range(len(ds))]
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "position_ids", "labels")}
    real = [r["real_tokens"] for r in rows]
    models = [build_model(2) for _ in range(sp_size)]
    out = run_threads(sp_size, lambda rank, world_size: _rank(models, batch, real, rank, world_size))
    for step, rows_seen, real_here in out:
        assert step.count == ref_count
        assert abs(step.loss - ref_loss) / abs(ref_loss) <= 1e-5, (step.loss, ref_loss)
        # the MLP ran its 3 tiles (forward, then backward's recompute) over this rank's real rows only
        assert len(rows_seen) == 6 and sum(rows_seen) == 2 * real_here
    assert sum(o[2] for o in out) == sum(real) == 50  # of 2 rows of 30 (32 at sp=4)
    grads = summed_grads([step for step, _, _ in out])
    for name, ref in ref_grads.items():
        assert torch.linalg.norm(grads[name] - ref) / torch.linalg.norm(ref) <= 1e-5, name
