"""When a step logs, evaluates and saves: TRL's logging_strategy / eval_strategy / save_strategy.

"steps" acts every N steps, "epoch" at each epoch end, "no" never. An epoch is one pass of the whole-dataset
sampler (train/data_order.py): step s ends an epoch when its rows reach past a multiple of the dataset's rows
(a step may straddle two epochs; it ends the first). Pure functions of the config and the step counts, so
every rank decides alike without a collective.
"""

from __future__ import annotations

from typing import Any


def ends_epoch(step: int, sequences_per_step: int, rows: int) -> bool:
    """Whether optimizer step `step` (1-based: the count after it ran) finishes a pass over the `rows` rows."""
    return step >= 1 and step * sequences_per_step // rows > (step - 1) * sequences_per_step // rows


def _due(strategy: str, every: int | None, step: int, epoch_end: bool) -> bool:
    if strategy == "epoch":
        return epoch_end
    if strategy == "steps":
        return bool(every) and step % every == 0
    return False


def log_due(cfg: Any, step: int, total: int, epoch_end: bool) -> bool:
    """A train row after `step`: by logging_strategy, the first step (logging_first_step) and the last one
    (unless logging_strategy no)."""
    if cfg.logging_strategy == "no":
        return False
    return step == total or (cfg.logging_first_step and step == 1) or \
        _due(cfg.logging_strategy, cfg.logging_steps, step, epoch_end)


def eval_due(cfg: Any, step: int, epoch_end: bool) -> bool:
    """An evaluation after `step`: every eval_steps, or (eval_strategy epoch) at each epoch end."""
    if cfg.eval_strategy == "epoch":
        return epoch_end
    return _due("steps", cfg.eval_steps, step, epoch_end)


def save_due(cfg: Any, step: int, epoch_end: bool) -> bool:
    """A checkpoint after `step` (the end of the run and a stop signal save besides, unless save_strategy no)."""
    return _due(cfg.save_strategy, cfg.save_steps, step, epoch_end)
