"""The config's cross-field checks that need no model or data: each problem a ConfigError naming the fix.

They read a TrainConfig's fields (config.py re-exports validate_config); the memory levers are decoded by
vocabulary/lever_settings.decode_levers. This module imports nothing of config.py, so the config part stays below it."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..vocabulary.layout import Layout, resolve_layout
from ..vocabulary.lever_settings import decode_levers


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _check_schedule(cfg: Any) -> None:
    """Steps, batch sizes, intervals and the optimizer's numbers."""
    if cfg.max_steps is not None:
        _need(cfg.max_steps > 0, f"max_steps must be > 0, got {cfg.max_steps}; "
                                 f"use -1 (or null) to train for num_train_epochs instead")
    else:
        _need(cfg.num_train_epochs > 0 and math.isfinite(cfg.num_train_epochs),
              f"num_train_epochs must be > 0 when max_steps is null, got {cfg.num_train_epochs}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "logging_steps", "loss_chunk_size"):
        _need(getattr(cfg, name) >= 1, f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("save_steps", "eval_steps", "save_total_limit", "max_eval_samples"):
        v = getattr(cfg, name)
        _need(v is None or v >= 1, f"{name} must be >= 1 (or null), got {v}")
    _need(cfg.warmup_steps >= 0, f"warmup_steps must be >= 0, got {cfg.warmup_steps}")
    for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon"):
        v = getattr(cfg, name)
        _need(math.isfinite(v) and v >= 0, f"{name} must be a finite number >= 0, got {v}")
    for name in ("adam_beta1", "adam_beta2"):
        v = getattr(cfg, name)
        _need(0.0 <= v < 1.0, f"{name} must be in [0, 1), got {v}")
    _need(0 <= cfg.seed < 2**32, f"seed must be in [0, 2**32), got {cfg.seed}")


def _check_length(cfg: Any, sp_size: int) -> None:
    """max_length is reachable: sequences are padded to a multiple of lcm(pad_to_multiple_of, sp)."""
    if cfg.pad_to_multiple_of is None:
        return
    # Sequences hold exactly max_length tokens and are padded to a multiple of lcm(pad, sp): max_length
    # itself must be such a multiple, else every sequence grows past max_length (memory plans break).
    m = cfg.pad_to_multiple_of
    _need(m >= 1, f"pad_to_multiple_of must be >= 1 (or null), got {m}")
    unit = math.lcm(m, sp_size)
    if cfg.max_length % unit:
        lo, hi = cfg.max_length // unit * unit, (cfg.max_length // unit + 1) * unit
        choices = f"max_length {lo} or {hi}" if lo > 0 else f"max_length {hi}"
        raise ConfigError(
            f"max_length {cfg.max_length} is not reachable with pad_to_multiple_of {m} and sp_size {sp_size} "
            f"(sequences would be padded to a multiple of {unit}); use {choices}, "
            f"or set pad_to_multiple_of null")


def check_eval_source(cfg: Any) -> None:
    """Evaluation data exists: a local dataset_name has no test split, so eval_dataset_name must name it
    (checked with the config when evaluation is on, and by data/documents.py when eval rows are built)."""
    if cfg.eval_dataset_name is None and cfg.dataset_name is not None and Path(cfg.dataset_name).exists():
        raise ConfigError(f"evaluation is on (eval_steps or eval_strategy) but dataset_name {cfg.dataset_name} is "
                          f"a local path with no test split; set eval_dataset_name to the evaluation data (or "
                          f"eval_steps null, eval_strategy no)")


def _check_io(cfg: Any) -> None:
    """Evaluation data and model overrides (report_to is decoded once, in train/prepare.py)."""
    if cfg.evaluates:
        check_eval_source(cfg)
    _need(not cfg.eval_recall_probe or cfg.evaluates,
          "eval_recall_probe runs with evaluation, which is off: set eval_steps (or eval_strategy epoch), or "
          "eval_recall_probe false")
    if cfg.model_init_kwargs is not None:
        bad = sorted(set(cfg.model_init_kwargs) & {"torch_dtype", "dtype", "attn_implementation"})
        _need(not bad, f"model_init_kwargs may not set {bad}: use the bf16 and attn_implementation fields")
    _need(cfg.max_shard_size is None or shard_bytes(cfg.max_shard_size) > 0,
          f"max_shard_size must be a size like 5GB or 500MB, got {cfg.max_shard_size!r}")


def shard_bytes(size: Any) -> int:
    """max_shard_size in bytes as transformers' save_pretrained reads it ("5GB" = 5e9); 0 when malformed."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*", str(size).upper())
    if isinstance(size, bool) or not m:
        return 0
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def validate_config(cfg: Any, world_size: int) -> Layout:
    """Cross-field checks that need no model or data; raise ConfigError naming the fix. The run's layout (sp x dp
    on world_size ranks), decided here once: the plan and the process groups take it."""
    _check_schedule(cfg)
    _need(cfg.host_memory_gb is None or cfg.host_memory_gb > 0,
          f"host_memory_gb must be > 0 (or null to detect), got {cfg.host_memory_gb}")
    decode_levers(cfg)  # the levers' own values and how they combine (vocabulary/lever_settings.py)
    _need(cfg.max_length >= 2, f"max_length must be >= 2 tokens (one input and its target), got {cfg.max_length}")
    layout = resolve_layout(cfg.sp_size, world_size)
    _check_length(cfg, layout.sp_size)
    _check_io(cfg)
    return layout

