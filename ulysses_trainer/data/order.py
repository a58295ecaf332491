"""The order the rows are trained in (TRL's sampler): every epoch a seeded permutation of all the rows, the epochs
one stream that the optimizer steps cut into `per_step` rows. Read by the trainer (train/data_order.py) and by the
plan, which times the rows the run will train (plan/attention_share.py)."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, rows: int, epoch: int) -> torch.Tensor:
    """Row indices of pass `epoch` (from 0) over `rows` rows: the seeded permutation (`ulysses-trainer data` shows
    the rows in this order)."""
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(rows, generator=g)


def stream_rows(seed: int, rows: int, start: int, end: int) -> torch.Tensor:
    """Row indices of positions [start, end) of the stream (a stretch may straddle two epochs)."""
    parts, at = [], start
    while at < end:
        epoch, j = divmod(at, rows)
        take = min(end - at, rows - j)
        parts.append(epoch_permutation(seed, rows, epoch)[j:j + take])
        at += take
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def steps_of(max_steps: int | None, num_train_epochs: float, rows: int, per_step: int) -> int:
    """Optimizer steps a run takes: max_steps, else every row trained num_train_epochs times."""
    return max_steps if max_steps is not None else max(1, math.ceil(num_train_epochs * rows / per_step))


def trained_rows(seed: int, rows: int, per_step: int, steps: int) -> np.ndarray:
    """Row indices of the run's first `steps` optimizer steps, in order (a row trained twice is listed twice)."""
    return stream_rows(seed, rows, 0, steps * per_step).numpy()
