"""dataset_num_proc: the work of preparing the rows (rendering, tokenizing) in worker processes, in order.

`ordered_map(fn, chunks, num_proc)` yields fn(chunk) for each chunk in the chunks' order, whatever worker finishes
first, so the rows are the same as in-process. Workers are forked (they inherit the tokenizer and template
without pickling them); at most 2 chunks per worker are in flight, so a large dataset is never held whole.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

_work: Callable[[Any], Any] | None = None  # the function a worker runs (set in each worker by the pool)


def _install(fn: Callable[[Any], Any]) -> None:
    global _work
    _work = fn


def _run(chunk: Any) -> Any:
    return _work(chunk)


def workers_available() -> bool:
    """Forked workers exist on this platform (Linux); elsewhere the work runs in-process."""
    return "fork" in mp.get_all_start_methods()


def ordered_map(fn: Callable[[Any], Any], chunks: Iterable[Any], num_proc: int | None) -> Iterator[Any]:
    """fn over the chunks, in order: in `num_proc` forked worker processes when num_proc > 1, else in-process.
    A worker's exception (a ConfigError naming a bad example) is raised here, at its chunk."""
    if not num_proc or num_proc <= 1 or not workers_available():
        yield from map(fn, chunks)
        return
    it = iter(chunks)
    with mp.get_context("fork").Pool(num_proc, initializer=_install, initargs=(fn,)) as pool:
        pending = deque(pool.apply_async(_run, (c,)) for c in islice(it, 2 * num_proc))
        while pending:
            out = pending.popleft().get()
            for c in islice(it, 1):
                pending.append(pool.apply_async(_run, (c,)))
            yield out


def chunks_of(items: Iterable[Any], size: int, weight: Callable[[Any], int] | None = None,
              max_weight: int = 0) -> Iterator[list[Any]]:
    """Consecutive lists of at most `size` items; with `weight`, a list also ends once its items weigh
    max_weight (a few long conversations make several chunks, so that every worker has one)."""
    if weight is None:
        it = iter(items)
        while chunk := list(islice(it, size)):
            yield chunk
        return
    chunk, total = [], 0
    for item in items:
        chunk.append(item)
        total += weight(item)
        if len(chunk) == size or total >= max_weight:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


def text_size(value: Any) -> int:
    """Characters of the strings in a row (its messages' text, nested)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) for v in value)
    return 0
