"""The fused rotary kernel (levers/rope.py, Triton) against transformers' rotate_half path on a CUDA device: bf16
output and gradients bitwise equal (each product rounded, then the sum, as the eager ops round), fp32 within 1e-6;
HF's layout (views [b, h, s, d] of [b, s, h, d]), odd lengths, Qwen3-4B/8B head shapes (32 query and 8 KV heads
of 128), a batch of two, a whole parallelized model; and, where liger-kernel is installed, Liger's
liger_rotary_pos_emb within bf16 rounding."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from ulysses_trainer.levers import rope

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not rope._has_triton(), reason="needs triton")]


def _inputs(b, s, hq, hkv, d, dtype, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g, device="cuda").to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hkv, d, generator=g, device="cuda").to(dtype).transpose(1, 2).requires_grad_()
    pos = torch.arange(s, device="cuda").float()
    inv = 1.0 / (1_000_000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat([pos[:, None] * inv[None]] * 2, -1)[None].expand(b, -1, -1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def _run(fn, q, k, cos, sin, g):
    out = fn(q, k, cos, sin)
    torch.autograd.backward(out, g)
    res = [t.detach() for t in out] + [q.grad.clone(), k.grad.clone()]
    q.grad = k.grad = None
    return res


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b, s, hq, hkv, d", [(1, 4099, 32, 8, 128), (2, 1031, 32, 8, 128), (1, 77, 16, 8, 128),
                                              (1, 33, 4, 1, 64)])
def test_triton_rope_equals_rotate_half(dtype, b, s, hq, hkv, d):
    q, k, cos, sin = _inputs(b, s, hq, hkv, d, dtype)
    assert rope.rope_kernel_for(q) == "triton"
    g = [torch.randn(t.shape, device="cuda").to(dtype) for t in (q, k)]
    ref = _run(apply_rotary_pos_emb, q, k, cos, sin, g)
    got = _run(rope.TritonRope.apply, q, k, cos, sin, g)
    for name, a, r in zip(("q", "k", "dq", "dk"), got, ref):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        if dtype == torch.bfloat16:
            assert torch.equal(a, r), f"{name}: max diff {(a.float() - r.float()).abs().max().item()}"
        else:
            assert ((a - r).norm() / r.norm()).item() <= 1e-6, name


def test_liger_rotary_agrees_where_installed():
    liger = pytest.importorskip("liger_kernel.transformers.rope")
    q, k, cos, sin = _inputs(1, 4099, 32, 8, 128, torch.bfloat16)
    g = [torch.randn(t.shape, device="cuda").to(torch.bfloat16) for t in (q, k)]
    ref = _run(apply_rotary_pos_emb, q, k, cos, sin, g)
    # Liger takes contiguous [b, h, s, d]
    qc, kc = (t.detach().contiguous().requires_grad_() for t in (q, k))
    theirs = _run(liger.liger_rotary_pos_emb, qc, kc, cos, sin, g)
    for name, a, r in zip(("q", "k", "dq", "dk"), theirs, ref):
        err = ((a.float() - r.float()).norm() / r.float().norm()).item()
        print(f"liger {name}: rel {err:.2e}")
        assert err <= 1e-2, name


def test_a_parallelized_model_on_cuda_runs_the_kernel_and_matches_hf():
    from transformers import Qwen3ForCausalLM

    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize
    from ulysses_trainer.families.presets import preset_config

    cfg = preset_config("tiny")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    plain = Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16)
    fused = Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16)
    fused.load_state_dict(plain.state_dict())
    sp_model = parallelize(fused, make_parallel_state(1), ParallelizeConfig(
        attn_implementation="sdpa", tiled_mlp=False, gradient_checkpointing=False, lean_norm=False))
    calls = []
    inner = rope.TritonRope.apply
    rope.TritonRope.apply = lambda *a: (calls.append(1), inner(*a))[1]
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 257), device="cuda")
        pos = torch.arange(257, device="cuda")[None]
        outs = []
        for model in (plain, sp_model.causal_lm):
            h = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            h.float().pow(2).mean().backward()
            outs.append((h.detach(), {n: p.grad for n, p in model.model.named_parameters()}))
    finally:
        rope.TritonRope.apply = inner
    assert len(calls) == cfg.num_hidden_layers
    # the attention kernels differ (the trainer's KV-group path against HF's F.sdpa): bf16 tolerance
    assert ((outs[1][0].float() - outs[0][0].float()).norm() / outs[0][0].float().norm()).item() <= 1e-2
    for n, g in outs[0][1].items():
        assert ((outs[1][1][n].float() - g.float()).norm() / g.float().norm()).item() <= 1e-2, n


def test_triton_rope_at_1m_tokens_per_rank_indexes_past_int32():
    """Qwen3-4B's 32 query heads x 128 at 1,048,576 tokens per rank (the one-GPU 1M recipe): q holds 2^32 elements,
    so a token's offset s x h x d passes 2^31; the kernel's offsets are int64 (with int32 ones it read out of bounds:
    an illegal memory access). Forward only (the backward runs the same indexing), bitwise HF's in bf16."""
    s, hq, hkv, d = 1_048_576, 32, 8, 128
    q, k, cos, sin = _inputs(1, s, hq, hkv, d, torch.bfloat16)
    with torch.no_grad():
        got = rope.TritonRope.apply(q, k, cos, sin)
        torch.cuda.synchronize()
        for name, a, r in zip(("q", "k"), got, apply_rotary_pos_emb(q, k, cos, sin)):
            assert torch.equal(a, r), name
