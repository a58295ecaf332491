"""Ranks as threads of this process, on torch's threaded process group: collectives run for real (the all-to-all
moves the data), no process is started, so the fast tier can check sharded runs against a reference."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)


def run_threads(world_size: int, fn: Callable[[int, int], Any], timeout: float = 120.0) -> list[Any]:
    """[fn(rank, world) for every rank], each rank a thread in one `threaded` process group."""
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []
    store = dist.HashStore()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # each thread its own default group
    _install_threaded_pg()

    def worker(rank: int) -> None:
        dist.init_process_group(backend="threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank, world_size)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller, with its rank
            errors.append((rank, exc))
            ProcessLocalGroup.exception_handle(exc)  # wake the ranks waiting in a collective
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
            if t.is_alive():
                raise TimeoutError(f"a rank thread did not finish in {timeout:g} s (a collective waits forever)")
    finally:
        _uninstall_threaded_pg()
        ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        rank, exc = errors[0]
        raise RuntimeError(f"rank {rank} failed: {exc!r}").with_traceback(exc.__traceback__) from exc
    return results
