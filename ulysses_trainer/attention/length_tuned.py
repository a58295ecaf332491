"""Kernels whose autotuning is keyed by the token count: they register a tuner when they first run, and a warm-up
shorter than the run (`rehearse --warmup_length`) calls `tune_for_tokens` so the timed step runs kernels tuned for
its own length, as every step of a real run after its first does.

Why: fla buckets its in-kernel q/k L2 norm's autotuning by rows (fla.modules.norm.l2norm: NB = cdiv(rows, 65,536)
is a key and a constexpr), so an 8,192-token warm-up tunes NB = 1 and the first 1M step compiles and benchmarks 25
configurations of the forward and 25 of the backward: 8.9 s in the first DeltaNet layer's forward and 10.5 s in
its backward on an H100 with an empty Triton cache (benchmarks/results/rehearsal/stall_35b_l4_h100), once per
machine and length (fla keeps the results on disk).
"""

from __future__ import annotations

from collections.abc import Callable

_TUNERS: dict[tuple, Callable[[int], None]] = {}  # (kernel, its shape but the tokens) -> tune(tokens)


def register(key: tuple, tune: Callable[[int], None]) -> None:
    """A kernel that ran with the shape `key` (its name first; everything but the token count) is tuned for another
    token count by `tune(tokens)`."""
    _TUNERS.setdefault(key, tune)


def tune_for_tokens(tokens: int) -> list[str]:
    """Run every registered tuner at `tokens` (a row's tokens times the micro-batch's rows, as the kernels see them
    after Ulysses' all-to-all); the kernels' names, one per shape tuned."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    for tune in _TUNERS.values():
        tune(tokens)
    return [key[0] for key in _TUNERS]


def clear() -> None:
    """Forget every tuner (a test's own model, or a run that changes device)."""
    _TUNERS.clear()
