"""Tokenised examples (conversations, prompt-completion pairs) -> rows of exactly max_length tokens.

One example per row (the rest padded), or, with packing, as many whole examples as fit, each
starting at position 0 (the boundary the sharding masks). Pads carry no label and continue the last
example's positions, so causal attention keeps real tokens blind to them. An example longer than
max_length follows max_length_policy: `truncate` keeps its first max_length tokens (TRL's), `drop`
leaves it out; both are counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

POLICIES = ("truncate", "drop")


@dataclass
class RowCounts:
    """What building the rows saw (the `data` command prints it)."""

    examples_read: int = 0
    examples_used: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    without_trained_tokens: int = 0
    sequences: int = 0
    tokens: int = 0  # real tokens in the rows (pads excluded)
    trained_tokens: int = 0  # tokens that are a trained target (an example's first token never is)
    pad_tokens: int = 0
    skipped: dict = field(default_factory=dict)  # reason -> examples

    def as_dict(self) -> dict:
        return dict(vars(self))


def build_rows(examples: Iterable[tuple[np.ndarray, np.ndarray]], max_length: int, packing: bool, policy: str,
               pad_token_id: int, max_rows: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, RowCounts]:
    """(tokens int32 [n*L], trained bool [n*L], positions int32 [n*L] or None without packing,
    real tokens per row int64 [n], counts) from (ids, trained) per example."""
    L = max_length
    counts = RowCounts()
    rows_t: list[np.ndarray] = []
    rows_m: list[np.ndarray] = []
    rows_p: list[np.ndarray] = []
    lengths: list[int] = []
    cur_t: list[np.ndarray] = []
    cur_m: list[np.ndarray] = []
    cur_p: list[np.ndarray] = []
    used = 0

    def close() -> None:
        nonlocal used
        if not cur_t:
            return
        t, m, p = np.concatenate(cur_t), np.concatenate(cur_m), np.concatenate(cur_p)
        n_pad = L - len(t)
        rows_t.append(np.concatenate([t, np.full(n_pad, pad_token_id, np.int32)]))
        rows_m.append(np.concatenate([m, np.zeros(n_pad, bool)]))
        rows_p.append(np.concatenate([p, p[-1] + 1 + np.arange(n_pad, dtype=np.int32)]))
        lengths.append(len(t))
        counts.pad_tokens += n_pad
        cur_t.clear(), cur_m.clear(), cur_p.clear()
        used = 0

    for ids, trained in examples:
        if len(ids) == 0:
            counts.examples_read += 1
            counts.skipped["empty"] = counts.skipped.get("empty", 0) + 1
            continue
        if len(ids) > L and policy == "drop":
            counts.examples_read += 1
            counts.dropped_too_long += 1
            continue
        new_row = not packing or used + min(len(ids), L) > L
        if new_row and max_rows is not None and len(rows_t) + bool(cur_t) >= max_rows:
            break  # the rows asked for are full: this example is not read
        counts.examples_read += 1
        if len(ids) > L:
            counts.truncated += 1
            ids, trained = ids[:L], trained[:L]
        counts.examples_used += 1
        target = trained.copy()
        target[0] = False  # the first token of an example is nobody's target
        counts.trained_tokens += int(target.sum())
        counts.tokens += len(ids)
        if not target.any():
            counts.without_trained_tokens += 1
        if new_row:
            close()
        cur_t.append(ids.astype(np.int32))
        cur_m.append(target)
        cur_p.append(np.arange(len(ids), dtype=np.int32))
        used += len(ids)
    close()
    counts.sequences = len(rows_t)
    cat = (lambda parts, dt: np.concatenate(parts) if parts else np.zeros(0, dt))  # noqa: E731
    positions = cat(rows_p, np.int32) if packing else None
    return cat(rows_t, np.int32), cat(rows_m, bool), positions, np.asarray(lengths, np.int64), counts
