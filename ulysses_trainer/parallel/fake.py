"""One rank of an N-rank job in one process: torch's fake process group (for `ulysses-trainer rehearse`).

The fake backend answers every collective at once without moving data: an all-to-all or all-gather
leaves its output buffer as it was allocated, a reduction leaves its input as it was. Shapes, buffers
and the order of calls are the real job's, so memory and kernel time are this rank's own; the values
that collectives would have filled are meaningless.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch.distributed as dist

from .init import init_distributed


def rank_environment(rank: int, world_size: int, gpus_per_node: int) -> dict[str, str]:
    """The launcher's variables for `rank` of `world_size`: this process always drives device 0."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": str(min(world_size, gpus_per_node)), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


@contextlib.contextmanager
def _without_rank0_trace_check() -> Iterator[None]:
    """DeepSpeed checks, once per recorded trace, that every rank fetched the same modules in the same
    order by broadcasting rank 0's list; on the fake group no data arrives, so rank R != 0 would compare
    with its own placeholder (-1) and fail. Every rank runs the same code on the same shapes (the
    collective invariant), so the check is skipped for the rehearsal only, and put back after it."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    check = coordinator.assert_ints_same_as_other_ranks
    coordinator.assert_ints_same_as_other_ranks = lambda ints: None
    try:
        yield
    finally:
        coordinator.assert_ints_same_as_other_ranks = check


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int, gpus_per_node: int, device: str) -> Iterator[None]:
    """Within the block this process is `rank` of `world_size` on the fake backend, and DeepSpeed's comm
    layer uses that group. The launcher's variables are set for the block and restored after it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists; a rehearsal needs a process of its own")
    saved = {k: os.environ.get(k) for k in rank_environment(rank, world_size, gpus_per_node)}
    os.environ.update(rank_environment(rank, world_size, gpus_per_node))
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        # DeepSpeed adopts an initialised group; the backend name only matters were it to create one
        init_distributed("nccl" if device == "cuda" else "gloo")
        with _without_rank0_trace_check():
            yield
    finally:
        if dist.is_initialized():
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's cached groups: a later group is new

        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
