"""RoPE through levers/rope.py: on a CPU the torch path runs (HF's rotate_half ops, bitwise HF's
apply_rotary_pos_emb forward and backward), and a parallelized Qwen3 applies it through FusedRopeAttention with
its state-dict keys unchanged and HF's outputs and gradients bitwise (fp32, sp=1). The Triton kernel's exactness
runs on a GPU (tests/test_gpu_rope.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from tests.test_sp_exact import build_model, make_batch
from ulysses_trainer.levers import rope


def _qk_cos_sin(b=2, s=19, hq=4, hkv=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    # HF's layout: views [b, h, s, d] of [b, s, h, d] tensors
    q = torch.randn(b, s, hq, d, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hkv, d, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    ang = torch.randn(b, s, d // 2, generator=g)
    emb = torch.cat([ang, ang], -1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def test_the_torch_path_is_selected_on_cpu_and_is_hfs():
    for dtype in (torch.float32, torch.bfloat16):
        q, k, cos, sin = _qk_cos_sin(dtype=dtype)
        assert rope.rope_kernel_for(q) == "torch"
        mine = rope.apply_rope(q, k, cos, sin)
        g = [torch.randn_like(t) for t in mine]
        torch.autograd.backward(mine, g)
        got = [t.detach() for t in mine] + [q.grad.clone(), k.grad.clone()]
        q.grad = k.grad = None
        ref = apply_rotary_pos_emb(q, k, cos, sin)
        torch.autograd.backward(ref, g)
        for a, b in zip(got, [t.detach() for t in ref] + [q.grad, k.grad]):
            assert torch.equal(a, b)


def test_parallelize_applies_rope_through_the_fused_module_bitwise():
    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize

    ids, pos = make_batch(1, 24, [10, 14])
    plain = build_model(2)
    keys = set(plain.state_dict())
    sp_model = parallelize(build_model(2), make_parallel_state(1), ParallelizeConfig(
        attn_implementation="sdpa", tiled_mlp=False, gradient_checkpointing=False, lean_norm=False,
        loss_type="nll"))
    attns = [layer.self_attn for layer in sp_model.causal_lm.model.layers]
    assert all(isinstance(a, rope.FusedRopeAttention) for a in attns) and len(attns) == 2
    assert set(sp_model.causal_lm.state_dict()) == keys  # the same children under the same names
    hidden = {}
    for name, model in (("plain", plain), ("fused", sp_model.causal_lm)):
        inner = model.model
        out = inner(input_ids=ids[:, :10], position_ids=pos[:, :10], use_cache=False).last_hidden_state
        out.pow(2).sum().backward()
        hidden[name] = (out.detach(), {n: p.grad.clone() for n, p in inner.named_parameters()})
    assert torch.equal(hidden["plain"][0], hidden["fused"][0])
    for n, g in hidden["plain"][1].items():
        assert torch.equal(g, hidden["fused"][1][n]), n


@pytest.mark.slow
def test_the_triton_kernel_under_tritons_cpu_interpreter_is_bitwise_hfs(tmp_path):
    """Where Triton is installed, its CPU interpreter runs the kernel itself (TRITON_INTERPRET=1, read when the
    kernel is defined: a fresh process): bf16 and fp32, forward and backward, bitwise HF's."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton runs this on a CPU)")
    script = tmp_path / "interp.py"
    script.write_text(
        "import torch\n"
        "from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb\n"
        "from ulysses_trainer.levers.rope import TritonRope\n"
        "torch.manual_seed(0)\n"
        "for dtype in (torch.bfloat16, torch.float32):\n"
        "    for b, s, hq, hkv, d in [(1, 37, 8, 2, 16), (2, 13, 6, 3, 32)]:\n"
        "        q = torch.randn(b, s, hq, d).to(dtype).transpose(1, 2).requires_grad_()\n"
        "        k = torch.randn(b, s, hkv, d).to(dtype).transpose(1, 2).requires_grad_()\n"
        "        ang = torch.arange(s).float()[:, None] * torch.rand(d // 2)[None]\n"
        "        emb = torch.cat([ang, ang], -1)[None].expand(b, -1, -1)\n"
        "        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)\n"
        "        g = [torch.randn(t.shape).to(dtype) for t in (q, k)]\n"
        "        res = []\n"
        "        for fn in (apply_rotary_pos_emb, TritonRope.apply):\n"
        "            out = fn(q, k, cos, sin)\n"
        "            torch.autograd.backward(out, g)\n"
        "            res.append([t.detach() for t in out] + [q.grad.clone(), k.grad.clone()])\n"
        "            q.grad = k.grad = None\n"
        "        assert all(torch.equal(a, r) for a, r in zip(*res)), (dtype, b, s)\n"
        "print('bitwise')\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "bitwise" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_a_familys_fused_rope_flag_is_what_parallelize_installs(preset):
    """families' fused_rope (the plan's RoPE term) says which families' attention modules use_fused_rope replaces."""
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families import family
    from ulysses_trainer.families.presets import preset_config

    cfg = preset_config(preset)
    model = AutoModelForCausalLM.from_config(cfg)
    assert (rope.use_fused_rope(model) > 0) == family(cfg.model_type).fused_rope
