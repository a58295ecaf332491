"""Qwen3.5 on one GPU in bf16 (needs CUDA): the SP path at sp=1 against stock transformers, and the fla kernel
against the torch one. Tolerances for bf16: loss relative error <= 1e-2, gradient norm <= 5e-2. The observed
figures are printed (`pytest -s`) so a GPU session can record them.

A small Qwen3.5 of the real layer shapes (head_dim 256, DeltaNet heads of 128, 3 DeltaNet + 1 full-attention layer,
hidden 1024) on 4,096 tokens packed as three documents.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.sp_rank import parallelize_rank, rank_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 4096
DOCS = [1500, 2000, 596]


def _model(dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families.presets import preset_config

    c = preset_config("qwen3.5-9b")
    c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers = VOCAB, 1024, 2816, 4
    c.num_attention_heads, c.num_key_value_heads, c.linear_num_key_heads, c.linear_num_value_heads = 8, 2, 4, 8
    c.layer_types = ["linear_attention"] * 3 + ["full_attention"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(c, attn_implementation="sdpa").to("cuda", dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-3.0, 0.0)
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    return ids, pos


def _grad_norm(model) -> float:
    return float(torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None)))


def _reference(ids, pos):
    model = _model()
    total, count = 0.0, 0
    starts = (pos[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    for a, e in zip(starts[:-1], starts[1:]):
        doc = ids[:, a:e].cuda()
        logits = model(input_ids=doc).logits.float()
        total = total + F.cross_entropy(logits[0, :-1], doc[0, 1:], reduction="sum")
        count += e - a - 1
    (total / count).backward()
    return float(total / count), _grad_norm(model)


def _ours(ids, pos, kernel: str):
    model, state = parallelize_rank(_model(), 1, deltanet_kernel=kernel, gradient_checkpointing=True, tiled_mlp="auto")
    step = rank_step(model, state, ids, pos, device="cuda")
    peak = torch.cuda.max_memory_allocated() / 2**30
    return step.loss, _grad_norm(model.causal_lm), peak


def _close(name, got, ref):
    loss_rel, norm_rel = abs(got[0] - ref[0]) / abs(ref[0]), abs(got[1] - ref[1]) / abs(ref[1])
    print(f"{name}: loss {got[0]:.6f} vs {ref[0]:.6f} (rel {loss_rel:.2e}); grad_norm {got[1]:.5f} vs {ref[1]:.5f} "
          f"(rel {norm_rel:.2e})")
    assert loss_rel <= 1e-2 and norm_rel <= 5e-2, (got, ref)


def test_sp1_bf16_equals_stock_transformers_with_each_kernel():
    from ulysses_trainer.families.qwen3_5.deltanet_kernels import available_deltanet_kernels

    ids, pos = _batch()
    ref = _reference(ids, pos)
    for kernel in available_deltanet_kernels():  # fla where installed, and torch
        _close(f"deltanet_kernel {kernel}", _ours(ids, pos, kernel), ref)


def test_fla_equals_torch_on_packed_documents():
    from ulysses_trainer.families.qwen3_5.deltanet_kernels import DELTANET_FUNCTIONS, available_deltanet_kernels

    if "fla" not in available_deltanet_kernels():
        pytest.skip("flash-linear-attention is not installed")
    g = torch.Generator(device="cuda").manual_seed(1)
    t, hk, hv, d = sum(DOCS), 2, 6, 128
    q, k = (torch.randn(1, t, hk, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, t, hv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    gate = -F.softplus(torch.randn(1, t, hv, device="cuda", generator=g))
    beta = torch.rand(1, t, hv, device="cuda", generator=g, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1500, 3500, t], device="cuda", dtype=torch.int32)
    outs = {}
    for name in ("fla", "torch"):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, gate, beta)]
        o = DELTANET_FUNCTIONS[name](*inputs, cu)
        o.float().pow(2).sum().backward()
        outs[name] = [o.float(), *(x.grad.float() for x in inputs)]
    for label, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), outs["fla"], outs["torch"]):
        rel = float((a - b).norm() / b.norm())
        print(f"fla vs torch {label}: {rel:.2e}")
        assert rel <= 2e-2, label


@pytest.mark.parametrize("packed", [False, True])
def test_fla_conv_equals_torch_conv(packed):
    """The conv deltanet_kernel fla runs (fla's causal_conv1d) against the trainer's torch conv, bf16, on the mixer's
    strided [b, s, C] view of its packed channels (the 27B's 1,280 a rank at sp=8): output and both gradients."""
    from ulysses_trainer.families.qwen3_5.deltanet_kernels import CONV_FUNCTIONS, available_deltanet_kernels

    if "fla" not in available_deltanet_kernels():
        pytest.skip("flash-linear-attention is not installed")
    g = torch.Generator(device="cuda").manual_seed(2)
    t, c = sum(DOCS), 1280
    wide = torch.randn(2, t, c + 12, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(c, 4, device="cuda", generator=g, dtype=torch.bfloat16) * 0.5
    cu = torch.tensor([0, 1500, 3500, t, t + 2000, 2 * t], device="cuda", dtype=torch.int32) if packed else None
    outs = {}
    for name in ("fla", "torch"):
        x, wt = wide.clone().requires_grad_(), w.clone().requires_grad_()
        y = CONV_FUNCTIONS[name](x[..., :c], wt, cu)
        y.float().pow(2).sum().backward()
        outs[name] = [y.float(), x.grad.float(), wt.grad.float()]
    for label, a, b in zip(("y", "dx", "dw"), outs["fla"], outs["torch"]):
        rel = float((a - b).norm() / b.norm())
        print(f"fla conv vs torch conv {label} ({'packed' if packed else 'one document a row'}): {rel:.2e}")
        assert rel <= 2e-2, label
