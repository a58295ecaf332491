"""tflops_per_gpu and mfu count the FLOPs that ran: a packed row's real documents (sum of l_i^2 for attention, sum
of l_i for the matmuls), not one document of the row's length; its pads count nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ulysses_trainer.data.sequences import SequenceDataset
from ulysses_trainer.plan.inputs import ModelShape
from ulysses_trainer.train import metrics

Q4 = ModelShape.preset("qwen3-4b")


def _packed_mixed_row() -> SequenceDataset:
    """Two rows of 64: sessions 40 + 10 + 6 then 8 pads continuing the last; one session of 64."""
    pos = np.concatenate([np.arange(40), np.arange(10), np.arange(14), np.arange(64)]).astype(np.int32)
    return SequenceDataset(np.zeros(128, np.int32), pos, 64, "t", 4, None, lengths=np.array([56, 64]))


def test_a_packed_mixed_row_counts_its_documents_only():
    ds = _packed_mixed_row()
    flops = metrics.row_model_flops(Q4, ds)
    attn = 6.0 * Q4.heads * Q4.head_dim * Q4.layers  # per unit of sum(l_i^2): causal half, x3 fwd+bwd
    dense = 6.0 * Q4.matmul_params  # per token
    assert flops[0] == pytest.approx(dense * 56 + attn * (40**2 + 10**2 + 6**2), rel=1e-12)
    assert flops[1] == pytest.approx(dense * 64 + attn * 64**2, rel=1e-12)
    # what tflops_per_gpu counted before for every row: one document of the whole row, pads and all
    whole = dense * 64 + attn * 64**2
    assert flops[0] < whole and flops[1] == pytest.approx(whole, rel=1e-12)


def test_tflops_and_mfu_name_the_peak_used(monkeypatch):
    ds = _packed_mixed_row()
    flops = float(metrics.row_model_flops(Q4, ds).sum())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak = metrics.device_peak_tflops("cuda:0")
    assert peak == (989.4, "NVIDIA H200")
    rates = metrics.throughput(flops, 2.0, 4, peak)
    assert rates["tflops_per_gpu"] == pytest.approx(flops / 2.0 / 4 / 1e12)
    assert rates["mfu"] == pytest.approx(rates["tflops_per_gpu"] / 989.4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert metrics.device_peak_tflops("cuda:0")[0] == 756.0  # the more specific name first
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert metrics.device_peak_tflops("cuda:0") is None
    assert metrics.throughput(flops, 2.0, 4, None)["mfu"] is None
    assert metrics.device_peak_tflops("cpu") is None


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3.5-moe", "qwen3.5-9b"])
def test_a_hybrid_counts_l_squared_on_its_attention_layers_only_and_its_recurrence_linear(preset):
    """Qwen3.5: 3 of 4 layers are Gated DeltaNet (no l^2 term). The matmul weights are the model's own Linears (built
    on the meta device), the attention term runs over the layers that have self_attn."""
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families.presets import preset_config

    config = preset_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = model.model.layers
    attending = sum(1 for layer in layers if hasattr(layer, "self_attn"))
    assert 0 < attending < len(layers)
    shape = ModelShape.from_config(config)
    if shape.experts == 0:  # dense: every Linear runs for every token
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert shape.matmul_params == linear
    t, sq = 1000.0, 1000.0**2
    got = metrics.model_flops(shape, t, sq)
    deltanet = len(layers) - attending
    expected = (6.0 * shape.matmul_params * t + 6.0 * sq * shape.heads * shape.head_dim * attending
                + 18.0 * t * shape.linear_v_heads * shape.linear_k_dim * shape.linear_v_dim * deltanet)
    assert got == pytest.approx(expected, rel=1e-12)
    every_layer = 6.0 * shape.matmul_params * t + 6.0 * sq * shape.heads * shape.head_dim * len(layers)
    assert got < every_layer  # what it counted before: l^2 attention in the DeltaNet layers too
