"""The lean norms' fused Triton kernel (Liger-Kernel) against their torch kernel, on a CUDA device.

The torch kernel's forward is bitwise HF's (tests/test_lean_norm.py); the fused one computes the same math
(fp32 rms, the normalized tensor cast to the input dtype, times the weight) with another reduction order:
fp32 agrees to 1e-5, bf16 to its rounding. Odd row counts, head-width rows ([b, s, heads, 128] views) and
a whole Qwen3 decoder layer (forward and all gradients). Runs where CUDA and liger-kernel are installed.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.levers.lean_norm import LeanRMSNorm, available_norm_kernels, use_lean_norms

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(torch.cuda.is_available() and "triton" not in available_norm_kernels(),
                                 reason="needs liger-kernel (pip install 'ulysses_trainer[liger]')")]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(norm: LeanRMSNorm, x: torch.Tensor, g: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    norm.weight.grad = None
    out = norm(x)
    out.backward(g)
    return out.detach(), x.grad, norm.weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37, 64), (2, 4099, 8, 128), (1, 70001, 2560), (1, 1, 17)])
def test_triton_kernel_matches_torch_kernel(dtype, shape):
    hf = Qwen3RMSNorm(shape[-1], eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(shape[-1], device="cuda"))
    gen = torch.Generator("cuda").manual_seed(1)
    x = (3 * torch.randn(shape, generator=gen, device="cuda")).to(dtype)
    g = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    ref = _run(LeanRMSNorm(hf, "torch"), x, g)
    fused = _run(LeanRMSNorm(hf, "triton"), x, g)
    for name, a, b in zip(("out", "grad x", "grad weight"), fused, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = _rel(a, b)
        print(f"{tuple(shape)} {dtype} {name}: rel {err:.2e}")
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]}"
    with torch.no_grad():  # the checkpoint's first forward runs without grad
        assert _rel(LeanRMSNorm(hf, "triton")(x), ref[0]) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_layer_with_triton_norms_matches_torch_norms(dtype):
    cfg = preset_config("tiny")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = Qwen3DecoderLayer(cfg, layer_idx=0).to("cuda", dtype)
    layers = {}
    for kernel in ("torch", "triton"):
        layer = Qwen3DecoderLayer(cfg, layer_idx=0).to("cuda", dtype)
        layer.load_state_dict(base.state_dict())
        assert use_lean_norms(layer, kernel) == 4
        layers[kernel] = layer
    rope = Qwen3RotaryEmbedding(cfg).to("cuda")
    s = 1031
    x = torch.randn(1, s, cfg.hidden_size, device="cuda", dtype=dtype)
    pos = torch.arange(s, device="cuda")[None]
    out = {}
    for kernel, layer in layers.items():
        xi = x.clone().requires_grad_(True)
        y = layer(xi, position_embeddings=rope(xi, pos), position_ids=pos, attention_mask=None)
        y = y[0] if isinstance(y, tuple) else y
        y.float().pow(2).mean().backward()
        out[kernel] = (y.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()})
    (y0, gx0, gp0), (y1, gx1, gp1) = out["torch"], out["triton"]
    assert _rel(y1, y0) <= TOL[dtype] and _rel(gx1, gx0) <= TOL[dtype]
    for name in gp0:
        err = _rel(gp1[name], gp0[name])
        assert err <= 5 * TOL[dtype], f"{name}: relative error {err:.2e}"
