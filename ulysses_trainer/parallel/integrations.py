"""Every change this package makes to a third-party library's global state, each scoped: undone when its block
ends or its owner is collected. Nothing here runs at import; the trainer's import registers nothing.

Each names the library versions it was checked on (the CPU machine: torch 2.13.0, DeepSpeed 0.19.8,
transformers 5.24.0; the H200 machine: transformers 5.17). The objects they touch are private or loosely
specified, so a new version of the library is where to look first when one of them stops working.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

SHM_OP = "deepspeed_shm_comm"
# torch 2.13 deprecates the two collectives that DeepSpeed (0.19.8: comm/torch.py) calls on every ZeRO-3 gather
# and gradient reduce; the package calls neither itself (tests/test_hygiene.py), so these two messages are DeepSpeed's
DEEPSPEED_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
_quiet_owners: list[weakref.finalize] = []


@contextlib.contextmanager
def without_deepspeed_shm_op() -> Iterator[None]:
    """DeepSpeed's CPU shared-memory all-reduce op is neither built nor mapped by a process group made within the
    block (parallel/init.py says why): DeepSpeed builds it in TorchBackend.__init__ only where
    `deepspeed.ops.__compatible_ops__` (a module-level dict, probed on first access) says it can. The entry is
    set to False for the block and put back after it. Checked on DeepSpeed 0.19.8 (comm/torch.py build_shm_op)."""
    import deepspeed.ops

    table = deepspeed.ops.__compatible_ops__
    missing = object()
    before = table.get(SHM_OP, missing)
    table[SHM_OP] = False
    try:
        yield
    finally:
        if before is missing:
            table.pop(SHM_OP, None)
        else:
            table[SHM_OP] = before


def quiet_deepspeed_deprecations(owner: Any) -> None:
    """torch's FutureWarning for the two collectives DeepSpeed calls (DEEPSPEED_DEPRECATIONS, those two messages
    only) is not shown while `owner` (the model the engine is built on) lives: it names DeepSpeed's call, which
    the user cannot change, twice per rank in every run. One filter for every live owner, removed with the last.
    Checked on torch 2.13.0 (a `deprecated` wrapper's FutureWarning) and DeepSpeed 0.19.8."""
    _quiet_owners[:] = [f for f in _quiet_owners if f.alive]
    if not _quiet_owners:
        warnings.filterwarnings("ignore", message=DEEPSPEED_DEPRECATIONS, category=FutureWarning)
    done = weakref.finalize(owner, _drop_quiet_filter)
    done.atexit = False  # the process's exit needs no cleanup of a filter
    _quiet_owners.append(done)


def _drop_quiet_filter() -> None:
    """Remove the filter once no owner lives (a finalizer: never raises)."""
    if any(f.alive for f in _quiet_owners):
        return
    _quiet_owners.clear()
    warnings.filters[:] = [f for f in warnings.filters
                           if not (f[0] == "ignore" and f[2] is FutureWarning and f[1] is not None
                                   and f[1].pattern == DEEPSPEED_DEPRECATIONS)]
    mutated = getattr(warnings, "_filters_mutated", None)  # the version the per-module registries cache under
    if mutated is not None:
        mutated()


def register_attention(name: str, attend: Callable, mask: Callable, owner: Any) -> str:
    """transformers' attention and mask registries get `name` -> `attend` / `mask` for as long as `owner` (the
    model whose config names it) lives; the entries go when it is collected, or at `unregister_attention`.
    Checked on transformers 5.17 and 5.24 (GeneralInterface: a class-wide `_global_mapping` dict that `register`
    updates and each forward reads)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, mask)
    done = weakref.finalize(owner, unregister_attention, name, attend, mask)
    done.atexit = False  # the process's exit needs no cleanup of a dict
    return name


def unregister_attention(name: str, attend: Callable, mask: Callable) -> None:
    """Remove `name` from both registries, where it still maps to these functions (a later entry of the same
    name is left alone)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for registry, fn in ((AttentionInterface, attend), (AttentionMaskInterface, mask)):
        if registry._global_mapping.get(name) is fn:
            del registry._global_mapping[name]


def attention_registered(name: str) -> bool:
    """`name` is in transformers' attention registry."""
    from transformers import AttentionInterface

    return name in AttentionInterface._global_mapping


_BACKEND_TABLES = ("backend_type_map", "backend_capability", "default_device_backend_map", "_plugins")


@contextlib.contextmanager
def process_group_backend(name: str, create: Callable, devices: list[str]) -> Iterator[None]:
    """torch.distributed knows the backend `name` (made by `create`, torch's extended API) within the block; after
    it, every entry the registration made is gone (entries others made meanwhile, such as torch's own "fake" that
    its module registers on import, stay). Checked on torch 2.11 and 2.13 (`Backend.register_backend` adds the
    name to `backend_list`, an upper-case class attribute, `backend_type_map`, `backend_capability`, `_plugins`,
    and claims the `default_device_backend_map` entries that no backend held)."""
    import torch.distributed as dist

    b = dist.Backend
    before = {t: dict(getattr(b, t)) for t in _BACKEND_TABLES}
    listed, attr = name.lower() in b.backend_list, name.upper()
    had_attr = attr in vars(b)
    b.register_backend(name, create, extended_api=True, devices=devices)
    after = {t: dict(getattr(b, t)) for t in _BACKEND_TABLES}
    try:
        yield
    finally:
        for t, old in before.items():
            table = getattr(b, t)
            for key, value in after[t].items():  # what the registration changed, where still as it left it
                if old.get(key, table) is not value and table.get(key) is value:
                    if key in old:
                        table[key] = old[key]
                    else:
                        del table[key]
        if not listed and name.lower() in b.backend_list:
            b.backend_list.remove(name.lower())
        if not had_attr and attr in vars(b):
            delattr(b, attr)


@contextlib.contextmanager
def deepspeed_rank0_trace_check_off() -> Iterator[None]:
    """DeepSpeed's ZeRO-3 check that every rank fetched the same modules in the same order (a broadcast of rank 0's
    trace) is skipped within the block: on the rehearsal's fake group no data arrives, so rank R != 0 would compare
    with its own placeholder (-1) and fail. Checked on DeepSpeed 0.19.8
    (runtime/zero/partitioned_param_coordinator.assert_ints_same_as_other_ranks)."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    check = coordinator.assert_ints_same_as_other_ranks
    coordinator.assert_ints_same_as_other_ranks = lambda ints: None
    try:
        yield
    finally:
        coordinator.assert_ints_same_as_other_ranks = check
