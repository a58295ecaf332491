"""The one row builder: tokenised examples (conversations, prompt-completion pairs, text documents) -> rows of
exactly max_length tokens, by a strategy and a tail policy given explicitly (documents.py picks them from the
settings).

- `joined` (text documents: packing false, or packing_strategy wrapped): documents (each + eos) end to end, cut
  every max_length tokens; every token is trained (trained None: without packing the labels run across
  documents, with packing the positions restart at each document and row start and the sharding masks the
  boundary). The tokens after the last full row follow the tail policy: `drop`, or `pad` (pad_last_sequence: one
  more row, its pads masked through pad_from). The counts hold whole documents read (tokens included).

Whole examples (each example's first token untrained, every row padded to L; text documents packed whole too):
one example per row (the rest padded; packing false), or, with packing, several per row by packing_strategy:
- `bfd` (best-fit decreasing, TRL's default): whole examples, longest first, each into the fullest row
  it still fits; the rows come out nearly full whatever the order of the lengths. Where that leaves more rows
  than the lower bound (the tokens over max_length, the examples over half of it), a bounded exact search
  (fewest_bins) looks for a packing into fewer rows: every pad a row fewer saves is one no kernel runs.
- `next_fit`: whole examples in their order; a new row when the next does not fit.
- `wrapped` (TRL's other value): examples joined end to end and cut at max_length; an example cut by a
  row edge goes on as a fresh segment of the next row (the only strategy that splits an example).
Each example (segment) starts at position 0, the boundary the sharding masks. Pads carry no label and
continue the last example's positions, so causal attention keeps real tokens blind to them. An example
longer than max_length follows max_length_policy (not under `wrapped`, which splits it): `truncate`
keeps its first max_length tokens (TRL's), `drop` leaves it out; both are counted.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from .accounting import DROPPED_TOO_LONG, DataCounts

POLICIES = ("truncate", "drop")
STRATEGIES = ("bfd", "wrapped", "next_fit")  # packing_strategy's values
LAYOUTS = (*STRATEGIES, "joined")  # the builder's: the packing strategies and text joined and cut
TAILS = ("pad", "drop")  # joined text's tokens after the last full row; every other strategy pads its rows


@dataclass
class Rows:
    """What build_rows made: rows of exactly L tokens."""

    tokens: np.ndarray  # int32 [n*L]
    positions: np.ndarray | None  # int32 [n*L]; None: 0..L-1 in every row (packing false)
    counts: DataCounts  # what building them saw (with what the source skipped)
    trained: np.ndarray | None = None  # bool [n*L]: the token is a trained target; None: every token
    lengths: np.ndarray | None = None  # int64 [n]: real (non-pad) tokens per row; None: every row is full
    pad_from: int | None = None  # index into tokens where the padded last row's pads start (pad_last_sequence)
    text_bytes: int = 0  # UTF-8 bytes of the text documents used (joined and cut)


Example = tuple[np.ndarray, np.ndarray]  # (token ids, trained: bool per token)


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of indices into lengths, longest first) of total <= capacity: each length, longest first
    (ties in input order), goes to the bin with the least room that still holds it (ties: the older bin)."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"a length over the capacity {capacity}: truncate or drop it first")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(room, (n, -1))
        if k == len(room):
            bins.append([i])
            bisect.insort(room, (capacity - n, len(bins) - 1))
        else:
            left, b = room.pop(k)
            bins[b].append(i)
            bisect.insort(room, (left - n, b))
    return bins


# the exact search's budget: placements tried per bin count (under a second of Python)
SEARCH_NODES = 50_000
SEARCH_MAX_ITEMS = 400  # more examples than this: bfd's rows are kept (their fill is then near 100%)


def lower_bound(lengths: list[int], capacity: int) -> int:
    """Fewest bins any packing needs: the total over the capacity, and one each for the lengths over half of it."""
    if not lengths:
        return 0
    return max(-(-sum(lengths) // capacity), sum(2 * n > capacity for n in lengths))


def _pack_into(lengths: list[int], capacity: int, k: int, budget: int) -> list[list[int]] | None:
    """k bins holding every length (indices, longest first), found by depth-first search, or None (none exist or
    the budget ran out). Symmetry cut: a length tries each distinct room once."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rooms = [capacity] * k
    bins: list[list[int]] = [[] for _ in range(k)]
    suffix = [0] * (len(order) + 1)
    for j in range(len(order) - 1, -1, -1):
        suffix[j] = suffix[j + 1] + lengths[order[j]]
    nodes = [0]

    def place(j: int) -> bool:
        if j == len(order):
            return True
        nodes[0] += 1
        if nodes[0] > budget or suffix[j] > sum(rooms):
            return False
        i, tried = order[j], set()
        for b in range(k):
            if rooms[b] >= lengths[i] and rooms[b] not in tried:
                tried.add(rooms[b])
                rooms[b] -= lengths[i]
                bins[b].append(i)
                if place(j + 1):
                    return True
                bins[b].pop()
                rooms[b] += lengths[i]
        return False

    return bins if place(0) else None


def fewest_bins(lengths: list[int], capacity: int, bins: list[list[int]]) -> list[list[int]]:
    """bins (best_fit_decreasing's), or a packing into fewer found by a bounded exact search while more than the
    lower bound are used."""
    bound = lower_bound(lengths, capacity)
    if len(lengths) > SEARCH_MAX_ITEMS:
        return bins
    while len(bins) > bound:
        fewer = _pack_into(lengths, capacity, len(bins) - 1, SEARCH_NODES)
        if fewer is None:
            break
        bins = [b for b in fewer if b]
    return bins


def padding_report(real: list[int], L: int, lengths: list[int], packing: bool, strategy: str) -> tuple[int, str]:
    """(rows with more than 10% of max_length in pads, why they could not be fuller); lengths: the examples'."""
    heavy = sum(L - n > L // 10 for n in real)
    if not heavy:
        return 0, ""
    if not packing:
        return heavy, "one example per sequence (packing false): packing: true puts several in one"
    if strategy == "next_fit":
        return heavy, ("next_fit keeps the examples' order and starts a sequence when the next does not fit; "
                       "bfd packs fuller")
    if strategy == "wrapped":
        return heavy, "the last sequence holds the end of the data"
    bound = lower_bound(lengths, L)
    if len(real) > bound:
        searched = f"a search of {SEARCH_NODES} placements" if len(lengths) <= SEARCH_MAX_ITEMS else \
            f"no search over {SEARCH_MAX_ITEMS} examples"
        return heavy, (f"{len(real)} sequences where at least {bound} are needed: no packing into fewer was found "
                       f"(best fit, then {searched})")
    total, over_half = sum(lengths), sum(2 * n > L for n in lengths)
    if over_half == bound and over_half * L - total >= L // 10:
        return heavy, (f"{over_half} examples are over half of max_length {L}, so each needs a sequence of its own; "
                       f"the shorter ones do not fill the rest (a session is never split: packing_strategy wrapped "
                       f"splits them)")
    return heavy, (f"the fewest sequences that hold every example whole: {total} tokens need at least {bound} of {L} "
                   f"({total / L:.2f} sequences' worth), so {bound * L - total} pads are left whatever the packing")


class _Rows:
    """Rows being written: whole rows of L tokens with their positions and (masks) trained mask, and the open row
    that cutting fills."""

    def __init__(self, L: int, pad_token_id: int, counts: DataCounts, masks: bool = True,
                 positions: bool = True) -> None:
        self.L, self.pad, self.counts, self.masks, self.positions = L, pad_token_id, counts, masks, positions
        self.t: list[np.ndarray] = []
        self.m: list[np.ndarray] = []
        self.p: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.doc_lengths: list[int] = []  # every segment's length, row by row
        self.open: list[Example] = []  # the segments cut into the row not yet full
        self.used = 0  # their tokens

    def add(self, parts: list[Example]) -> None:
        """One row of these segments (each starting at position 0), padded to L."""
        t = np.concatenate([ids.astype(np.int32) for ids, _ in parts])
        n_pad = self.L - len(t)
        self.t.append(np.concatenate([t, np.full(n_pad, self.pad, np.int32)]))
        if self.masks:
            self.m.append(np.concatenate([np.concatenate([tr for _, tr in parts]), np.zeros(n_pad, bool)]))
        if self.positions:  # (not kept without packing: 0..L-1 in every row)
            p = np.concatenate([np.arange(len(ids), dtype=np.int32) for ids, _ in parts])
            self.p.append(np.concatenate([p, p[-1] + 1 + np.arange(n_pad, dtype=np.int32)]))
        self.lengths.append(len(t))
        self.doc_lengths += [len(ids) for ids, _ in parts]
        self.counts.pad_tokens += n_pad
        self.counts.sequences += 1

    def full(self, max_rows: int | None) -> bool:
        return max_rows is not None and len(self) >= max_rows

    def cut(self, ids: np.ndarray, trained: np.ndarray, max_rows: int | None) -> tuple[int, int]:
        """An example end to end into the open row, a new row at every L tokens (a piece cut by a row edge goes on
        as a fresh segment, position 0), until max_rows rows exist; (tokens placed, trained targets placed)."""
        placed = targets = start = 0
        while start < len(ids) and not self.full(max_rows):
            n = min(len(ids) - start, self.L - self.used)
            target = _target(trained[start:start + n])
            self.open.append((ids[start:start + n], target))
            placed, targets = placed + n, targets + int(target.sum())
            self.used, start = self.used + n, start + n
            if self.used == self.L:
                self.close()
        return placed, targets

    def close(self) -> None:
        """The open row, padded to L."""
        self.add(self.open)
        self.open, self.used = [], 0

    def __len__(self) -> int:
        return len(self.t)


def _target(trained: np.ndarray) -> np.ndarray:
    target = trained.copy()
    target[0] = False  # the first token of an example (segment) is nobody's target
    return target


def _use(counts: DataCounts, target: np.ndarray) -> None:
    counts.use(len(target))
    counts.trained_tokens += int(target.sum())
    if not target.any():
        counts.without_trained_tokens += 1


def _admitted(examples: Iterable[Example], L: int, policy: str, counts: DataCounts, truncate: bool
              ) -> Iterator[Example]:
    """The examples that go into rows (empty ones and, under `drop`, too long ones counted and left out);
    an example is taken when it is yielded."""
    for ids, trained in examples:
        if _left_out(ids, L, policy if truncate else "truncate", counts):
            continue
        counts.take()
        if len(ids) > L and truncate:
            ids, trained = _truncated(ids, trained, L, counts)
        yield ids, trained


def _left_out(ids: np.ndarray, L: int, policy: str, counts: DataCounts) -> bool:
    """Whether an example stays out of the rows (empty, or over L under `drop`), counted as skipped."""
    if len(ids) == 0:
        counts.skip("empty")
        return True
    if len(ids) > L and policy == "drop":
        counts.skip(DROPPED_TOO_LONG)
        counts.dropped_too_long += 1
        return True
    return False


def _truncated(ids: np.ndarray, trained: np.ndarray, L: int, counts: DataCounts) -> Example:
    """An example's first L tokens, counted (and whether the cut took every token it trains)."""
    counts.truncated += 1
    counts.trained_cut_off += bool(_target(trained).any() and not _target(trained[:L]).any())
    return ids[:L], trained[:L]


def build_rows(examples: Iterable[Example], max_length: int, packing: bool, policy: str,
               pad_token_id: int, max_rows: int | None = None, strategy: str = "bfd",
               counts: DataCounts | None = None, tail: str = "pad") -> Rows:
    """Rows from (ids, trained) per example (positions None without packing: 0..L-1 in every row). strategy: a
    packing_strategy (packing false: one example per row) or `joined` (text documents cut, packed or not); tail:
    what joined text's tokens after the last full row get (the other strategies pad every row). max_rows stops
    reading once that many rows exist (bfd, joined: once the examples read fill them). counts: where the source
    already counted what it skipped (a fresh one if None)."""
    if strategy not in LAYOUTS:
        raise ValueError(f"packing strategy must be one of {STRATEGIES}, got {strategy!r}")
    if tail not in TAILS or (tail != "pad" and strategy != "joined"):
        raise ValueError(f"tail {tail!r}: one of {TAILS}, and only joined text drops it (every other row is padded)")
    L = max_length
    counts = counts if counts is not None else DataCounts()
    whole = strategy != "joined"
    counts.whole_examples, counts.max_length = whole, L
    rows = _Rows(L, pad_token_id, counts, masks=whole, positions=packing)
    pad_from = None
    if not whole:
        pad_from = _joined(_admitted(examples, L, policy, counts, truncate=False), rows, max_rows, tail)
    elif packing and strategy == "bfd":
        _bfd(_admitted(examples, L, policy, counts, truncate=True), rows, max_rows)
    elif packing and strategy == "wrapped":
        _wrapped(_admitted(examples, L, policy, counts, truncate=False), rows, max_rows)
    else:
        _in_order(examples, rows, policy, packing, max_rows)
    if whole:
        counts.rows_over_10pct_padding, counts.padding_why = padding_report(
            rows.lengths, L, rows.doc_lengths, packing, strategy)
    cat = (lambda parts, dt: np.concatenate(parts) if parts else np.zeros(0, dt))  # noqa: E731
    return Rows(cat(rows.t, np.int32), cat(rows.p, np.int32) if packing else None, counts,
                trained=cat(rows.m, bool) if whole else None,
                lengths=np.asarray(rows.lengths, np.int64) if whole else None, pad_from=pad_from)


def _in_order(examples: Iterable[Example], rows: _Rows, policy: str, packing: bool, max_rows: int | None) -> None:
    """One example per row, or (next_fit) as many as fit in their order."""
    L, counts = rows.L, rows.counts
    cur: list[Example] = []
    used = 0
    for ids, trained in examples:
        if _left_out(ids, L, policy, counts):
            continue
        new_row = not packing or used + min(len(ids), L) > L
        if new_row and max_rows is not None and len(rows) + bool(cur) >= max_rows:
            break  # the rows asked for are full: this example is not read
        counts.take()
        if len(ids) > L:
            ids, trained = _truncated(ids, trained, L, counts)
        target = _target(trained)
        _use(counts, target)
        if new_row and cur:
            rows.add(cur)
            cur, used = [], 0
        cur.append((ids, target))
        used += len(ids)
    if cur:
        rows.add(cur)


def _bfd(examples: Iterator[Example], rows: _Rows, max_rows: int | None) -> None:
    """Best-fit decreasing over the examples read: all of them, or (max_rows) until they fill max_rows rows;
    the rows beyond max_rows are left out with their examples (counted as not read)."""
    L, counts = rows.L, rows.counts
    held: list[Example] = []
    total = 0
    for ex in examples:
        held.append(ex)
        total += len(ex[0])
        if max_rows is not None and total >= max_rows * L:
            break  # enough tokens for max_rows full rows: bfd makes at least that many
    lengths = [len(ids) for ids, _ in held]
    bins = fewest_bins(lengths, L, best_fit_decreasing(lengths, L))
    if max_rows is not None and len(bins) > max_rows:
        counts.taken -= sum(len(b) for b in bins[max_rows:])  # (not read)
        bins = bins[:max_rows]
    for b in bins:
        parts = [(held[i][0], _target(held[i][1])) for i in b]
        for _, target in parts:
            _use(counts, target)
        rows.add(parts)


def _wrapped(examples: Iterator[Example], rows: _Rows, max_rows: int | None) -> None:
    """Examples joined and cut at L: a cut example continues as a new segment (position 0) of the next row;
    the last row is padded. Tokens and trained tokens count what the rows hold."""
    L, counts = rows.L, rows.counts
    for ids, trained in examples:
        if rows.full(max_rows):
            counts.taken -= 1  # pulled, but the rows asked for are full: not read
            break
        counts.documents_used += 1
        counts.without_trained_tokens += not _target(trained).any()
        counts.split += len(ids) > L - rows.used
        placed, targets = rows.cut(ids, trained, max_rows)
        counts.tokens += placed
        counts.trained_tokens += targets
    if rows.open and not rows.full(max_rows):
        rows.close()


def _joined(examples: Iterator[Example], rows: _Rows, max_rows: int | None, tail: str) -> int | None:
    """Text documents cut at L as `wrapped` cuts examples, reading stopped once max_rows rows are full (the last
    document is read whole: the counts hold whole documents); the tokens after the last full row are dropped or
    (tail `pad`) padded into one more row. Returns where that row's pads start (pad_from), else None."""
    L, counts = rows.L, rows.counts
    need = None if max_rows is None else max_rows * L
    seen = 0
    for ids, trained in examples:
        counts.use(len(ids))
        seen += len(ids)
        rows.cut(ids, trained, max_rows)
        if need is not None and seen >= need:
            break  # (the next document is not pulled from the source, which counts what it reads)
    stopped = rows.full(max_rows)
    left = 0 if stopped else rows.used  # the tail: tokens after the last full row
    if tail == "pad" and left:
        pad_from = len(rows) * L + left
        rows.close()
        counts.finish(len(rows), L, left, "padded", L - left)
        return pad_from
    counts.finish(len(rows), L, left, "not read" if stopped else ("dropped" if left else "none"))
    return None
