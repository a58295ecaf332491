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


def chunks_of(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive lists of `size` items (the last one shorter)."""
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk
