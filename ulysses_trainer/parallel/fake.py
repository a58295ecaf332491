"""One rank of an N-rank job in one process: torch's fake process group (for `ulysses-trainer rehearse`).

The fake backend answers every collective at once without moving data. Shapes, buffers and the order of
calls are the real job's, so memory and kernel time are this rank's own. What the collectives' outputs hold
is `fill`: "local" (default, parallel/local_fill.py) leaves this rank's own values in them, as real-looking
as one process can make them; "none" is the bare fake group (an all-to-all or all-gather leaves its output
as it was allocated), for comparison only: kernels run faster on zeros than on real data.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .init import _destroy, init_distributed


def rank_environment(rank: int, world_size: int, gpus_per_node: int) -> dict[str, str]:
    """The launcher's variables for `rank` of `world_size`: this process always drives device 0."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": str(min(world_size, gpus_per_node)), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int, gpus_per_node: int, device: str,
                       fill: str = "local") -> Iterator[None]:
    """Within the block this process is `rank` of `world_size` on the fake backend, its collectives' outputs
    filled as `fill` says (module docstring), and DeepSpeed's comm layer uses that group. The launcher's
    variables are set for the block and restored after it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .integrations import deepspeed_rank0_trace_check_off, process_group_backend
    from .local_fill import BACKEND, FILLS, create_group

    if fill not in FILLS:
        raise ValueError(f"collective fill {fill!r}: pick one of {', '.join(FILLS)}")
    if dist.is_initialized():
        raise RuntimeError("a process group already exists; a rehearsal needs a process of its own")
    saved = {k: os.environ.get(k) for k in rank_environment(rank, world_size, gpus_per_node)}
    os.environ.update(rank_environment(rank, world_size, gpus_per_node))
    try:
        # the local-fill backend is known for the block only: `init_process_group(BACKEND, ...)` and every
        # `new_group` after it (DeepSpeed's sp/dp groups) build its group; DeepSpeed's rank-0 trace check
        # (which a fake group cannot pass on rank R != 0; every rank runs the same code on the same shapes) is off
        with process_group_backend(BACKEND, create_group, ["cpu", "cuda"]), deepspeed_rank0_trace_check_off():
            try:
                dist.init_process_group(BACKEND if fill == "local" else "fake", store=FakeStore(), rank=rank,
                                        world_size=world_size)
                # DeepSpeed adopts an initialised group; the backend name only matters were it to create one
                init_distributed("nccl" if device == "cuda" else "gloo")
                yield
            finally:  # before the backend is forgotten
                if dist.is_initialized():
                    _destroy()  # through DeepSpeed, which also drops its cached groups
    finally:  # the environment comes back whatever the teardown did
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# c10d op -> the collective it is; the per-rank input is the argument at the given index
_C10D_OPS = {"alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
             "_allgather_base_": ("all_gather", 1), "allgather_": ("all_gather", 1),
             "allgather_into_tensor_coalesced_": ("all_gather", 1), "allgather_coalesced_": ("all_gather", 1),
             "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
             "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1), "allreduce_": ("all_reduce", 0),
             "allreduce_coalesced_": ("all_reduce", 0), "broadcast_": ("broadcast", 0)}


def _nbytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_nbytes(a) for a in arg)
    return 0


class CollectiveLog(TorchDispatchMode):
    """Within the block, every collective this process issues: op -> {"calls", "bytes"} (bytes of input per
    rank, summed). It sees each op at the dispatcher, so it slows everything down: never around a timed step."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            op, arg = _C10D_OPS.get(name, (name, -1))
            row = self.ops.setdefault(op, {"calls": 0, "bytes": 0})
            row["calls"] += 1
            row["bytes"] += _nbytes(args[arg]) if 0 <= arg < len(args) else 0
        return func(*args, **(kwargs or {}))
