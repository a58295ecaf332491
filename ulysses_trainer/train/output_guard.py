"""output_dir as a place to write: checked before the model is built, and every later write failure
(ENOSPC, EROFS, EIO) turned into one line that names the path and the cause.

Before the run: `check_writable` creates and removes a probe file in output_dir (or the nearest existing
parent) and compares the free space with what the run holds at its peak (`run_need`): the checkpoints
save_total_limit keeps plus the one being written (every checkpoint the run writes without a limit; those a
resume finds on disk counted, `peak_checkpoints`) and the final export, sized from the parameter count.
`free_bytes` reads the free space (a test fakes a small disk through it).

During the run: a checkpoint save goes through DeepSpeed on every rank. `RecordingWriter` stands in for
DeepSpeed's checkpoint engine during the save: it writes through the real one and records the first
failure instead of raising, so every rank still runs the same collectives inside DeepSpeed's save (a rank
that raised there would leave its peers waiting in a barrier, and they would report "Connection closed
by peer" instead of the cause). The ranks then agree on the outcome (one all-reduce) and all stop with
the same `OutputWriteError`.

DeepSpeed's one other write inside the save, its recovery scripts, is guarded the same way, and its
`latest` pointer is written by the caller after the save, so nothing can raise between its collectives
(ZeRO-3 all-gathers after the shards are written).

The file-writing function is a parameter (`RecordingWriter(inner, write=...)`), which is how a test
puts a failing disk under a save without a real one.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import TrainerError

# bytes per parameter in one ZeRO checkpoint, all ranks together: fp32 master weights + Adam's m and v
_OPTIMIZER_BYTES_PER_PARAM = 12
_CHECKPOINT_OVERHEAD_BYTES = 64 * 1024  # per-rank model-state files, DeepSpeed's recovery scripts, configs
_CAUSES = (errno.ENOSPC, errno.EROFS, errno.EIO, errno.EACCES, errno.EDQUOT, errno.EPERM)


class OutputWriteError(TrainerError, RuntimeError):
    """A write into output_dir failed at run time (exit code 1); the last complete checkpoint is intact."""


def checkpoint_bytes(num_params: int, world_size: int) -> int:
    """One checkpoint-<step>/ directory: the optimizer's fp32 states of every parameter plus small files."""
    return num_params * _OPTIMIZER_BYTES_PER_PARAM + _CHECKPOINT_OVERHEAD_BYTES * max(1, world_size)


def export_bytes(num_params: int, bf16: bool) -> int:
    """final/: the consolidated weights in the training dtype."""
    return num_params * (2 if bf16 else 4)


_LOG_BYTES = 256 * 1024  # config.json, metrics.jsonl, tensorboard events of a short run


def peak_checkpoints(total_steps: int, save_steps: int | Callable[[int], bool] | None, limit: int | None,
                     start_step: int = 0, on_disk: Iterable[int] = ()) -> int:
    """The most checkpoint-<step>/ directories output_dir holds at once: those on disk (a resume's) plus the
    saves of steps start_step+1..total_steps (every save_steps, or the steps `save_steps(step)` says save, e.g.
    each epoch's end; and the last step), each written beside the ones kept (save_total_limit rotates only once
    the new one is complete)."""
    held = set(on_disk)
    due = save_steps if callable(save_steps) else (lambda s: bool(save_steps) and s % save_steps == 0)
    saves = [s for s in range(start_step + 1, total_steps + 1) if due(s)]
    if total_steps > start_step and total_steps not in saves:
        saves.append(total_steps)  # the end of training always saves
    peak = len(held)
    for step in saves:
        peak = max(peak, len(held) + 1)  # the new one (.tmp-checkpoint-<step>) beside all kept, old step included
        held.add(step)
        if limit is not None:  # rotate_checkpoints: the newest `limit` by step, and the one `latest` names
            held = set(sorted(held)[-limit:]) | {step}
    return peak


@dataclass(frozen=True)
class DiskNeed:
    """What a run holds in output_dir at its peak, and how much of it is already there (a resume's checkpoints)."""

    checkpoints: int  # held at once at the peak
    on_disk: int  # of those, already written by the run a resume continues
    checkpoint_bytes: int
    export_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.checkpoints * self.checkpoint_bytes + self.export_bytes + _LOG_BYTES

    @property
    def new_bytes(self) -> int:
        """What must still fit in the free space (the checkpoints on disk already take theirs)."""
        return max(0, self.checkpoints - self.on_disk) * self.checkpoint_bytes + self.export_bytes + _LOG_BYTES

    def held(self) -> str:
        if not self.checkpoints and not self.export_bytes:
            return f"logs only (save_strategy no) = {_mb(self.peak_bytes)}"
        n = f"{self.checkpoints} checkpoint{'s' if self.checkpoints != 1 else ''}"
        text = f"at most {n} + the export = {_mb(self.peak_bytes)} at its peak"
        if self.on_disk:
            text += f" ({self.on_disk} of them already on disk: {_mb(self.new_bytes)} more)"
        return text


def run_need(num_params: int, world_size: int, bf16: bool, checkpoints: int, on_disk: int = 0) -> DiskNeed:
    """checkpoints: peak_checkpoints(...), 0 when nothing is saved (save_strategy no: no export either)."""
    if not checkpoints:
        return DiskNeed(0, 0, 0, 0)
    return DiskNeed(checkpoints, on_disk, checkpoint_bytes(num_params, world_size), export_bytes(num_params, bf16))


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _mb(n: int | float) -> str:
    return f"{n / 2**20:.1f} MB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def free_bytes(path: str) -> int:
    """Free space for an unprivileged writer on the filesystem that holds (or would hold) `path`."""
    return shutil.disk_usage(_existing_parent(path)).free


def disk_line(output_dir: str, need: DiskNeed) -> str:
    """The run's line before the model is built: its peak and the free space."""
    return f"disk: the run holds {need.held()}; {_mb(free_bytes(output_dir))} free"


def check_writable(output_dir: str, need: DiskNeed | int) -> str | None:
    """None when output_dir (or the parent that would hold it) takes a file and has room for `need` (a
    DiskNeed, or bytes); else the reason, naming the path and the fix."""
    where = _existing_parent(output_dir)
    probe = os.path.join(where, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as exc:
        cause = os.strerror(exc.errno) if exc.errno else str(exc)
        return (f"output_dir {output_dir} is not writable ({where}: {cause}); point output_dir at a writable "
                f"directory")
    free = free_bytes(where)
    need_bytes = need.new_bytes if isinstance(need, DiskNeed) else need
    if free < need_bytes:
        what = f"holds {need.held()}" if isinstance(need, DiskNeed) else f"writes {_mb(need_bytes)}"
        return (f"output_dir {output_dir} has {_mb(free)} free ({where}) but the run {what}; free space there, "
                f"lower save_total_limit, pick another output_dir, or set save_strategy no")
    return None


def _nbytes(obj: Any) -> int:
    """Tensor bytes in a (nested) state dict: what a write of it needs on disk, roughly."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return obj.element_size() * obj.numel()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def describe_failure(exc: BaseException, path: str, need_bytes: int = 0) -> int:
    """The errno behind a failed write. torch.save reports a full disk as a C++ iostream error with no
    errno ("unexpected pos"); the filesystem then says why: read-only, or less free than the write needed."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    named = re.search(r"os error (\d+)", str(exc))  # safetensors' Rust writer: "... (os error 28)"
    if named:
        return int(named.group(1))
    where = _existing_parent(path)
    try:
        stat = os.statvfs(where)
    except OSError:
        return errno.EIO
    if stat.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if stat.f_bavail * stat.f_frsize < max(need_bytes, 2**20) or (stat.f_files and not stat.f_favail):
        return errno.ENOSPC  # less left than the write needed, or no inode left
    return errno.EIO


def failure_message(what: str, path: str, code: int, detail: str = "") -> str:
    cause = os.strerror(code) if code in _CAUSES or code > 0 else "write failed"
    fix = {errno.ENOSPC: "free space there or point output_dir elsewhere",
           errno.EDQUOT: "free space there or point output_dir elsewhere",
           errno.EROFS: "point output_dir at a writable filesystem"}.get(code, "check the disk")
    return (f"cannot write {what} to {path}: {cause}{f' ({detail})' if detail else ''}; {fix}, then resume with "
            f"--resume_from_checkpoint true")


class RecordingWriter:
    """DeepSpeed's checkpoint engine with every write recorded instead of raised (see the module doc).

    `write(state_dict, path)` does the writing: the real engine's save unless a test passes another.
    """

    def __init__(self, inner: Any, write: Callable[[Any, str], None] | None = None) -> None:
        self.inner = inner
        self._write = write or inner.save
        self.failure: tuple[str, int, str] | None = None  # (path, errno, detail) of the first failure

    def _record(self, exc: BaseException, path: str, need_bytes: int = 0) -> None:
        if self.failure is None:
            detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            self.failure = (path, describe_failure(exc, path, need_bytes), f"{os.path.basename(path)}: {detail}")

    def save(self, state_dict: Any, path: str) -> None:
        if self.failure is not None:  # the disk already failed: write nothing more, keep the collectives
            return
        try:
            self._write(state_dict, path)
        except (OSError, RuntimeError) as exc:  # torch.save raises RuntimeError for iostream failures
            self._record(exc, path, _nbytes(state_dict))

    def guard(self, fn: Callable[..., None]) -> Callable[..., None]:
        """`fn` (one of DeepSpeed's own small writes, e.g. its recovery scripts) recorded like a save."""
        def guarded(path: str, *args: Any, **kwargs: Any) -> None:
            if self.failure is not None:
                return
            try:
                fn(path, *args, **kwargs)
            except OSError as exc:
                self._record(exc, path)
        return guarded

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        try:
            self.inner.makedirs(path, exist_ok=exist_ok)
        except OSError as exc:
            self._record(exc, path)

    def __getattr__(self, name: str) -> Any:  # create, commit, load, is_decoupled ...: the real engine's
        return getattr(self.inner, name)
