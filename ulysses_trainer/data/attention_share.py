"""What attention costs on packed rows: a row of documents l_1..l_k (runs of position_ids from 0) costs
sum(l_i^2) of causal varlen attention where one document of the row's length L costs L^2.

The plan times attention with the mean of that fraction over the data's rows (plan/step_time.py); the
rows' pads continue the last document's positions, so they count with it, as the kernel sees them.
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
    starts = np.flatnonzero(positions == 0)
    if len(starts) == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    return np.diff(np.concatenate([starts, [len(positions)]]))


def row_fractions(positions: np.ndarray | None, max_length: int, rows: int) -> np.ndarray:
    """Per row: sum(l_i^2) / L^2; 1.0 for every row without packing (positions None: one span of L)."""
    if positions is None:
        return np.ones(rows)
    L = float(max_length)
    return np.array([float((segment_lengths(positions[i * max_length:(i + 1) * max_length]).astype(np.float64) ** 2)
                           .sum()) / (L * L) for i in range(rows)])


@dataclass(frozen=True)
class AttentionShare:
    """The data's attention cost against one document per row: mean, least and most over its rows."""

    mean: float
    low: float
    high: float
    rows: int

    @classmethod
    def of(cls, ds: Any) -> AttentionShare:
        """Of a data/sequences.SequenceDataset."""
        f = row_fractions(ds.positions, ds.max_length, len(ds))
        return cls(float(f.mean()), float(f.min()), float(f.max()), len(f)) if len(f) else cls(1.0, 1.0, 1.0, 0)

    def describe(self) -> str:
        return (f"packed attention {self.mean:.1%} of one document of max_length (sum of l_i^2 over {self.rows} "
                f"sequences of the data, {self.low:.1%}-{self.high:.1%} per sequence)")
