"""Diagnostics: per-token losses (chunked, exact), the per-position loss PNG, the memory timeline."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from ulysses_trainer.train.diagnostics import (
    allocated_curve,
    memory_timeline,
    per_token_losses,
    plot_per_position_loss,
    position_bins,
    unigram_entropy,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tiny_run(seq: int = 300, vocab: int = 97):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16, use_cache=False)
    model = Qwen3ForCausalLM(cfg).eval()
    ids = torch.randint(0, vocab, (1, seq))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, 40:55] = -100  # a stretch of ignored positions, as padding or a masked prompt would give
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # [1, seq, H], final norm applied
    return model, hidden, labels


def test_per_token_losses_match_full_cross_entropy():
    model, hidden, labels = _tiny_run()
    got = per_token_losses(hidden, model.lm_head.weight, labels, chunk=37)  # odd chunk: last one is short
    ref = F.cross_entropy(model.lm_head(hidden).float().reshape(-1, model.config.vocab_size), labels.reshape(-1),
                          ignore_index=-100, reduction="none").reshape(labels.shape)
    valid = labels != -100
    assert got.shape == labels.shape and got.dtype == torch.float32
    assert torch.isnan(got[~valid]).all()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-6)


def test_per_position_plot_writes_png_with_the_binned_means(tmp_path):
    model, hidden, labels = _tiny_run()
    losses = per_token_losses(hidden, model.lm_head.weight, labels)[0]  # [L]
    path = tmp_path / "sub" / "per_position_loss.png"
    bins = plot_per_position_loss(losses, str(path), targets=labels[0], num_bins=12)
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000

    # Direct computation: bins tile positions 1..L, start at 1, grow (log-spaced), and each holds the
    # plain mean of its valid losses.
    flat = losses.double()
    assert bins.lo[0] == 1 and bins.hi[-1] == losses.numel() + 1
    widths = [b - a for a, b in zip(bins.lo, bins.hi)]
    assert widths[-1] > widths[0]
    for a, b, m, n in zip(bins.lo, bins.hi, bins.mean, bins.count):
        vals = [float(v) for v in flat[a - 1:b - 1] if not math.isnan(v)]
        assert n == len(vals) > 0
        assert m == pytest.approx(sum(vals) / len(vals), rel=1e-12)
    assert sum(bins.count) == int((labels != -100).sum())  # ignored positions counted nowhere


def test_position_bins_skip_all_ignored_stretch():
    losses = torch.tensor([1.0, 2.0, float("nan"), float("nan"), 5.0, 7.0])
    # edges 7**(k/6) round to 1, 2, 3, 4, 5, 7: positions 3 and 4 hold no valid loss and are dropped
    bins = position_bins(losses, num_bins=6)
    assert (bins.lo, bins.hi) == ([1, 2, 5], [2, 3, 7])
    assert bins.mean == [1.0, 2.0, 6.0] and bins.count == [1, 1, 2]


def test_unigram_entropy():
    assert unigram_entropy(torch.tensor([3, 3, 3, -100])) == 0.0
    assert unigram_entropy(torch.tensor([1, 2, 3, 4])) == pytest.approx(math.log(4))
    p = torch.tensor([0.5, 0.25, 0.25])
    assert unigram_entropy(torch.tensor([7, 7, 8, 9])) == pytest.approx(float(-(p * p.log()).sum()))


def test_allocated_curve_rebuilds_levels_from_events():
    trace = [{"action": "alloc", "addr": 1, "size": 100, "time_us": 10},
             {"action": "alloc", "addr": 2, "size": 50, "time_us": 20},
             {"action": "free_requested", "addr": 1, "size": 100, "time_us": 30},
             {"action": "free_completed", "addr": 1, "size": 100, "time_us": 31},
             {"action": "segment_alloc", "addr": 9, "size": 4096, "time_us": 32},
             {"action": "free_requested", "addr": 2, "size": 50, "time_us": 40}]
    times, levels, real = allocated_curve(trace, end_allocated=1000)  # 1000 held before and after
    assert real and times[0] == 0.0 and times[-1] == pytest.approx(30e-6)
    assert levels == [1000, 1100, 1150, 1050, 1050, 1050, 1000]


@pytest.mark.gpu
def test_memory_timeline_png_and_peak_on_gpu(tmp_path):
    dev = torch.device("cuda")
    net = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(dev)
    x = torch.randn(2048, 1024, device=dev)
    path = tmp_path / "timeline.png"
    with memory_timeline(str(path), title="test step") as tl:
        loss = net(x).square().mean()
        loss.backward()
        del loss
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert not tl.truncated and len(tl.times) > 5
    # The curve rebuilt from the allocator's events peaks where torch's own statistic does.
    assert abs(tl.peak_bytes - tl.torch_peak_bytes) <= 0.01 * tl.torch_peak_bytes
    assert tl.peak_bytes > tl.start_bytes + 2048 * 4096 * 4  # at least the GELU activation was live
