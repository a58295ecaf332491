"""nan_policy: what a step whose global loss or gradient norm is not finite does (stop, or skip the update)."""

from __future__ import annotations

from ..errors import TrainerError


class NonFiniteError(TrainerError, RuntimeError):
    """A non-finite loss or gradient norm that the run cannot skip (nan_policy=stop), or a non-finite
    state about to be saved. The run ends with exit code 1 and the last checkpoint untouched."""


def non_finite_step(step: int, loss: float, grad_norm: float, nan_policy: str, update_discarded: bool) -> str:
    """Raise NonFiniteError unless the step can be skipped; else the warning line to print (rank 0).

    DeepSpeed's ZeRO optimizer discards an update whose gradient norm is not finite (it clears the
    reduced gradients and leaves parameters, optimizer moments and its step count alone; engine
    .skipped_steps counts it). `skip` relies on that and only checks it happened; the schedule then
    moves on with the step counter and the data position (the caller steps the schedule).
    """
    what = f"step {step}: loss {loss}, grad_norm {grad_norm}"
    if nan_policy == "stop":
        raise NonFiniteError(f"{what}; stopping without saving (nan_policy=stop; the last checkpoint is "
                             f"intact). Lower learning_rate, check the data, or set nan_policy skip")
    if not update_discarded:
        raise NonFiniteError(f"{what}, but DeepSpeed applied the update (it discards only updates whose "
                             f"gradient norm is not finite), so it cannot be skipped; stopping without "
                             f"saving")
    return (f"[ulysses_trainer] warning: {what}; update skipped (nan_policy=skip): parameters and "
            f"optimizer state kept as they were")
