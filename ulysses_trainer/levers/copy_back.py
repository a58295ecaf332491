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

It replaces a private method of DeepSpeed's ZeRO-3 optimizer, so `install` reads the installed one first: the
method's code must be the one this was written against (`REPLACED`, DeepSpeed 0.19.8's, comments and blank lines
aside) and the attributes it reads must be there (`_NEEDS`). Where they are not (another DeepSpeed release that
changed them), one line says so and DeepSpeed's own copy stays (slower, the same bytes).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

# the private method `PinnedCopyBack.reassign` stands in for, as DeepSpeed 0.19.8 writes it (its code lines, comments
# and blank lines left out): the installed release's must read the same, or it keeps its own
REPLACED = (
    "@instrument_w_nvtx",
    "def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):",
    "if self.fp16_partitioned_groups_flat[sub_group_id] is not None:",
    "self.fp16_partitioned_groups_flat[sub_group_id].data.copy_(",
    "self.fp32_partitioned_groups_flat[sub_group_id].data)",
    "self._unflatten_partitioned_parameters(sub_group_id)",
    "else:",
    "self._partitioned_params_swap_out(sub_group_id)",
)
_NEEDS = ("fp16_groups", "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat",
          "_reassign_or_swap_out_partitioned_parameters", "_unflatten_partitioned_parameters")


def code_lines(method: Any) -> tuple[str, ...]:
    """A method's source as its code lines (stripped; blank and comment lines left out), through DeepSpeed's
    instrument_w_nvtx wrapper (which keeps the function in its closure, not in __wrapped__); () where unreadable."""
    fn = inspect.unwrap(getattr(method, "__func__", method))
    if inspect.isfunction(fn) and fn.__closure__:
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__))
        if "func" in cells and inspect.isfunction(cells["func"].cell_contents):
            fn = cells["func"].cell_contents
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return ()
    return tuple(line.strip() for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def unfit(optimizer: Any) -> str | None:
    """Why this optimizer's copy back cannot be replaced (a missing attribute, or a reassign method that is not
    the one `REPLACED` holds), or None."""
    import deepspeed

    missing = [a for a in _NEEDS if not hasattr(optimizer, a)]
    if missing:
        return f"DeepSpeed {deepspeed.__version__}'s ZeRO-3 optimizer has no {', '.join(missing)}"
    if code_lines(optimizer._reassign_or_swap_out_partitioned_parameters) != REPLACED:
        return (f"DeepSpeed {deepspeed.__version__}'s _reassign_or_swap_out_partitioned_parameters is not the one "
                f"the pinned copy was written against (0.19.8's)")
    return None


def _host_masters(optimizer: Any, always: bool) -> bool:
    """Whether the optimizer steps fp32 masters on the host into GPU partitions (or `always`): where staging helps."""
    pairs = [(d, s) for d, s in zip(getattr(optimizer, "fp16_partitioned_groups_flat", None) or (),
                                    getattr(optimizer, "fp32_partitioned_groups_flat", None) or ()) if d is not None]
    return bool(pairs) and (always or any(d.is_cuda and s.device.type == "cpu" for d, s in pairs))


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
    def install(cls, optimizer: Any, say: bool = True, **kw: Any) -> PinnedCopyBack | None:
        """On a ZeRO-3 optimizer with host fp32 masters and GPU partitions (or `always`) whose copy back is the one
        this replaces; else None, with one line (where `say`: the main rank) where it would have helped but the
        method differs."""
        if not _host_masters(optimizer, kw.get("always", False)):
            return None
        why = unfit(optimizer)
        if why is not None:
            if say:  # one rank's line: every rank decides alike
                log.info(f"the parameters' copy back stays DeepSpeed's own (slower, the same bytes): {why}")
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
