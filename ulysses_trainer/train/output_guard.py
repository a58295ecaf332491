"""output_dir as a place to write: checked before the model is built, and every later write failure
(ENOSPC, EROFS, EIO) turned into one line that names the path and the cause.

Before the run: `check_writable` creates and removes a probe file in output_dir (or the nearest existing
parent) and compares the free space with `run_bytes`, the size of one checkpoint plus the final export,
computed from the parameter count.

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
from collections.abc import Callable
from typing import Any

# bytes per parameter in one ZeRO checkpoint, all ranks together: fp32 master weights + Adam's m and v
_OPTIMIZER_BYTES_PER_PARAM = 12
_CHECKPOINT_OVERHEAD_BYTES = 64 * 1024  # per-rank model-state files, DeepSpeed's recovery scripts, configs
_CAUSES = (errno.ENOSPC, errno.EROFS, errno.EIO, errno.EACCES, errno.EDQUOT, errno.EPERM)


class OutputWriteError(RuntimeError):
    """A write into output_dir failed at run time (exit code 1); the last complete checkpoint is intact."""


def checkpoint_bytes(num_params: int, world_size: int) -> int:
    """One checkpoint-<step>/ directory: the optimizer's fp32 states of every parameter plus small files."""
    return num_params * _OPTIMIZER_BYTES_PER_PARAM + _CHECKPOINT_OVERHEAD_BYTES * max(1, world_size)


def export_bytes(num_params: int, bf16: bool) -> int:
    """final/: the consolidated weights in the training dtype."""
    return num_params * (2 if bf16 else 4)


def run_bytes(num_params: int, world_size: int, bf16: bool, saving: bool) -> int:
    """What must fit on output_dir's filesystem: one checkpoint (written beside the previous one, which
    stays until the new one is complete) and the final export; a few MB of logs when nothing is saved."""
    logs = 256 * 1024  # config.json, metrics.jsonl, tensorboard events of a short run
    if not saving:
        return logs
    return checkpoint_bytes(num_params, world_size) + export_bytes(num_params, bf16) + logs


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _mb(n: int | float) -> str:
    return f"{n / 2**20:.1f} MB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def check_writable(output_dir: str, need_bytes: int) -> str | None:
    """None when output_dir (or the parent that would hold it) takes a file and has `need_bytes` free;
    else the reason, naming the path and the fix."""
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
    stat = os.statvfs(where)
    free = stat.f_bavail * stat.f_frsize
    if free < need_bytes:
        return (f"output_dir {output_dir} has {_mb(free)} free ({where}) but the run writes {_mb(need_bytes)} "
                f"(one checkpoint and the final export); free space there, pick another output_dir, or set "
                f"save_strategy no")
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
    where = _existing_parent(path)
    try:
        stat = os.statvfs(where)
    except OSError:
        return errno.EIO
    if stat.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if stat.f_bavail * stat.f_frsize < max(need_bytes, 2**20):  # less left than the write needed
        return errno.ENOSPC
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
