"""Start and end the process group: torch.distributed through DeepSpeed, without DeepSpeed's CPU
shared-memory all-reduce op; a barrier; teardown.

On the CPU accelerator `deepspeed.init_distributed` JIT-compiles `deepspeed_shm_comm` (about 30 s
per new venv path, under a file lock in ~/.cache/torch_extensions that a killed build leaves
behind, after which every later start waits on it forever), and, under the `deepspeed` launcher,
maps a 66 MB /dev/shm segment per rank that it never unlinks: measured here, 317 leaked segments
held 20.4 GiB of RAM-backed /dev/shm after a day of CPU runs, and the next test suite swapped to a
halt. The op serves only `inference_all_reduce`, which training never calls; gloo does the rest.
"""

from __future__ import annotations

import os
import sys

SHM_OP = "deepspeed_shm_comm"


def destroy_distributed(together: bool = True) -> None:
    """End the process group before the process exits (a no-op without one).

    A rank that exits while gloo's threads still run can abort in teardown ("terminate called without
    an active exception", exit -6 instead of its code). `together`: wait for every rank first (after
    success); False after a failure, when the other ranks may never arrive."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if together:
            dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - teardown must not hide the run's own outcome
        if together:  # a peer lost after success: say which rank saw it, so a log shows where it broke
            print(f"[ulysses_trainer] (rank {os.environ.get('RANK', '?')}) warning: the end-of-run barrier failed: "
                  f"{' '.join(str(exc).split())[:300]}", file=sys.stderr, flush=True)


def init_distributed(backend: str) -> None:
    """`deepspeed.init_distributed(backend)` (once: a no-op when the group exists); on "gloo" the
    shared-memory op is neither built nor mapped."""
    import deepspeed
    import deepspeed.comm
    import deepspeed.ops

    if _initialized() and getattr(deepspeed.comm, "cdb", None) is not None:
        return  # DeepSpeed has adopted the group; a torch group alone (the rehearsal's fake one) it must adopt

    if backend == "gloo":
        # DeepSpeed builds the op only where its compatibility table says it can (comm/torch.py)
        deepspeed.ops.__compatible_ops__[SHM_OP] = False
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait for every rank; a no-op without a process group."""
    import torch.distributed as dist

    if _initialized():
        dist.barrier()

