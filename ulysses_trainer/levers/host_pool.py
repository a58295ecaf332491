"""One page-locked host buffer for the offloaded layer checkpoints, sized up front.

PyTorch's pinned allocator rounds every allocation up to a power of two — one big `pin_memory` tensor
included (1.1 GiB took 2.00 GiB of RSS on the H200) — which can double host use. The pool allocates
ordinary memory of exactly the size needed and page-locks it with cudaHostRegister, then carves it
into page-aligned per-layer slots. Its need is checked against `host_memory_gb` before pinning.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..errors import ConfigError
from ..vocabulary.names import GIB

# Slots start on page boundaries: each slot is whole pages, and any dtype view of it is aligned.
_SLOT_ALIGN = 4096
# Kept free when the host memory is detected rather than given: the OS, the dataloader, DeepSpeed.
_MARGIN_FRACTION = 0.10
_MARGIN_MIN_BYTES = 4 * GIB


def host_bytes_needed(offload_layers: int, batch: int, local_seq: int, hidden: int, dtype_bytes: int) -> int:
    """Host bytes that `offload_layers` offloaded layer inputs of [batch, local_seq, hidden] take."""
    for name, v in (("offload_layers", offload_layers), ("batch", batch), ("local_seq", local_seq),
                    ("hidden", hidden), ("dtype_bytes", dtype_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"host_bytes_needed: {name} must be an int >= 0, got {v!r}")
    return offload_layers * batch * local_seq * hidden * dtype_bytes


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _cgroup_available_bytes() -> int | None:
    # A container's memory limit is not visible in /proc/meminfo, which reports the whole machine.
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes a huge number
            return max(0, limit - usage)
    return None


def detect_host_memory_gb() -> float:
    """Host memory available now, in GiB: MemAvailable (or psutil), capped by a cgroup limit if any.

    Some VMs start with a small MemTotal that grows as memory is used; there the figure is too low
    and the user sets host_memory_gb instead.
    """
    avail: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024  # the kernel's "kB" is KiB
                    break
    except OSError:
        pass
    if avail is None:
        import psutil

        avail = int(psutil.virtual_memory().available)
    cgroup = _cgroup_available_bytes()
    if cgroup is not None:
        avail = min(avail, cgroup)
    return avail / GIB


# --------------------------------------------------------------------------------------------
# Host pool


def _unpin(buffer: Tensor) -> None:
    # No copy may still be reading or writing the pages when they are unpinned.
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class HostPool:
    """One page-locked host buffer, sized once for num_slots x slot_bytes, carved into slots by view.

    Why not torch.empty(..., pin_memory=True), per tensor or even once: PyTorch's pinned caching
    allocator rounds every allocation up to a power of two, so a 2.3 GB checkpoint takes a 4 GB
    block and an 83 GB pool takes 128 GB, up to twice the host memory. Instead the pool allocates
    ordinary memory of exactly the size needed and page-locks it with cudaHostRegister, which pins
    exactly those pages; copies to and from it are then asynchronous DMA like any pinned memory.
    Without CUDA (or pin=False) the buffer is plain memory. `pinned` says which: Tensor.is_pinned()
    answers False for memory page-locked this way (torch 2.11), though copies are async DMA
    (measured on the H200: 55 GB/s both ways, the same as pin_memory, and non-blocking).

    The budget: host_memory_gb when given (the host RAM the offload may use on this host), else
    the available memory detected when the pool is made, less a safety margin. Either is shared
    evenly by the ranks_per_node ranks of one host, each of which makes its own pool. So make the
    pool after the big host allocations (the DeepSpeed engine) and before the first forward.

    Shapes are fixed per run, so the pool never grows: a later request for larger slots raises.
    Smaller inputs use a prefix of their slot. Pre-allocate with the largest shape when lengths vary.

    `held_slots` (a memory rehearsal's host stand-in): only that many
    slots are held, and slot k is slot k % held_slots, so a layer's input is overwritten by a later
    layer's. GPU memory and the copies are as in the real run; the budget is still checked against all
    num_slots (the job's need, `counted_bytes`). Values are then garbage: never in training.
    """

    def __init__(self, host_memory_gb: float | None = None, ranks_per_node: int = 1,
                 held_slots: int | None = None) -> None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ConfigError(f"ranks_per_node must be an int >= 1, got {ranks_per_node!r}")
        if held_slots is not None and (isinstance(held_slots, bool) or not isinstance(held_slots, int)
                                       or held_slots < 1):
            raise ConfigError(f"held_slots must be an int >= 1 or None, got {held_slots!r}")
        if host_memory_gb is not None:
            if host_memory_gb <= 0:
                raise ConfigError(f"host_memory_gb must be > 0, got {host_memory_gb}")
            host_bytes = int(host_memory_gb * GIB)
            self.budget_source = f"host_memory_gb={host_memory_gb}"
        else:
            avail = int(detect_host_memory_gb() * GIB)
            host_bytes = max(0, avail - max(_MARGIN_MIN_BYTES, int(_MARGIN_FRACTION * avail)))
            self.budget_source = (f"detected {avail / GIB:.1f} GiB available, less a "
                                  f"{(avail - host_bytes) / GIB:.1f} GiB safety margin")
        if ranks_per_node > 1:
            self.budget_source += f", shared by {ranks_per_node} ranks on this host"
        self.budget_bytes = host_bytes // ranks_per_node  # this rank's share
        self.buffer: Tensor | None = None
        self.pinned = False
        self.slot_bytes = 0  # the largest input a slot holds
        self.slot_stride = 0  # slot_bytes rounded up to _SLOT_ALIGN
        self.num_slots = 0
        self.allocations = 0  # host allocations made (at most one)
        self.held_slots = held_slots  # memory rehearsal only: slots physically held (see the class)
        self._finalizer: weakref.finalize | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return 0 if self.buffer is None else self.buffer.numel()

    @property
    def counted_bytes(self) -> int:
        """Host bytes the slots take in a real run (nbytes unless held_slots aliases them)."""
        return self.slot_stride * self.num_slots

    def allocate(self, slot_bytes: int, num_slots: int, pin: bool | None = None) -> None:
        """Allocate the buffer once; pin defaults to whether CUDA is available.

        Calling again with slots that fit in the allocated ones is a no-op; larger ones raise.
        """
        if slot_bytes < 0 or num_slots < 0:
            raise ValueError(f"slot_bytes and num_slots must be >= 0, got {slot_bytes}, {num_slots}")
        if self.buffer is not None:
            if slot_bytes > self.slot_bytes or num_slots > self.num_slots:
                raise RuntimeError(
                    f"activation offload host pool holds {self.num_slots} slots of {self.slot_bytes} bytes, "
                    f"but {num_slots} slots of {slot_bytes} bytes are needed now. Shapes are fixed per run: "
                    f"pad every batch to the same length (max_length), or allocate the pool up front for "
                    f"the largest shape with HostPool.allocate(slot_bytes, num_slots)")
            return
        stride = -(-slot_bytes // _SLOT_ALIGN) * _SLOT_ALIGN
        need = stride * num_slots
        if need > self.budget_bytes:
            raise ConfigError(
                f"activation offload needs {need} bytes ({need / GIB:.2f} GiB) of pinned host memory "
                f"({num_slots} layers x {slot_bytes} bytes) but only {self.budget_bytes} bytes "
                f"({self.budget_bytes / GIB:.2f} GiB) are available to this rank ({self.budget_source}). "
                f"Fix: offload fewer layers (activation_offload: auto or a smaller int), use more sp "
                f"ranks (each rank then holds a shorter slice of the sequence), or set host_memory_gb if "
                f"this VM under-reports its memory")
        pin = torch.cuda.is_available() if pin is None else pin
        if self.held_slots is not None:
            need = stride * min(num_slots, self.held_slots)  # the budget above was checked for all of them
        raw = torch.empty(need + _SLOT_ALIGN, dtype=torch.uint8)  # pageable; pinned in place below
        start = -raw.data_ptr() % _SLOT_ALIGN
        buffer = raw[start:start + need]  # page-aligned view, keeps raw alive
        if pin and need > 0:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), need, 0))
            self._finalizer = weakref.finalize(self, _unpin, buffer)
            self._finalizer.atexit = False  # at exit the process's pages go back anyway
        self.buffer = buffer
        self.pinned = pin
        self.slot_bytes, self.slot_stride, self.num_slots = slot_bytes, stride, num_slots
        self.allocations += 1

    def slot(self, k: int) -> Tensor:
        """Slot k as a uint8 view of slot_bytes; no two slots overlap (unless held_slots aliases them)."""
        if self.buffer is None:
            raise RuntimeError("HostPool.slot called before allocate")
        if not 0 <= k < self.num_slots:
            raise IndexError(f"slot {k} out of range 0..{self.num_slots - 1}")
        if self.held_slots is not None:
            k %= self.held_slots  # the host stand-in: slots share the few held ones
        start = k * self.slot_stride
        return self.buffer[start:start + self.slot_bytes]

    def close(self) -> None:
        """Unpin and drop the buffer; no copy may be in flight (it synchronizes the device first)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.buffer = None
        self.pinned = False
