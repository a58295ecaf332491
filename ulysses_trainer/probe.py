"""The one machine probe: this machine's GPUs, installed attention and RMSNorm kernels and host RAM, as the
plan sees them (plan/types.Machine). The trainer's preparation and `ulysses-trainer plan` both read it, through
this module's attributes: a test that replaces `local_gpus`, `installed_kernels` or `host_memory` here gives
both the same stand-in machine (docs/testing.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .plan.types import Machine
from .vocabulary.names import GIB


@dataclass(frozen=True)
class LocalGpus:
    """The GPUs here; count 0 (memory and name None) without CUDA."""

    count: int
    memory_gb: float | None
    name: str | None
    bf16: bool = False  # the device takes bf16 (what `bf16: auto` reads, plan/types.Machine.bf16)


def local_gpus(index: int = 0) -> LocalGpus:
    """How many CUDA devices there are, and the memory (GiB) and name of device `index`."""
    if not torch.cuda.is_available():
        return LocalGpus(0, None, None)
    props = torch.cuda.get_device_properties(index)
    return LocalGpus(torch.cuda.device_count(), props.total_memory / GIB, props.name, torch.cuda.is_bf16_supported())


def installed_kernels() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(attention kernels, RMSNorm kernels) installed here, fastest first."""
    from .attention.kernels import available_kernels
    from .levers.lean_norm import available_norm_kernels

    return tuple(available_kernels()), tuple(available_norm_kernels())


def installed_deltanet_kernels() -> tuple[str, ...]:
    """Gated DeltaNet rule kernels installed here, fastest first."""
    from .families.qwen3_5.deltanet_kernels import available_deltanet_kernels

    return tuple(available_deltanet_kernels())


def host_memory(given_gb: float | None) -> tuple[float, str]:
    """(host RAM in GiB the run may use, where the figure comes from): host_memory_gb, else detected here."""
    if given_gb is not None:
        return given_gb, "host_memory_gb"
    from .levers.host_pool import detect_host_memory_gb

    return detect_host_memory_gb(), "detected on this machine"


def free_gpu_memory_gb(device: torch.device | str) -> float | None:
    """The free memory (GiB) of this rank's GPU now, torch's cached blocks released first; None without CUDA.
    Asked once the engine holds the model states (the trainer's post-engine plan)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()  # blocks torch cached during initialize are free for the run
    free, _ = torch.cuda.mem_get_info(device)
    return free / GIB


def this_machine(world_size: int, host_memory_gb: float | None) -> Machine:
    """This machine for a run of `world_size` ranks: GPU memory (total; the free memory is measured after the
    engine is built) of this rank's device (none without CUDA: local_gpus says so, or a test's stand-in for it
    gives a CPU run a GPU's memory), host RAM, ranks per host, the installed kernels."""
    from .parallel.state import ranks_per_node

    gpu = local_gpus(int(os.environ.get("LOCAL_RANK", 0)))
    host, source = host_memory(host_memory_gb)
    kernels, norms = installed_kernels()
    return Machine(gpus=world_size, gpu_memory_gb=gpu.memory_gb, host_memory_gb=host,
                   gpus_per_node=ranks_per_node(default=world_size), kernels=kernels, norm_kernels=norms,
                   deltanet_kernels=installed_deltanet_kernels(),
                   gpu_name=gpu.name, host_memory_source=source,
                   bf16_supported=gpu.bf16, host_cores=os.cpu_count())
