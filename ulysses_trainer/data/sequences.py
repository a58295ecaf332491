"""The rows a run trains on: max_length tokens each, with their positions, trained masks and lengths, as the row
builder makes them (rows.py, from the sources of documents.py) and the trainer, the data order and the plan read
them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..parallel.sharding import IGNORE_INDEX
from .accounting import DataCounts
from .formats import LANGUAGE_MODELING


@dataclass
class SequenceDataset:
    """Rows of exactly max_length tokens. Indexing gives {"input_ids", "position_ids", "labels"}:
    LongTensor[L] (labels: the token where it is trained, IGNORE_INDEX elsewhere; not yet shifted), and
    "real_tokens": int, the row's tokens before its padding."""

    tokens: np.ndarray  # int32 [n_rows * L]
    positions: np.ndarray | None  # int32 [n_rows * L] with packing, else None (0..L-1 per row)
    max_length: int
    source: str
    documents_used: int
    documents_total: int | None  # None when the source's size is unknown (synthetic: endless)
    fraction_read: float | None = None  # of the source's text bytes, when tokenizing stopped early
    trained: np.ndarray | None = None  # bool [n_rows * L]: token is a trained target; None = every token
    lengths: np.ndarray | None = None  # real (non-pad) tokens per row; None = every row is full
    kind: str = LANGUAGE_MODELING
    pad_from: int | None = None  # index into tokens where the last row's padding starts (pad_last_sequence)
    counts: DataCounts = field(default_factory=DataCounts)  # what reading and building saw

    def real_tokens(self, i: int) -> int:
        """Tokens of row i that are not padding."""
        i %= len(self)
        if self.lengths is not None:
            return int(self.lengths[i])
        if self.pad_from is not None:  # the padded last row (pad_last_sequence)
            return max(0, min(self.max_length, self.pad_from - i * self.max_length))
        return self.max_length

    def __len__(self) -> int:
        return len(self.tokens) // self.max_length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        sl = slice(i * self.max_length, (i + 1) * self.max_length)
        ids = torch.from_numpy(self.tokens[sl].astype(np.int64))
        pos = torch.arange(self.max_length) if self.positions is None \
            else torch.from_numpy(self.positions[sl].astype(np.int64))
        labels = ids if self.trained is None else \
            torch.where(torch.from_numpy(self.trained[sl]), ids, IGNORE_INDEX)
        if self.pad_from is not None and sl.stop > self.pad_from:  # the padded last row: pads are not trained
            labels = labels.clone()
            labels[max(0, self.pad_from - sl.start):] = IGNORE_INDEX
        return {"input_ids": ids, "position_ids": pos, "labels": labels, "real_tokens": self.real_tokens(i)}

    @property
    def epoch_sequences(self) -> float:
        """Rows in one full pass over the source (estimated from the text read when stopped early: by
        bytes, since documents differ in length, else by document count)."""
        if self.fraction_read:
            return len(self) / self.fraction_read
        if self.documents_total and self.documents_used < self.documents_total:
            return len(self) * self.documents_total / self.documents_used
        return float(len(self))
