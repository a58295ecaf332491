"""The parameters' copy back from the host's Adam to the GPU through pinned memory, beside the next sub-group's step.

ZeRO-3 with Adam on the host (offload_optimizer) steps the fp32 master parameters one sub-group at a time on the
host, and after each writes them into that sub-group's bf16 partition on the GPU:
`DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters` runs `gpu_bf16.copy_(cpu_fp32)`.
PyTorch converts that on the host into a new pageable tensor (fresh pages every step) and copies from it, blocking:
1.0 s of Qwen3-4B's 256K step on the H200 (docs/benchmarks.md, the flash-attn-4 profile). `PinnedCopyBack` writes
the conversion into one of two page-locked staging buffers instead and copies from it on a side stream, so the copy
of sub-group i runs while the host steps sub-group i+1; a buffer is reused only once its last copy is done, and the
last sub-group's copy is waited for before the step goes on (ZeRO-3's step end reads the partitions). The bytes are
the same: the same fp32 -> bf16 conversion (copy_), then a copy of bf16 bytes.

Checked against DeepSpeed 0.19.8 (the attributes it reads: fp16_groups, fp16_partitioned_groups_flat,
fp32_partitioned_groups_flat, _unflatten_partitioned_parameters), so it installs on DeepSpeed 0.19 only: another
release, or an optimizer without them, keeps DeepSpeed's own copy (slower, the same bytes).
"""

from __future__ import annotations

from typing import Any

import torch

CHECKED_RELEASES = ("0.19",)  # DeepSpeed major.minor whose private method this replaces, read and tested
_NEEDS = ("fp16_groups", "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat",
          "_reassign_or_swap_out_partitioned_parameters", "_unflatten_partitioned_parameters")


class PinnedCopyBack:
    """Installed on a ZeRO-3 optimizer whose fp32 master parameters live on the host (the instance's reassign
    step replaced for the optimizer's lifetime; nothing global). `pin`: page-lock the staging buffers (default:
    where CUDA is); `always`: stage every sub-group, also where source and partition share a device (a CPU run
    checks the path's bytes that way)."""

    def __init__(self, optimizer: Any, pin: bool | None = None, always: bool = False):
        self.opt = optimizer
        self.always = always
        flats = [t for t in optimizer.fp16_partitioned_groups_flat if t is not None]
        self.last = len(optimizer.fp16_groups) - 1
        cuda = any(t.is_cuda for t in flats)
        pin = torch.cuda.is_available() if pin is None else pin
        size = max(t.numel() for t in flats)
        # two buffers: the host converts sub-group i+1 into one while the other's copy is in flight
        self.buffers = [torch.empty(size, dtype=flats[0].dtype, pin_memory=pin) for _ in range(2)]
        self.stream = torch.cuda.Stream(device=flats[0].device) if cuda else None
        self.done: list[Any] = [None, None]  # the event of each buffer's last copy
        self.turn = 0
        self.staged = 0  # sub-group copies that went through a buffer (what the tests count)
        self._own = optimizer._reassign_or_swap_out_partitioned_parameters
        optimizer._reassign_or_swap_out_partitioned_parameters = self.reassign

    @classmethod
    def install(cls, optimizer: Any, **kw: Any) -> PinnedCopyBack | None:
        """On a ZeRO-3 optimizer with host fp32 masters and GPU partitions (or `always`), under a DeepSpeed release
        it was checked against; else None."""
        import deepspeed

        if ".".join(deepspeed.__version__.split(".")[:2]) not in CHECKED_RELEASES:
            return None
        if not all(hasattr(optimizer, a) for a in _NEEDS):
            return None
        pairs = [(d, s) for d, s in zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat)
                 if d is not None]
        if not pairs or not (kw.get("always") or any(d.is_cuda and s.device.type == "cpu" for d, s in pairs)):
            return None
        return cls(optimizer, **kw)

    def reassign(self, sub_group_id: int) -> None:
        opt = self.opt
        dst = opt.fp16_partitioned_groups_flat[sub_group_id]
        src = opt.fp32_partitioned_groups_flat[sub_group_id]
        if dst is None or not (self.always or (dst.is_cuda and src.device.type == "cpu")) or \
                dst.data_ptr() == src.data_ptr():
            self._own(sub_group_id)
        else:
            self._staged(sub_group_id, dst, src)
        if sub_group_id == self.last and self.stream is not None:
            self.stream.synchronize()  # ZeRO-3's step end (the persistent parameters' gather) reads them

    def _staged(self, sub_group_id: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        opt = self.opt
        k, self.turn = self.turn, 1 - self.turn
        if self.done[k] is not None:
            self.done[k].synchronize()  # the buffer's previous copy has left it
        buf = self.buffers[k][:dst.numel()].view(dst.shape)
        buf.copy_(src.data)  # fp32 -> bf16 on the host, into page-locked memory: copy_'s conversion
        if self.stream is None:
            dst.data.copy_(buf)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(dst.device))  # the step's earlier reads of dst
            with torch.cuda.stream(self.stream):
                dst.data.copy_(buf, non_blocking=True)
                self.done[k] = torch.cuda.Event()
                self.done[k].record(self.stream)
        self.staged += 1
        opt._unflatten_partitioned_parameters(sub_group_id)  # views only: nothing reads the data here
