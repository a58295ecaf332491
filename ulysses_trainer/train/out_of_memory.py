"""Out of GPU memory while the model or the engine is built, in a step or in the final export: one line saying
where (step, phase, layer), what the device had and what the plan predicted, and the `ulysses-trainer plan`
command for settings that fit.

Where: the trainer names each phase as it enters it (building the model, building the engine, loading the
checkpoint, forward, backward, optimizer step, evaluation, checkpoint save, final export); a forward pre-hook
on each decoder layer names the layer in forward, and in backward the checkpointer names the layer being
recomputed, then that layer's own backward.

A rank that ran out enters no collective after it: its peers may be waiting inside the step's all-to-alls or
ZeRO-3 gathers, where any other collective would hang. It reports and exits 1 (when every rank runs out alike,
rank 0's line is the one shown, as for any error every rank sees); the launcher ends the peers. Nothing is
saved: the last checkpoint stays as it was.

Test seam (docs/testing.md): `inject`, when a test sets it, is called with the Where at every phase and layer
entry and may raise torch.OutOfMemoryError there, as a real allocation would.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

# the levers a plan search decides when `auto`; a pinned one is what `ulysses-trainer plan` is told to search
from ..lever_settings import AUTO_LEVERS as AUTO_LEVERS
from ..lever_settings import decode_levers

GIB = 2**30

inject: Callable[[Where], None] | None = None  # the test seam (None outside tests)



class OutOfGpuMemory(RuntimeError):
    """torch.OutOfMemoryError turned into the run's one line (exit 1, the last checkpoint intact). The command
    line appends the `ulysses-trainer plan` command (it has the user's arguments)."""

    def __init__(self, message: str, pinned: tuple[str, ...]) -> None:
        super().__init__(message)
        self.pinned = pinned  # the levers the config fixed (not auto): searched by the suggested plan command


@dataclass
class Where:
    """Where the run is: the optimizer step being trained (1-based), the phase, the decoder layer if known."""

    step: int = 0
    phase: str = "setup"
    layer: int | None = None

    def enter(self, phase: str, step: int | None = None) -> None:
        self.phase, self.layer = phase, None
        if step is not None:
            self.step = step
        _check(self)

    def describe(self) -> str:
        return self.phase if self.layer is None else f"{self.phase}, layer {self.layer}"

    def watch(self, layers: Iterable[nn.Module], checkpointer=None) -> None:
        """Hooks on the decoder layers name each layer as it runs forward; the checkpointer (levers/recompute.py)
        names the layer whose recompute or backward runs (the module hooks stay outside the checkpoint)."""
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._pre_hook(i))
            layer.register_forward_hook(self._post_hook)
        if checkpointer is not None:
            checkpointer.observer = self.reached

    def reached(self, layer: int, phase: str) -> None:
        self.phase, self.layer = phase, layer
        _check(self)

    def _pre_hook(self, i: int):
        def hook(module, args):
            self.layer = i
            _check(self)
        return hook

    def _post_hook(self, module, args, output) -> None:
        self.layer = None  # between layers (the loss head after the last)


def _check(where: Where) -> None:
    if inject is not None:
        inject(where)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of the (possibly adapter-wrapped) causal LM: the ModuleList at `...model.layers`."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and (name == "model.layers" or name.endswith(".model.layers")):
            return list(module)
    return []


def gpu_numbers(device: torch.device) -> tuple[float | None, float | None]:
    """(the device's total memory, the most torch allocated so far) in GiB; (None, None) on CPU. No collective."""
    if device.type != "cuda":
        return None, None
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    return total, torch.cuda.max_memory_allocated(device) / GIB


def oom_message(where: Where, device: torch.device, predicted_peak_gb: float, predicted_required_gb: float) -> str:
    """The line, without the plan command: where, what the device had, what the plan predicted."""
    if where.phase == "final export":
        at = f"in the final export after step {where.step}"
    elif where.step == 0:  # the model, the engine or the resumed checkpoint, before the first step
        at = f"before step 1 ({where.describe()})"
    else:
        at = f"at step {where.step} ({where.describe()})"
    total, peak = gpu_numbers(device)
    plan = (f"the plan predicted {predicted_peak_gb:.1f} GiB peak allocated ({predicted_required_gb:.1f} GiB with "
            f"allocator slack and CUDA context)")
    if total is None:
        return (f"out of memory {at} on CPU: no device memory to report; {plan} per rank, "
                f"in host memory here")
    return (f"out of GPU memory {at}: the device had {total:.1f} GiB and torch had "
            f"allocated up to {peak:.1f} GiB; {plan}")


def pinned_levers(cfg) -> tuple[str, ...]:
    """The plan-searched levers the config fixed (not auto); gradient_checkpointing false counts as pinned."""
    return decode_levers(cfg).pinned


def plan_command(argv: list[str], pinned: Iterable[str], world_size: int) -> str:
    """`ulysses-trainer plan` with the user's arguments minus the pinned levers' flags; a lever pinned by the
    recipe instead is set back to its default (auto; gradient_checkpointing true) on the command line."""
    pinned = tuple(pinned)
    drop = {f"--{name}" for name in pinned} | {"--local_rank"}
    kept, given, skip = [], set(), False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            given.add(name[2:])
            skip = "=" not in arg
            continue
        kept.append(arg)
    # pinned in a recipe (not on the command line): set back explicitly, or the recipe would pin it again
    reset = [a for n in pinned if n not in given
             for a in (f"--{n}", "true" if n == "gradient_checkpointing" else "auto")]
    return shlex.join(["ulysses-trainer", "plan", "--gpus", str(world_size), *kept, *reset])
