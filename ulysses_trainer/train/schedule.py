"""The learning-rate schedule after a resume that changes the peak learning rate."""

from __future__ import annotations

from typing import Any


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
