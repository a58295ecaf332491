"""What attention costs on packed rows: a row of documents l_1..l_k (runs of position_ids from 0, among the row's
real tokens) costs sum(l_i^2) of causal varlen attention where one document of the row's length L costs L^2.

A row's pads are segments of their own that the kernels leave out (parallel/sharding.py; a varlen kernel spends at
most one PAD_SEGMENT tile on each), so only the real documents count. The plan times attention with the mean of
that fraction over the rows the run trains, in the trainer's order (data/order.py), and the trainer's
tflops_per_gpu and mfu count the same documents (train/metrics.py). In plan/ because the plan reads it and sits
below data/ (numpy only; a dataset is read through its rows, data/sequences.SequenceDataset's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def timed_from_data(cfg: Any) -> bool:
    """Whether the plan times attention from the data (packing, a dataset named); else one document a row."""
    return bool(cfg.packing) and cfg.dataset_name is not None


def segment_lengths(positions: np.ndarray) -> np.ndarray:
    """Lengths of the runs that start where positions are 0 (the first token always starts one)."""
    if len(positions) == 0:
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(positions == 0)
    if len(starts) == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    return np.diff(np.concatenate([starts, [len(positions)]]))


def row_documents(ds: Any, i: int) -> np.ndarray:
    """The lengths of row i's real documents (its pads left out) of a data/sequences.SequenceDataset."""
    real = ds.real_tokens(i)
    if ds.positions is None:  # one document per row
        return np.array([real] if real else [], np.int64)
    L = ds.max_length
    return segment_lengths(ds.positions[i * L:i * L + real]).astype(np.int64)


def row_costs(ds: Any) -> tuple[np.ndarray, np.ndarray]:
    """(real tokens, sum of l_i^2 over the real documents) per row, float64."""
    docs = [row_documents(ds, i) for i in range(len(ds))]
    tokens = np.array([float(d.sum()) for d in docs], np.float64)
    squares = np.array([float((d.astype(np.float64) ** 2).sum()) for d in docs], np.float64)
    return tokens, squares


def row_fractions(ds: Any) -> np.ndarray:
    """Per row: sum(l_i^2) / L^2 over its real documents."""
    L = float(ds.max_length)
    return row_costs(ds)[1] / (L * L)


@dataclass(frozen=True)
class AttentionShare:
    """The data's attention cost against one document per row: mean, least and most over the rows trained."""

    mean: float
    low: float
    high: float
    rows: int

    @classmethod
    def of(cls, ds: Any, rows: np.ndarray | None = None) -> AttentionShare:
        """Of a data/sequences.SequenceDataset: over `rows` (row indices, in the order trained, repeats counted:
        data/order.trained_rows), else over every row once."""
        f = row_fractions(ds)
        if rows is not None:
            f = f[np.asarray(rows, np.int64)]
        return cls(float(f.mean()), float(f.min()), float(f.max()), len(f)) if len(f) else cls(1.0, 1.0, 1.0, 0)

    def describe(self) -> str:
        return (f"packed attention {self.mean:.1%} of one document of max_length (sum of l_i^2 over the real "
                f"documents of the {self.rows} sequences trained, {self.low:.1%}-{self.high:.1%} per sequence)")
