"""The learning-rate schedule: built from the config (lr_scheduler_type, its kwargs, the warmup), and given a
new peak after a resume that changes the learning rate."""

from __future__ import annotations

from typing import Any


def build_schedule(cfg: Any, optimizer: Any, total_steps: int) -> Any:
    """transformers' schedule lr_scheduler_type over total_steps, warmup_steps (else warmup_ratio) first,
    lr_scheduler_kwargs passed to it (e.g. cosine's num_cycles)."""
    from transformers import get_scheduler

    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=cfg.warmup_for(total_steps),
                         num_training_steps=total_steps, scheduler_specific_kwargs=cfg.lr_scheduler_kwargs)


def set_peak_learning_rate(scheduler: Any, peak: float) -> None:
    """A LambdaLR (transformers' schedules) restored from a checkpoint carries the old peak in base_lrs
    and in its optimizer's groups; give it `peak` from the current step on (the lambda keeps its shape)."""
    scheduler.base_lrs = [peak for _ in scheduler.base_lrs]
    lrs = []
    for group, fn in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = peak
        group["lr"] = peak * fn(scheduler.last_epoch)
        lrs.append(group["lr"])
    scheduler._last_lr = lrs
