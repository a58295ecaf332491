"""The Ulysses all-to-all: correct placement, round trip is the identity, backward is the reverse."""

import pytest
import torch

from tests.dist_utils import run_ranks


def _a2a(rank, world_size):
    import torch.distributed as dist

    from ulysses_trainer.parallel.comm import heads_to_seq, seq_to_heads

    b, s, h, d = 2, 12, 8, 3
    full = torch.arange(b * s * h * d, dtype=torch.float64).reshape(b, s, h, d)  # same on every rank
    local = full[:, rank * s // world_size:(rank + 1) * s // world_size].clone().requires_grad_(True)
    mid = seq_to_heads(local, world_size, dist.group.WORLD)  # [b, s, h/sp, d]
    hs = h // world_size
    placed = torch.equal(mid, full[:, :, rank * hs:(rank + 1) * hs])
    back = heads_to_seq(mid, world_size, dist.group.WORLD)
    identity = torch.equal(back, local)
    w = torch.randn(back.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    (back * w).sum().backward()
    grad_ok = torch.equal(local.grad, w)  # round trip is the identity, so its gradient is w itself
    return placed, identity, grad_ok


@pytest.mark.slow
def test_all_to_all_round_trip():
    for world_size in (2, 4):
        assert all(all(r) for r in run_ranks(world_size, _a2a)), f"world {world_size}"
