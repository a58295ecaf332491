"""Attention outputs kept from a checkpointed layer's first forward, so its recompute skips the kernel.

Why: with activation checkpointing every layer's forward runs twice, and at long lengths attention is
most of a layer (at 256K tokens of Qwen3-4B the second attention forward is ~40 of ~200 s per step).
The recompute needs q, k, v again (for the kernel's backward) but not the kernel's forward: its output
and log-sum-exp are the same numbers, so they are kept here between the two, per layer, and the
recompute reuses them. Exact by construction: the backward sees the very tensors a recompute would
have produced (deterministic kernels give them bitwise anyway).

Cost: per kept layer, the output [b, s, h_local, d] in the training dtype plus an fp32 log-sum-exp per
head and token, held from the layer's forward to its backward. Which layers keep them is a set chosen
by the plan (`keep_attention_outputs`, plan/resolve.py; its bytes: plan/layer_terms.py).

Record and replay are told apart by grad mode: the checkpoint's first forward runs without grad
(record), its recompute with grad (replay). Only modules in training mode record, so evaluation
forwards keep nothing; one entry per layer at most, so a forward without a backward cannot pile up.
"""

from __future__ import annotations

from collections.abc import Iterable


class AttentionStash:
    """Per-layer (out, lse, aux) of the kernel, from record to replay."""

    def __init__(self, layers: Iterable[int] = ()):
        self.layers: set[int] = set(layers)
        self._saved: dict[int, tuple] = {}
        self.records = 0  # kernel outputs kept
        self.replays = 0  # recomputes that reused them (kernel forwards skipped)

    def set_layers(self, layers: Iterable[int]) -> None:
        self.layers = set(layers)
        self._saved.clear()

    def wants(self, layer: int | None, training: bool) -> bool:
        return layer is not None and training and layer in self.layers

    def take(self, layer: int) -> tuple | None:
        """For a forward with grad: the kept outputs (removed), or None."""
        found = self._saved.pop(layer, None)
        if found is not None:
            self.replays += 1
        return found

    def put(self, layer: int, saved: tuple) -> None:
        self._saved[layer] = saved  # replaces a stale entry: one per layer
        self.records += 1

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for v in self._saved.values() for t in v[:2])

