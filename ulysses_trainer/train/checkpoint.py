"""Atomic DeepSpeed checkpoints and resume (the final HF export: export.py).

A checkpoint is written to `.tmp-checkpoint-<step>/`, synced, then renamed to `checkpoint-<step>/`;
the `latest` pointer moves last. A rank killed mid-save leaves only a stale tmp directory, and the
previous checkpoint (and `latest`) stay loadable. Each checkpoint holds a marker file (MARKER): only a
directory holding it is ever deleted, by save_total_limit's rotation or by overwrite_output_dir.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError
from ..parallel.comm import all_reduce
from ..parallel.init import barrier
from ..vocabulary.names import CHECKPOINT_MARKER, TENSORBOARD_DIR
from .output_guard import OutputWriteError, RecordingWriter, describe_failure, failure_message

TAG = "ds"  # DeepSpeed's tag directory inside each checkpoint-<step>/
LATEST = "latest"
MODEL_CONFIG = "model_config.json"  # the HF config of the model a checkpoint holds (checked on resume)
RUN_CONFIG = "run_config.json"  # the training config and layout that wrote it (compared on resume)
MARKER = CHECKPOINT_MARKER  # in every checkpoint this trainer writes: what may be deleted
WEIGHTS_ONLY = "weights_only"  # in a save_only_model checkpoint: HF weights, no optimizer state (not resumable)
CHECKPOINT = re.compile(r"checkpoint-(\d+)")
# what a run writes into output_dir: a directory holding any of these holds a previous run
EVENTS_FILE = "events.jsonl"  # a run's events that are not training rows (a config change at a resume)
RUN_FILES = ("config.json", "ds_config.json", "metrics.jsonl", EVENTS_FILE, LATEST, "final", "per_position_loss.png",
             "eval_loss_by_position*.png", "checkpoint-[0-9]*", ".tmp-checkpoint-[0-9]*", "final.tmp")
EVENTS = "events.out.tfevents.*"  # TensorBoard's event files (in output_dir/runs/, run_log.Reporters)
_MODEL_DIMS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size")


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def agree_on_failure(code: int) -> int:
    """Collective: the largest errno any rank saw (0: every rank succeeded). Takes the place of a barrier,
    so that every rank learns of a failure on any one of them and all stop together."""
    return int(all_reduce(torch.tensor([float(code)]), "max").item())


def save_checkpoint(engine, output_dir: str, step: int, client_state: dict, is_main: bool,
                    model_config=None, run_config: dict | None = None,
                    write: Callable[[Any, str], None] | None = None, total_limit: int | None = None) -> str:
    """Collective: every rank writes its ZeRO shards; rank 0 syncs, renames, then moves `latest`.
    `model_config` (the HF config) and `run_config` (the training config and layout) are saved beside
    the shards so a resume can check them without loading the shards. `write(state_dict, path)` replaces
    DeepSpeed's file writer (tests: a disk that fails). A failed write on any rank: the temporary directory
    is removed, the previous checkpoint and `latest` are untouched, and every rank raises OutputWriteError.
    total_limit (save_total_limit): once `latest` names the new checkpoint, older ones beyond the newest N go."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = os.path.join(output_dir, f".tmp-checkpoint-{step}")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    writer = RecordingWriter(engine.checkpoint_engine, write)
    engine.checkpoint_engine = writer  # for this save only; restored below
    engine._copy_recovery_script = writer.guard(engine._copy_recovery_script)
    try:
        # save_latest=False: the tag's `latest` is written below with the other small files, so that no
        # write of DeepSpeed's can raise between its collectives (ZeRO-3 all-gathers after the shards)
        engine.save_checkpoint(tmp, tag=TAG, client_state=client_state, save_latest=False)
    finally:
        engine.checkpoint_engine = writer.inner
        del engine._copy_recovery_script  # the class's method again
    failure = writer.failure
    if is_main and failure is None:
        try:
            with open(os.path.join(tmp, LATEST), "w") as f:  # DeepSpeed's own pointer to its tag
                f.write(TAG)
            if model_config is not None:
                with open(os.path.join(tmp, MODEL_CONFIG), "w") as f:
                    f.write(model_config.to_json_string())
            if run_config is not None:
                with open(os.path.join(tmp, RUN_CONFIG), "w") as f:
                    json.dump(run_config, f, indent=1)
            with open(os.path.join(tmp, MARKER), "w") as f:
                f.write(f"written by ulysses_trainer at step {step}; save_total_limit and overwrite_output_dir "
                        f"may delete this directory\n")
            fsync_tree(tmp)
            if os.path.exists(final):  # the same step saved again after a resume
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(output_dir)
            _write_atomic(os.path.join(output_dir, LATEST), f"checkpoint-{step}\n")
            if total_limit is not None:
                rotate_checkpoints(output_dir, total_limit)
        except OSError as exc:
            failure = (tmp, describe_failure(exc, tmp), str(exc))
    code = agree_on_failure(failure[1] if failure else 0)
    if code:
        if is_main:  # a half-written checkpoint must not survive (and `latest` never pointed at it)
            shutil.rmtree(tmp, ignore_errors=True)
            for leftover in (os.path.join(output_dir, LATEST + ".tmp"),):
                if os.path.exists(leftover):
                    os.remove(leftover)
        barrier()
        # the checkpoint's directory is named (rank 0 may not be the rank whose file failed)
        raise OutputWriteError(failure_message(f"checkpoint-{step}", tmp, code, failure[2] if failure else ""))
    return final


def mark_weights_only(output_dir: str, step: int, is_main: bool, total_limit: int | None = None) -> str:
    """A save_only_model checkpoint (checkpoint-<step>/ written as an HF export): rank 0 adds the marker and the
    weights-only note, then moves `latest` to it and rotates (save_total_limit), as save_checkpoint does."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    if is_main:
        with open(os.path.join(final, WEIGHTS_ONLY), "w") as f:
            f.write(f"save_only_model: the model weights at step {step} (HF safetensors), no optimizer or scheduler "
                    f"state; load it with from_pretrained or as model_name_or_path, a run cannot resume from it\n")
        with open(os.path.join(final, MARKER), "w") as f:
            f.write(f"written by ulysses_trainer at step {step}; save_total_limit and overwrite_output_dir "
                    f"may delete this directory\n")
        fsync_tree(final)
        _write_atomic(os.path.join(output_dir, LATEST), f"checkpoint-{step}\n")
        if total_limit is not None:
            rotate_checkpoints(output_dir, total_limit)
    barrier()
    return final


def trainer_checkpoints(output_dir: str) -> dict[int, str]:
    """{step: path} of the checkpoint-<step> directories this trainer wrote (those holding its MARKER)."""
    if not os.path.isdir(output_dir):
        return {}
    found = {}
    for name in os.listdir(output_dir):
        m = CHECKPOINT.fullmatch(name)
        path = os.path.join(output_dir, name)
        if m and not os.path.islink(path) and os.path.isfile(os.path.join(path, MARKER)):
            found[int(m.group(1))] = path
    return found


def rotate_checkpoints(output_dir: str, limit: int) -> list[str]:
    """save_total_limit (TRL's): keep the newest `limit` checkpoints by step, and always the one `latest`
    names; every older one this trainer wrote is deleted (also those of the run a resume continues). A
    directory without the marker is never touched. Returns the deleted paths."""
    pointer = os.path.join(output_dir, LATEST)
    latest = open(pointer).read().strip() if os.path.isfile(pointer) else None
    ours = trainer_checkpoints(output_dir)
    keep = set(sorted(ours)[-limit:])
    gone = []
    for step, path in sorted(ours.items()):
        if step not in keep and os.path.basename(path) != latest:
            shutil.rmtree(path)
            gone.append(path)
    return gone


def find_checkpoint(resume_from_checkpoint, output_dir: str) -> str | None:
    """`true`/`latest` -> output_dir's latest checkpoint; a path -> that checkpoint-<step> directory."""
    if resume_from_checkpoint in (None, False, ""):
        return None
    if resume_from_checkpoint is True or resume_from_checkpoint == "latest":
        pointer = os.path.join(output_dir, LATEST)
        if not os.path.exists(pointer):
            raise ConfigError(f"resume_from_checkpoint={resume_from_checkpoint}: no checkpoint in {output_dir} "
                              f"(no `latest` file); drop the flag to start fresh or pass a checkpoint path")
        path = os.path.join(output_dir, open(pointer).read().strip())
    else:
        path = str(resume_from_checkpoint)
    if os.path.isfile(os.path.join(path, WEIGHTS_ONLY)):
        raise ConfigError(f"resume_from_checkpoint: {path} was written with save_only_model true: it holds the "
                          f"model weights only, no optimizer or scheduler state, so the run cannot continue from it; "
                          f"resume from a checkpoint saved with save_only_model false, or start a new run from its "
                          f"weights (model_name_or_path {path})")
    if not os.path.isdir(os.path.join(path, TAG)):
        raise ConfigError(f"resume_from_checkpoint: {path} holds no checkpoint (expected {path}/{TAG}/); "
                          f"pass an output_dir/checkpoint-<step> directory or `latest`")
    return path


def _run_names(output_dir: str) -> set[str]:
    if not os.path.isdir(output_dir):
        return set()
    names = {os.path.basename(p) for pattern in RUN_FILES
             for p in glob.glob(os.path.join(glob.escape(output_dir), pattern))}
    return {n for n in names if "checkpoint-" not in n or CHECKPOINT.fullmatch(n.removeprefix(".tmp-"))}


def previous_run(output_dir: str) -> list[str]:
    """The names in output_dir that a previous run wrote (empty: a new or empty directory)."""
    found = _run_names(output_dir)
    if found <= {"config.json", "ds_config.json"}:  # a run stopped before its first step trained nothing
        return []
    return sorted(found)


def check_output_dir(output_dir: str, resume_path: str | None, overwrite: bool) -> bool:
    """Refuse an output_dir that is a file, or one holding a previous run that is neither resumed from
    nor to be overwritten (TRL's rule). Returns whether the previous run's files must be cleared."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"output_dir {output_dir} is a file; set output_dir to a directory path")
    parent = os.path.dirname(os.path.abspath(output_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"output_dir {output_dir} lies under {parent}, which is a file; set output_dir to a "
                          f"directory path")
    found = previous_run(output_dir)
    if not found:
        return False
    inside = resume_path is not None and \
        os.path.realpath(os.path.dirname(os.path.normpath(resume_path))) == os.path.realpath(output_dir)
    if inside:  # resuming the run that lives there: it continues in place
        return False
    if overwrite:
        return True
    shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
    raise ConfigError(f"output_dir {output_dir} holds a previous run ({shown}); resume it with "
                      f"resume_from_checkpoint true, set overwrite_output_dir true to replace it, or pick another "
                      f"output_dir")


def clear_previous_run(output_dir: str) -> list[str]:
    """Remove what a previous run wrote (overwrite_output_dir, or a fresh start over a run that trained no step):
    its checkpoints (those holding MARKER), final/, metrics.jsonl, events.jsonl, config.json, latest, its temporary
    directories and TensorBoard's event files in runs/. Anything else stays (a user's checkpoint-best/, a checkpoint-<N>
    without the marker, other files in runs/). Returns the removed paths (a directory's ends with a separator)."""
    ours = {os.path.basename(p) for p in trainer_checkpoints(output_dir).values()}
    removed = []
    for name in sorted(_run_names(output_dir)):
        path = os.path.join(output_dir, name)
        if CHECKPOINT.fullmatch(name) and name not in ours:
            continue  # not this trainer's (no marker): never deleted
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
            removed.append(os.path.join(path, ""))  # a directory: with its trailing separator
        else:
            os.remove(path)
            removed.append(path)
    runs = os.path.join(output_dir, TENSORBOARD_DIR)
    # runs/ itself, and runs/RUN_NAME/ (a run given a run_name writes there)
    events = glob.glob(os.path.join(glob.escape(runs), EVENTS)) + \
        glob.glob(os.path.join(glob.escape(runs), "*", EVENTS))
    for path in events:  # a new run's curves never show the old run's steps
        os.remove(path)
        removed.append(path)
    for d in sorted({os.path.dirname(p) for p in events}, key=len, reverse=True):
        if d != runs and not os.listdir(d):
            os.rmdir(d)
    if events and os.path.isdir(runs) and not os.listdir(runs):
        os.rmdir(runs)
    return removed


def describe_removed(output_dir: str, removed: list[str], overwrite: bool) -> str:
    """The line saying what clear_previous_run removed: the names under output_dir, TensorBoard's files counted."""
    events = [p for p in removed if fnmatch.fnmatch(os.path.basename(p), EVENTS)]
    names = [os.path.relpath(p, output_dir) + ("/" if p.endswith(os.sep) else "") for p in removed if p not in events]
    if events:
        names.append(f"{len(events)} TensorBoard event file{'s' if len(events) != 1 else ''} in {TENSORBOARD_DIR}/")
    why = "overwrite_output_dir" if overwrite else "a fresh start over a run that trained no step"
    return f"{why}: removed the previous run's files from {output_dir}: {', '.join(names)}"


def _dims(config) -> dict:
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return {k: get(k) for k in _MODEL_DIMS}


def _describe_dims(d: dict) -> str:
    return (f"hidden {d['hidden_size']}, {d['num_hidden_layers']} layers, intermediate {d['intermediate_size']}, "
            f"{d['num_attention_heads']}/{d['num_key_value_heads']} heads, vocab {d['vocab_size']}")


def check_checkpoint_model(path: str, model_config) -> None:
    """A checkpoint resumes only into a model of the same shape: say both sizes before anything is built."""
    saved = os.path.join(path, MODEL_CONFIG)
    if not os.path.isfile(saved):  # written by every save since it existed; older checkpoints are not checked
        return
    try:
        with open(saved) as f:
            theirs = _dims(json.load(f))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"resume_from_checkpoint: cannot read {saved} ({exc}); pass an intact checkpoint") \
            from None
    ours = _dims(model_config)
    if theirs != ours:
        raise ConfigError(f"resume_from_checkpoint: {path} holds a model of {_describe_dims(theirs)}, but this run "
                          f"builds {_describe_dims(ours)}; resume with the model_name_or_path and "
                          f"model_init_kwargs of the run that wrote it, or drop resume_from_checkpoint")


def load_checkpoint(engine, path: str) -> dict:
    """Restore engine, optimizer and scheduler states; returns the client state saved with them."""
    load_path, client_state = engine.load_checkpoint(path, tag=TAG, load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path}")
    return client_state or {}
