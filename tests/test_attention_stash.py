"""Grouped attention (one KV-head group at a time, explicit log-sum-exp) and kept attention outputs
(the recompute reuses the checkpoint forward's kernel outputs): same results as the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import JOB_TIMEOUT_S, run_ranks, tiny_zero3_sp_step
from tests.test_offload import _assert_close
from ulysses_trainer.attention import grouped
from ulysses_trainer.attention.grouped import Backend, grouped_attention
from ulysses_trainer.attention.stash import AttentionStash


def _ref(q, k, v, scale):
    # [b, s, h, d] -> [b, h, s, d], stock SDPA with GQA, and back
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def _qkv(b, s, hq, hkv, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, dtype=dtype).requires_grad_() for h in (hq, hkv, hkv)]


class _Counting:
    """Wraps a backend; records the head count of every kernel call."""

    def __init__(self, inner: Backend):
        self.inner, self.fwd_heads, self.bwd_heads = inner, [], []
        self.backend = Backend("counting", self._fwd, self._bwd)

    def _fwd(self, q, k, v, scale):
        self.fwd_heads.append((q.shape[1], k.shape[1]))
        return self.inner.fwd(q, k, v, scale)

    def _bwd(self, g, q, k, v, out, lse, aux, scale):
        self.bwd_heads.append((q.shape[1], k.shape[1]))
        return self.inner.bwd(g, q, k, v, out, lse, aux, scale)


def _assert_matches_sdpa(out, q, k, v, dout, scale):
    """out (computed from the leaves q, k, v) and its q/k/v grads against stock SDPA, rel <= 1e-5."""
    out.backward(dout)
    mine = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = _ref(q, k, v, scale)
    ref.backward(dout)
    for a, r in zip(mine, [ref.detach()] + [t.grad for t in (q, k, v)]):
        assert ((a - r).norm() / r.norm()) <= 1e-5


@pytest.mark.parametrize("b, s, hq, hkv, d", [(2, 37, 6, 2, 16), (1, 5, 4, 1, 8), (1, 19, 8, 8, 16)])
def test_grouped_matches_sdpa_forward_and_grads(b, s, hq, hkv, d):
    q, k, v = _qkv(b, s, hq, hkv, d, torch.float32)
    dout = torch.randn(b, s, hq, d, generator=torch.Generator().manual_seed(1))
    counting = _Counting(grouped.BACKENDS["cpu"])
    out = grouped_attention(q, k, v, 0.3, counting.backend)
    _assert_matches_sdpa(out, q, k, v, dout, 0.3)
    # the kernel only ever saw one group: hq/hkv query heads and its KV head repeated for them
    r = hq // hkv
    assert counting.fwd_heads == [(r, r)] * hkv and counting.bwd_heads == [(r, r)] * hkv


def _bshd_cpu_backend(calls: list) -> Backend:
    """A "bshd" backend like flash-attn-4's (q [b, s, r, d], the group's one KV head [b, s, 1, d]), made of
    the CPU flash kernel: exercises GroupedAttention's bshd plumbing where FA4 cannot run."""
    cpu = grouped.BACKENDS["cpu"]

    def fwd(q, k, v, scale):
        calls.append(("fwd", q.shape[2], k.shape[2]))
        r = q.shape[2]
        out, lse, aux = cpu.fwd(q.transpose(1, 2), k.transpose(1, 2).expand(-1, r, -1, -1),
                                v.transpose(1, 2).expand(-1, r, -1, -1), scale)
        return out.transpose(1, 2), lse, aux

    def bwd(g, q, k, v, out, lse, aux, scale):
        calls.append(("bwd", q.shape[2], k.shape[2]))
        r = q.shape[2]
        dq, dk, dv = cpu.bwd(g.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2).expand(-1, r, -1, -1),
                             v.transpose(1, 2).expand(-1, r, -1, -1), out.transpose(1, 2), lse, aux, scale)
        return dq.transpose(1, 2), dk.sum(1, keepdim=True).transpose(1, 2), dv.sum(1, keepdim=True).transpose(1, 2)

    return Backend("cpu_bshd", fwd, bwd, layout="bshd")


@pytest.mark.parametrize("b, s, hq, hkv, d", [(2, 37, 6, 2, 16), (1, 5, 4, 1, 8), (1, 19, 8, 8, 16)])
def test_bshd_backend_matches_sdpa_and_sees_one_kv_head(b, s, hq, hkv, d):
    q, k, v = _qkv(b, s, hq, hkv, d, torch.float32, seed=4)
    dout = torch.randn(b, s, hq, d, generator=torch.Generator().manual_seed(5))
    calls = []
    stash = AttentionStash([0])
    with torch.no_grad():
        grouped_attention(q, k, v, 0.3, _bshd_cpu_backend(calls), stash, layer=0)
    out = grouped_attention(q, k, v, 0.3, _bshd_cpu_backend(calls), stash, layer=0)  # replays the kept output
    _assert_matches_sdpa(out, q, k, v, dout, 0.3)
    r = hq // hkv  # one forward (the replay ran none) and one backward per group, each with one KV head
    assert calls == [("fwd", r, 1)] * hkv + [("bwd", r, 1)] * hkv


def test_kept_outputs_skip_the_kernel_and_give_the_same_grads():
    q, k, v = _qkv(2, 23, 6, 3, 8, torch.float32, seed=3)
    dout = torch.randn(2, 23, 6, 8, generator=torch.Generator().manual_seed(2))
    counting = _Counting(grouped.BACKENDS["cpu"])
    stash = AttentionStash([7])
    with torch.no_grad():  # a checkpoint's first forward: records
        first = grouped_attention(q, k, v, 0.5, counting.backend, stash, layer=7)
    assert stash.records == 1 and len(counting.fwd_heads) == 3 and stash.held_bytes() > 0
    out = grouped_attention(q, k, v, 0.5, counting.backend, stash, layer=7)  # the recompute: replays
    assert stash.replays == 1 and len(counting.fwd_heads) == 3  # no kernel forward ran
    assert stash.held_bytes() == 0  # taken: nothing outlives the recompute
    assert torch.equal(out.detach(), first)
    out.backward(dout)
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    grouped_attention(q, k, v, 0.5, grouped.BACKENDS["cpu"]).backward(dout)
    for a, r in zip(got, [t.grad for t in (q, k, v)]):
        assert torch.equal(a, r)


def _tiny_parallel(keep, every=1, layers=3, seed=5):
    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.model.load import build_model

    cfg = preset_config("tiny")
    cfg.num_hidden_layers = layers
    cfg.layer_types = ["full_attention"] * layers
    return parallelize(build_model(cfg, torch.float32, seed=seed), make_parallel_state(1), ParallelizeConfig(
        attn_implementation="sdpa", tiled_mlp=False, checkpoint_every=every, keep_attention_outputs=keep))


def _step(model, ids):
    from ulysses_trainer import shard_batch

    model.zero_grad(set_to_none=True)
    loss = model(**shard_batch(ids, sp_size=1, sp_rank=0).model_inputs())
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("keep, every", [(True, 1), (2, 1), (True, 2)])
def test_model_with_kept_outputs_equals_without(keep, every):
    ids = torch.randint(0, 1000, (2, 29), generator=torch.Generator().manual_seed(7))
    ref_loss, ref_grads = _step(_tiny_parallel(False, every), ids)
    model = _tiny_parallel(keep, every)
    stash = model.attention.stash
    kept = 3 if keep is True else keep
    for _ in range(2):  # a second step reuses the stash cleanly
        loss, grads = _step(model, ids)
        _assert_close(loss, grads, ref_loss, ref_grads, tol=1e-6)
        assert stash.held_bytes() == 0
    assert stash.replays == 2 * kept  # every kept layer skipped its kernel forward in both recomputes


def test_eval_forward_keeps_nothing():
    from ulysses_trainer import shard_batch

    model = _tiny_parallel(True)
    model.eval()
    with torch.no_grad():
        model(**shard_batch(torch.randint(0, 1000, (1, 16)), sp_size=1, sp_rank=0).model_inputs())
    assert model.attention.stash.records == 0


def test_needs_checkpointing():
    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.model.load import build_model

    with pytest.raises(ValueError, match="keep_attention_outputs needs gradient_checkpointing"):
        parallelize(build_model(preset_config("tiny"), torch.float32), make_parallel_state(1),
                    ParallelizeConfig(gradient_checkpointing=False, keep_attention_outputs=True))
    with pytest.raises(ValueError, match=r"keep_attention_outputs=99 exceeds the model's 2 layers; give 0..2"):
        parallelize(build_model(preset_config("tiny"), torch.float32), make_parallel_state(1),
                    ParallelizeConfig(keep_attention_outputs=99))


def _sp2(rank, world_size):
    from ulysses_trainer import ParallelizeConfig

    out = []
    for keep in (False, True):
        loss, grads, model = tiny_zero3_sp_step(rank, world_size, ParallelizeConfig(
            attn_implementation="sdpa", tiled_mlp=2, keep_attention_outputs=keep), layers=2, small_buckets=True)
        stash = model.attention.stash
        out.append((loss, grads, stash.replays if stash is not None else None))
    return out


@pytest.mark.slow
def test_sp2_zero3_kept_outputs_equal_recompute():
    for (ref_loss, ref_grads, _), (loss, grads, replays) in run_ranks(2, _sp2, timeout=JOB_TIMEOUT_S):
        assert replays == 2
        _assert_close(torch.tensor(loss), {n: torch.from_numpy(g) for n, g in grads.items()},
                      torch.tensor(ref_loss), {n: torch.from_numpy(g) for n, g in ref_grads.items()}, tol=1e-6)


def test_kept_bytes_are_the_plans_term():
    """One memory model: what the stash holds per kept layer is the planner's kept-attention term."""
    from dataclasses import replace

    from ulysses_trainer import shard_batch
    from ulysses_trainer.model.parallelize import apply
    from ulysses_trainer.plan.inputs import ModelShape, Settings
    from ulysses_trainer.plan.layer_terms import kept_attention_bytes_per_layer
    from ulysses_trainer.vocabulary.lever_settings import EVERY_LAYER
    from ulysses_trainer.vocabulary.model_setup import ModelSetup

    model = _tiny_parallel("auto")
    assert model.attention.stash.layers == set()  # auto: nothing kept until a plan says so
    apply(model, ModelSetup(levers=replace(EVERY_LAYER, keep_attention_outputs=2), num_layers=3))
    length = 24
    model(**shard_batch(torch.randint(0, 1000, (1, length)), sp_size=1, sp_rank=0).model_inputs())
    per = kept_attention_bytes_per_layer(ModelShape.from_config(model.config), Settings(max_length=length, bf16=False))
    assert model.attention.stash.held_bytes() == 2 * per


def test_fa4_backward_tiles_are_scoped_to_the_call_and_to_head_dim_128(monkeypatch):
    """flash-attn-4's Hopper backward reads its tiles from the library's table: the trainer's tiles replace the
    table's fields inside the call only (restored after it, also when the call raises), for head_dim 128 only."""
    import dataclasses
    import sys
    import types

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        m_block_size: int = 64
        dQ_swapAB: bool = False
        n_block_size: int = 128

    def table(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
        return Cfg()

    fa = types.ModuleType("flash_attn.cute.interface")
    fa._tile_size_bwd_sm90 = table
    top, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    top.cute, cute.interface = cute, fa
    for name, mod in (("flash_attn", top), ("flash_attn.cute", cute), ("flash_attn.cute.interface", fa)):
        monkeypatch.setitem(sys.modules, name, mod)
    with grouped._sm90_bwd_tiles(grouped.FA4_SM90_BWD):
        assert fa._tile_size_bwd_sm90(128, 128, True, False) == Cfg(m_block_size=80, dQ_swapAB=True)
        assert fa._tile_size_bwd_sm90(64, 64, True, False) == Cfg()  # other head sizes: the library's choice
    assert fa._tile_size_bwd_sm90 is table
    with pytest.raises(RuntimeError), grouped._sm90_bwd_tiles(grouped.FA4_SM90_BWD):
        raise RuntimeError("the kernel failed")
    assert fa._tile_size_bwd_sm90 is table
    assert not grouped._tuned(torch.zeros(1, 2, 1, 128))  # a CPU tensor: no Hopper tiles


def test_flash_attn_4_calls_from_threads_go_one_at_a_time(monkeypatch):
    """flash-attn-4's compiler state breaks when two threads compile at once (verify_sp's ranks are threads):
    the trainer's fa4 forward and backward, dense and varlen, never run inside the library concurrently."""
    import sys
    import threading
    import time
    import types

    inside, most = [0], [0]
    count = threading.Lock()

    def library_call(*args, **kwargs):
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.01)  # a compile's length: long enough for another thread to arrive
        with count:
            inside[0] -= 1
        q = args[0]
        return q, torch.zeros(1), torch.zeros(1)

    fake = types.ModuleType("flash_attn.cute.interface")
    fake._flash_attn_fwd = fake._flash_attn_bwd = library_call
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", fake)
    q = torch.zeros(1, 8, 2, 4)
    docs = grouped.Documents(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32), max_seqlen=8)
    calls = [lambda: grouped._fa4_fwd(q, q, q, 1.0), lambda: grouped._fa4_bwd(q, q, q, q, q, torch.zeros(1), (), 1.0),
             lambda: grouped._fa4_varlen_fwd(q, q, q, 1.0, docs),
             lambda: grouped._fa4_varlen_bwd(q, q, q, q, q, torch.zeros(1, 1), (), 1.0, docs)]
    threads = [threading.Thread(target=calls[i % 4]) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1, most  # without grouped.FA4_LOCK: 8
