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

import contextlib
import logging
import os
import sys

from ..errors import JobStartError
from ..messages import ON_STDERR

log = logging.getLogger(__name__)


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
        _destroy()
    except Exception as exc:  # noqa: BLE001 - teardown must not hide the run's own outcome
        if together:  # a peer lost after success: say which rank saw it, so a log shows where it broke
            log.warning(f"(rank {os.environ.get('RANK', '?')}) warning: the end-of-run barrier failed: "
                        f"{' '.join(str(exc).split())[:300]}", extra=ON_STDERR)


def _destroy() -> None:
    """End the group through DeepSpeed when it adopted it: it also drops its cached groups (a later group in
    this process, the next rehearsal's, would otherwise meet the old world clone); else through torch."""
    import torch.distributed as dist

    comm = sys.modules.get("deepspeed.comm.comm")  # the module whose `cdb` is live (the package's is a copy)
    if comm is not None and getattr(comm, "cdb", None) is not None:
        comm.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()


def init_distributed(backend: str, store=None) -> None:
    """`deepspeed.init_distributed(backend)`; on "gloo" the shared-memory op is neither built nor mapped.
    Again is a no-op (DeepSpeed's own check); a torch group DeepSpeed has not seen (the rehearsal's) it adopts.
    `store`: the job's checked store on the master port (parallel/rendezvous.py), which the group then uses
    instead of opening the port a second time (RANK and WORLD_SIZE from the launcher's environment)."""
    import deepspeed
    import torch.distributed as dist

    from .integrations import without_deepspeed_shm_op

    with without_deepspeed_shm_op() if backend == "gloo" else contextlib.nullcontext():
        try:
            if store is not None and not dist.is_initialized():  # the group on the checked store; DeepSpeed adopts it
                dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]))
            deepspeed.init_distributed(dist_backend=backend, verbose=False)
        except dist.DistNetworkError as exc:  # rank 0 could not open the rendezvous port
            raise JobStartError(_start_failure(str(exc))) from None


def _start_failure(error: str) -> str:
    """The line for a process group that could not start (its port taken, most often)."""
    from .rendezvous import port_taken_line

    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    taken = "EADDRINUSE" in error
    return port_taken_line(addr, port, "that port is in use (another job on this machine?)" if taken
                           else error.splitlines()[0])


def group_started() -> bool:
    """Whether this process's group exists (started before the checks, for a launched job)."""
    return _initialized()


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait for every rank; a no-op without a process group."""
    import torch.distributed as dist

    if _initialized():
        dist.barrier()

