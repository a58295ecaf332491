"""The steps since the last logged row: their loss is logged as one mean, as the HF Trainer (and TRL) log it.

The logged `loss` is the plain mean of the interval's step losses: sum(step loss) / steps, what transformers'
Trainer logs (the per-step losses summed, divided by the steps since the last log). Each step's loss is the
token-weighted mean over that step's trained tokens (all ranks, all micro-steps). Where the interval spans more
than one step, `token_weighted_loss` is the loss of all its tokens together: sum(step loss x its trained tokens)
/ their sum. A non-finite step (nan_policy skip) stays out of both means, as HF's logging_nan_inf_filter keeps it
out; an interval of only non-finite steps logs the last one's value. `aux_loss` (MoE) is the mean of the steps'.
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

    def take(self, last_loss: float) -> tuple[float, float | None, float | None]:
        """(mean of the step losses, their token-weighted mean or None for a one-step interval, mean aux_loss or
        None) of the interval, which starts again empty."""
        spanned = len(self.steps) > 1
        finite = [(loss, n) for loss, n in self.steps if math.isfinite(loss)]
        tokens = sum(n for _, n in finite)
        if not finite:
            loss = weighted = last_loss
        elif len(finite) == 1:  # logging_steps 1: the step's own value, bit for bit
            loss = weighted = finite[0][0]
        else:
            loss = sum(v for v, _ in finite) / len(finite)
            weighted = sum(v * n for v, n in finite) / tokens if tokens else loss  # no token trained: each is 0
        aux = sum(self.aux) / len(self.aux) if self.aux else None
        self.steps, self.aux = [], []
        return loss, weighted if spanned else None, aux

    def state(self) -> dict:
        return {"steps": [list(s) for s in self.steps], "aux": list(self.aux)}

    @classmethod
    def from_state(cls, state: dict | None) -> LogInterval:
        """From a checkpoint's client state (None: a checkpoint from before it was kept, an empty interval)."""
        if not state:
            return cls()
        return cls([(float(v), int(n)) for v, n in state["steps"]], [float(a) for a in state["aux"]])
