"""Lean RMSNorm: the HF RMSNorm's outputs and gradients, without its fp32 copies in autograd."""

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from tests.dist_utils import run_ranks
from tests.saved_tensors import saved_bytes
from ulysses_trainer.families.presets import preset_config
from ulysses_trainer.levers import lean_norm
from ulysses_trainer.levers.lean_norm import LeanRMSNorm, use_lean_norms


def _pair(width: int, dtype: torch.dtype, seed: int = 0) -> tuple[Qwen3RMSNorm, LeanRMSNorm]:
    hf = Qwen3RMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    ref = Qwen3RMSNorm(width, eps=1e-6).to(dtype)
    ref.load_state_dict(hf.state_dict())
    return ref, LeanRMSNorm(hf)


def _grads(norm, x, g):
    x = x.detach().clone().requires_grad_(True)
    out = norm(x)
    out.backward(g)
    return out.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37, 64), (2, 5, 3, 128), (1, 1, 17)])  # odd rows, a [b, s, heads, d] view
def test_same_output_and_gradients_as_hf(dtype, shape):
    ref, lean = _pair(shape[-1], dtype)
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    out_r, gx_r, gw_r = _grads(ref, x, g)
    out_l, gx_l, gw_l = _grads(lean, x, g)
    assert torch.equal(out_l, out_r)  # the forward is the same ops: bitwise
    assert gx_l.dtype == gx_r.dtype and gw_l.dtype == gw_r.dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: ours sums the weight grad in fp32
    assert (gx_l.float() - gx_r.float()).norm() <= tol * gx_r.float().norm()
    assert (gw_l.float() - gw_r.float()).norm() <= tol * gw_r.float().norm()


def test_backward_by_slabs_matches_one_slab(monkeypatch):
    ref, lean = _pair(64, torch.float32)
    x = torch.randn(4, 33, 64, generator=torch.Generator().manual_seed(2))
    g = torch.randn(4, 33, 64, generator=torch.Generator().manual_seed(3))
    _, gx_r, gw_r = _grads(ref, x, g)
    monkeypatch.setattr(lean_norm, "_BACKWARD_SLAB_ELEMENTS", 64 * 10)  # 14 slabs, the last one short
    _, gx_l, gw_l = _grads(lean, x, g)
    torch.testing.assert_close(gx_l, gx_r, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gw_l, gw_r, rtol=1e-6, atol=1e-6)


def test_frozen_weight_and_no_grad():
    ref, lean = _pair(32, torch.float32)
    lean.weight.requires_grad_(False)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        assert torch.equal(lean(x), ref(x))
    xr = x.clone().requires_grad_(True)
    lean(xr).sum().backward()
    xq = x.clone().requires_grad_(True)
    ref(xq).sum().backward()
    torch.testing.assert_close(xr.grad, xq.grad, rtol=1e-6, atol=1e-7)
    assert lean.weight.grad is None


def test_state_dict_keys_unchanged_and_every_norm_replaced():
    from ulysses_trainer.model.load import build_model

    model = build_model(preset_config("tiny"), torch.float32, seed=0)
    keys = list(model.state_dict())
    n_layers = model.config.num_hidden_layers
    assert use_lean_norms(model) == 4 * n_layers + 1  # input, q, k, post-attention per layer; final
    assert list(model.state_dict()) == keys
    assert not any(type(m).__name__ == "Qwen3RMSNorm" for m in model.modules())
    assert use_lean_norms(model) == 0  # idempotent


def _saved_bytes(layer, x, pos) -> int:
    """Bytes autograd keeps after one forward of `layer`, parameters excluded."""
    _, n = saved_bytes(layer, lambda: layer(x, position_embeddings=pos, attention_mask=None, position_ids=None))
    return n


def test_a_qwen3_layer_keeps_4_bytes_less_per_normed_element():
    cfg = preset_config("tiny")
    cfg._attn_implementation = "sdpa"
    t, h = 96, cfg.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    torch.manual_seed(0)
    layer = Qwen3DecoderLayer(cfg, 0).to(torch.bfloat16)
    x = torch.randn(1, t, h, dtype=torch.bfloat16, requires_grad=True)
    pos = Qwen3RotaryEmbedding(cfg)(x, torch.arange(t)[None])
    hf = _saved_bytes(layer, x, pos)
    use_lean_norms(layer)
    lean = _saved_bytes(layer, x, pos)
    # HF keeps an fp32 upcast (4 B) and the bf16 normalized tensor (2 B) per element of each of the
    # four norms' inputs; lean keeps the bf16 input (2 B); both keep the fp32 scale per row
    assert hf - lean == 4 * t * (2 * h + q + kv), (hf, lean)


def _train_step(rank, world_size, lean: bool):
    from tests.dist_utils import tiny_zero3_sp_step
    from ulysses_trainer import ParallelizeConfig

    loss, grads, _ = tiny_zero3_sp_step(rank, world_size, ParallelizeConfig(attn_implementation="sdpa", tiled_mlp=False,
                                                                       lean_norm=lean))
    return loss, {n: torch.from_numpy(g) for n, g in grads.items() if "norm" in n}


@pytest.mark.slow
def test_zero3_sp2_lean_equals_hf_norms():
    lean = run_ranks(2, _train_step, True)
    hf = run_ranks(2, _train_step, False)
    for (l_loss, l_g), (h_loss, h_g) in zip(lean, hf):
        assert abs(l_loss - h_loss) <= 1e-5 * abs(h_loss)
        assert set(l_g) == set(h_g) and len(l_g) > 0
        for n in h_g:
            assert (l_g[n] - h_g[n]).norm() <= 1e-5 * h_g[n].norm(), n
