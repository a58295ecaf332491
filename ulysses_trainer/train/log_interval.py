"""The steps since the last logged row: their loss is logged as one mean, as the HF Trainer does.

The logged `loss` is the token-weighted mean over the logging interval: sum(step loss x its trained tokens) /
their sum, which is the loss of all the interval's tokens together (the step loss is already token-weighted).
A non-finite step (nan_policy skip) stays out of the mean, as HF's logging_nan_inf_filter keeps it out; an
interval of only non-finite steps logs the last one's value. `aux_loss` (MoE) is the mean of the steps'.
The interval is saved in checkpoints, so a resume between two rows logs what the uninterrupted run logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class LogInterval:
    steps: list[tuple[float, int]] = field(default_factory=list)  # (global step loss, trained tokens)
    aux: list[float] = field(default_factory=list)

    def add(self, loss: float, tokens: int, aux_loss: float | None = None) -> None:
        self.steps.append((float(loss), int(tokens)))
        if aux_loss is not None:
            self.aux.append(float(aux_loss))

    def take(self, last_loss: float) -> tuple[float, float | None]:
        """(mean loss, mean aux_loss or None) of the interval, which starts again empty."""
        finite = [(loss, n) for loss, n in self.steps if math.isfinite(loss)]
        tokens = sum(n for _, n in finite)
        if not finite:
            loss = last_loss
        elif len(finite) == 1:  # logging_steps 1: the step's own value, bit for bit
            loss = finite[0][0]
        elif tokens == 0:  # no step trained a token (each contributes 0)
            loss = sum(v for v, _ in finite) / len(finite)
        else:
            loss = sum(v * n for v, n in finite) / tokens
        aux = sum(self.aux) / len(self.aux) if self.aux else None
        self.steps, self.aux = [], []
        return loss, aux

    def state(self) -> dict:
        return {"steps": [list(s) for s in self.steps], "aux": list(self.aux)}

    @classmethod
    def from_state(cls, state: dict | None) -> LogInterval:
        """From a checkpoint's client state (None: a checkpoint from before it was kept, an empty interval)."""
        if not state:
            return cls()
        return cls([(float(v), int(n)) for v, n in state["steps"]], [float(a) for a in state["aux"]])
