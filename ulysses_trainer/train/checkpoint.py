"""Atomic DeepSpeed checkpoints, resume, and the final consolidated HF export.

A checkpoint is written to `.tmp-checkpoint-<step>/`, synced, then renamed to `checkpoint-<step>/`;
the `latest` pointer moves last. A rank killed mid-save leaves only a stale tmp directory, and the
previous checkpoint (and `latest`) stay loadable.
"""

from __future__ import annotations

import os
import shutil

import torch

from ..errors import ConfigError
from ..parallel.init import barrier

TAG = "ds"  # DeepSpeed's tag directory inside each checkpoint-<step>/
LATEST = "latest"


def _fsync_tree(path: str) -> None:
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


def save_checkpoint(engine, output_dir: str, step: int, client_state: dict, is_main: bool) -> str:
    """Collective: every rank writes its ZeRO shards; rank 0 syncs, renames, then moves `latest`."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = os.path.join(output_dir, f".tmp-checkpoint-{step}")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    engine.save_checkpoint(tmp, tag=TAG, client_state=client_state)
    barrier()
    if is_main:
        _fsync_tree(tmp)
        if os.path.exists(final):  # the same step saved again after a resume
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(output_dir)
        _write_atomic(os.path.join(output_dir, LATEST), f"checkpoint-{step}\n")
    barrier()
    return final


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
    if not os.path.isdir(os.path.join(path, TAG)):
        raise ConfigError(f"resume_from_checkpoint: {path} holds no checkpoint (expected {path}/{TAG}/); "
                          f"pass an output_dir/checkpoint-<step> directory or `latest`")
    return path


def load_checkpoint(engine, path: str) -> dict:
    """Restore engine, optimizer and scheduler states; returns the client state saved with them."""
    load_path, client_state = engine.load_checkpoint(path, tag=TAG, load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path}")
    return client_state or {}


def export_hf(engine, config, output_dir: str, tokenizer, is_main: bool, prefix: str = "causal_lm.") -> str | None:
    """Consolidate the ZeRO-3 shards (collective) and write `final/` as HF safetensors on rank 0."""
    from transformers import AutoModelForCausalLM

    state = engine._zero3_consolidated_16bit_state_dict()
    target = os.path.join(output_dir, "final")
    if not is_main:
        barrier()
        return None
    state = {k.removeprefix(prefix): v for k, v in state.items()}
    config._attn_implementation = "sdpa"  # the export loads anywhere, without our SP attention
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    assert not missing, f"export lacks weights for {missing[:3]}"
    tmp = target + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp)
    _fsync_tree(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(tmp, target)
    barrier()
    return target
