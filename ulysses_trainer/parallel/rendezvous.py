"""Before torch.distributed starts: the ranks make sure the store on the master port is this job's.

torch's env:// rendezvous has rank 0 open a TCPStore on MASTER_PORT and the other ranks connect to whatever
answers there. When another job holds that port, rank 0 fails to bind (EADDRINUSE) while the other ranks join
the other job's store and later die inside gloo with a traceback. Here rank 0 opens a store on the port first and
writes this job's token (a digest of the command line every rank runs and the world size); the other ranks
connect and read nothing but that key. A store without the token within the timeout is another job's: the rank
says so in one line (JobStartError) instead of joining it. The checked store is then the process group's own
(init_process_group(store=...)): the port is opened once. (Closing it and letting torch's env:// rendezvous open
it again raced: a peer that moved on first connected to the closing store and died with "Failed to recv".)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import timedelta

from ..errors import JobStartError

TOKEN_TIMEOUT_S = 300.0  # a peer waits this long for rank 0 (its imports may be slower on a loaded machine)
_PREFIX = "ulysses_trainer/job/"


def job_token(argv: list[str] | None = None, world_size: int | None = None) -> str:
    """The same on every rank of one launch: its command line (without the launcher's per-rank --local_rank)
    and the world size."""
    argv = sys.argv[1:] if argv is None else argv
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--local_rank":
            skip = True
        elif not a.startswith("--local_rank="):
            kept.append(a)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    return hashlib.sha256(json.dumps([kept, world_size]).encode()).hexdigest()[:16]


def port_taken_line(addr: str, port: int | str, why: str) -> str:
    return (f"cannot start the process group on {addr}:{port}: {why}; pass a free port to the launcher, e.g. "
            f"deepspeed --master_port 29600 --num_gpus N launch/train.py ...")


def check_one_job(addr: str, port: int, rank: int, world_size: int, token: str,
                  timeout_s: float | None = None):
    """Rank 0: open the store on addr:port and publish `token`; the others: connect and find `token` there.
    Returns the store (None for one rank), which the process group then uses. JobStartError (one line) on the
    rank that finds the port taken or the store another job's."""
    if world_size <= 1:
        return None
    timeout_s = TOKEN_TIMEOUT_S if timeout_s is None else timeout_s
    import torch.distributed as dist

    key = _PREFIX + token
    wait = timedelta(seconds=timeout_s)
    if rank == 0:
        try:
            store = dist.TCPStore(addr, port, None, is_master=True, timeout=wait, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:  # DistNetworkError is a RuntimeError
            taken = "EADDRINUSE" in str(exc) or "in use" in str(exc)
            raise JobStartError(port_taken_line(addr, port, "that port is in use (another job on this machine?)"
                                                if taken else str(exc).splitlines()[0])) from None
        store.set(key, "1")
        return store
    try:
        # world size None: the client adds no counter of its own, so another job's store stays untouched
        store = dist.TCPStore(addr, port, None, is_master=False, timeout=wait)
        store.wait([key], wait)  # another job's store never holds it
    except (RuntimeError, OSError) as exc:
        raise JobStartError(port_taken_line(
            addr, port, f"rank {rank} found no store of this job there within {timeout_s:g} s (another job holds "
                        f"the port, or rank 0 did not start: see its error; {str(exc).splitlines()[0][:120]})")) \
            from None
    return store
