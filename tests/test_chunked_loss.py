"""Chunked lm_head + cross-entropy against the plain full-logits reference (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.levers.chunked_loss import chunked_nll_sum, count_valid, nll_sum

REAL_VOCAB = 151_936


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_case(rows, hidden, vocab, ignore_frac=0.2, seed=0, dtype=torch.float32, lead=None):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * hidden ** -0.5
    y = torch.randint(0, vocab, (rows,), generator=g)
    y[torch.rand(rows, generator=g) < ignore_frac] = -100
    if lead is not None:  # [rows, H] -> [*lead, H]
        h, y = h.view(*lead, hidden), y.view(*lead)
    return h.to(dtype), w.to(dtype), y


def loss_and_grads(fn, h, w, y, scale=1.0, **kw):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    loss = fn(h, w, y, **kw)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def assert_matches_reference(h, w, y, chunk_size, scale=1.0, tol=1e-5):
    ref = loss_and_grads(nll_sum, h, w, y, scale)
    got = loss_and_grads(chunked_nll_sum, h, w, y, scale, chunk_size=chunk_size)
    assert got[0].dtype == torch.float32 and got[0].dim() == 0
    assert abs(got[0].item() - ref[0].item()) <= tol * abs(ref[0].item())
    assert rel(got[1], ref[1]) <= tol, "grad wrt hidden"
    assert rel(got[2], ref[2]) <= tol, "grad wrt weight"
    return ref, got


@pytest.mark.parametrize("chunk_size", [256, 7, 1000, 4096])
def test_matches_plain_odd_sizes(chunk_size):
    h, w, y = make_case(rows=1000, hidden=24, vocab=1237)
    assert_matches_reference(h, w, y, chunk_size)


def test_matches_plain_real_vocab():
    h, w, y = make_case(rows=300, hidden=32, vocab=REAL_VOCAB, seed=1)
    assert_matches_reference(h, w, y, chunk_size=256)


def test_chunks_with_all_labels_ignored():
    h, w, y = make_case(rows=1000, hidden=24, vocab=1237, seed=2)
    y[0:300] = -100  # chunks 0..2 of 100 rows: nothing to learn
    y[700:1000] = -100  # and the tail, including the partial chunk
    ref, got = assert_matches_reference(h, w, y, chunk_size=100)
    assert torch.all(got[1][0:300] == 0) and torch.all(got[1][700:] == 0)
    assert got[1][300:700].abs().sum() > 0


def test_a_whole_gradient_group_ignored_between_valid_ones():
    # chunks of 10 rows gather 8 at a time (GRAD_GROUP): rows 80..159 are the second group, all ignored,
    # between a full first group and a partial third one (rows 160..236)
    h, w, y = make_case(rows=237, hidden=16, vocab=301, seed=12)
    y[80:160] = -100
    y[175:185] = -100  # and one ignored chunk inside the last group
    ref, got = assert_matches_reference(h, w, y, chunk_size=10)
    assert torch.all(got[1][80:160] == 0) and got[1][160:175].abs().sum() > 0


def test_all_labels_ignored_gives_zero_not_nan():
    h, w, y = make_case(rows=257, hidden=16, vocab=1237, seed=3)
    y[:] = -100
    loss, gh, gw = loss_and_grads(chunked_nll_sum, h, w, y, chunk_size=64)
    assert loss.item() == 0.0
    assert torch.all(gh == 0) and torch.all(gw == 0)
    assert count_valid(y) == 0
    assert nll_sum(h, w, y).item() == 0.0  # the reference agrees


def test_grad_output_scales_both_grads():
    h, w, y = make_case(rows=333, hidden=16, vocab=1237, seed=4)
    assert_matches_reference(h, w, y, chunk_size=50, scale=3.7 / 2)
    _, gh1, gw1 = loss_and_grads(chunked_nll_sum, h, w, y, chunk_size=50)
    _, gh2, gw2 = loss_and_grads(chunked_nll_sum, h, w, y, scale=3.7 / 2, chunk_size=50)
    assert rel(gh2, gh1 * 1.85) <= 1e-6 and rel(gw2, gw1 * 1.85) <= 1e-6


def test_batched_leading_dims():
    h, w, y = make_case(rows=3 * 111, hidden=16, vocab=1237, seed=5, lead=(3, 111))
    ref, got = assert_matches_reference(h, w, y, chunk_size=64)
    assert got[1].shape == (3, 111, 16)


@pytest.mark.parametrize("chunk_size", [64, 7])  # 7: the weight gradient is added in several vocab blocks
def test_bf16_close_to_plain(chunk_size):
    h, w, y = make_case(rows=500, hidden=32, vocab=1237, seed=6, dtype=torch.bfloat16)
    ref = loss_and_grads(nll_sum, h, w, y, 0.5)
    got = loss_and_grads(chunked_nll_sum, h, w, y, 0.5, chunk_size=chunk_size)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    assert abs(got[0].item() - ref[0].item()) <= 1e-2 * abs(ref[0].item())
    assert rel(got[1], ref[1]) <= 2e-2 and rel(got[2], ref[2]) <= 2e-2


def test_no_grad_and_frozen_weight():
    h, w, y = make_case(rows=200, hidden=16, vocab=1237, seed=7)
    ref = nll_sum(h, w, y)
    with torch.no_grad():
        assert abs(chunked_nll_sum(h, w, y, chunk_size=64).item() - ref.item()) <= 1e-5 * ref.item()
    hg = h.clone().requires_grad_(True)  # weight frozen: only the hidden grad
    chunked_nll_sum(hg, w, y, chunk_size=64).backward()
    hr = h.clone().requires_grad_(True)
    nll_sum(hr, w, y).backward()
    assert w.grad is None and rel(hg.grad, hr.grad) <= 1e-5


def test_bad_input():
    h, w, y = make_case(rows=10, hidden=8, vocab=50)
    with pytest.raises(ConfigError, match="loss_chunk_size"):
        chunked_nll_sum(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="leading dims"):
        chunked_nll_sum(h, w, y[:-1])


def _sp_rank(rank, world_size, rows, hidden, vocab, chunk_size):
    import torch.distributed as dist

    h, w, y = make_case(rows, hidden, vocab, seed=8)  # identical on every rank
    bounds = torch.tensor_split(torch.arange(rows), world_size)[rank]  # uneven halves
    h_local = h[bounds].clone().requires_grad_(True)
    w_local = w.clone().requires_grad_(True)
    local = chunked_nll_sum(h_local, w_local, y[bounds], chunk_size=chunk_size)
    count = torch.tensor(float(count_valid(y[bounds])))
    total, total_count = local.detach().clone(), count.clone()
    dist.all_reduce(total)
    dist.all_reduce(total_count)
    (local / total_count).backward()  # the global mean, as the trainer normalises it
    dist.all_reduce(w_local.grad)
    # numpy, not tensors: tensors cross the result queue as shared memory that dies with this process
    return total.item(), total_count.item(), h_local.grad.numpy(), w_local.grad.numpy()


@pytest.mark.slow
def test_sequence_parallel_sum_matches_single_process():
    rows, hidden, vocab = 1001, 16, 1237
    out = [(t, c, torch.from_numpy(gh), torch.from_numpy(gw))
           for t, c, gh, gw in run_ranks(2, _sp_rank, rows, hidden, vocab, 100)]
    h, w, y = make_case(rows, hidden, vocab, seed=8)
    ref_sum = nll_sum(h, w, y).item()
    n = count_valid(y)
    _, ref_gh, ref_gw = loss_and_grads(nll_sum, h, w, y, scale=1.0 / n)
    for total, total_count, _, _ in out:
        assert total_count == n
        assert abs(total - ref_sum) <= 1e-5 * abs(ref_sum)
    assert rel(torch.cat([o[2] for o in out]), ref_gh) <= 1e-5
    for o in out:  # every rank holds the same reduced weight grad
        assert rel(o[3], ref_gw) <= 1e-5


def test_second_backward_fails_loudly():
    # backward scales the stored gradients in place; reusing them would silently double-scale
    h, w, y = make_case(rows=20, hidden=8, vocab=50, seed=9)
    loss = chunked_nll_sum(h.requires_grad_(True), w.requires_grad_(True), y, chunk_size=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()
