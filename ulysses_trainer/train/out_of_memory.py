"""Running out of memory: a plan that would (refused before any heavy work: check_gpu_fits, check_host_fits), and
a run that does. Out of GPU memory while the model or the engine is built, in a step or in the final export: one
line saying where (step, phase, layer), what the device had and what the plan predicted, and the
`ulysses-trainer plan` command for settings that fit.

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

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..config import TrainConfig
from ..errors import ConfigError, TrainerError
from ..plan.memory import UNDER_PREDICTION
from ..plan.types import Machine, Plan

# the levers a plan search decides when `auto`; a pinned one is what `ulysses-trainer plan` is told to search
from ..vocabulary.lever_settings import AUTO_LEVERS, decode_levers
from ..vocabulary.names import GIB

inject: Callable[[Where], None] | None = None  # the test seam (None outside tests)



class OutOfGpuMemory(TrainerError, RuntimeError):
    """torch.OutOfMemoryError turned into the run's one line (exit 1, the last checkpoint intact). The command
    line appends the `ulysses-trainer plan` command (it has the user's arguments)."""

    end_group = False  # the peers may be inside the step: the launcher ends them once this rank exits

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


def check_host_fits(resolved: Plan, machine: Machine, device: str, ranks_here: int | None = None) -> None:
    """On CPU the model, activations and optimizer live in host RAM: refuse a plan whose peak exceeds it
    (a run that would otherwise climb into the OOM killer), with the plan's numbers and what to change.
    ranks_here: the ranks this machine runs (default: every rank of a host; a rehearsal runs one)."""
    if device != "cpu":
        return
    ranks = machine.ranks_per_node if ranks_here is None else ranks_here
    p = resolved.predicted
    host_terms = p.host_gb * ranks / machine.ranks_per_node  # the plan's host RAM is per host
    need = p.peak_gpu_gb * ranks + host_terms
    have = p.host_budget_gb
    if need > have:
        raise ConfigError(f"the plan needs {need:.1f} GiB of host memory on this CPU machine ({ranks} rank(s) x "
                          f"{p.peak_gpu_gb:.1f} GiB peak + {host_terms:.1f} GiB "
                          f"host terms) but it has {have:.1f} GiB; lower max_length (now {resolved.run.max_length}) "
                          f"or use a smaller model (now {resolved.model}), or run on GPUs; set host_memory_gb if "
                          f"the detected size is wrong")


def _lever_values(plan: Plan, names: tuple[str, ...]) -> str:
    d = plan.to_dict()
    values = {**{n: d[n] for n in AUTO_LEVERS}, "gradient_checkpointing": plan.levers.gradient_checkpointing}
    return " ".join(f"--{n} {str(values[n]).lower()}" for n in names)


def check_gpu_fits(resolved: Plan, cfg: TrainConfig, auto_plan) -> None:
    """Refuse (ConfigError) a plan whose GPU need exceeds the device by more than the memory model's worst measured
    under-prediction (UNDER_PREDICTION), unless allow_over_plan: it would run out of GPU memory. The line names
    the values `auto` gives the pinned levers where that fits. auto_plan(cfg): the plan of another config."""
    p = resolved.predicted
    have, need = p.gpu_budget_gb, p.gpu_required_gb
    if have is None or cfg.allow_over_plan or need <= have * (1 + UNDER_PREDICTION):
        return
    pinned = pinned_levers(cfg)
    head = (f"the plan needs {need:.1f} GiB per GPU ({p.peak_gpu_gb:.1f} GiB peak allocated, plus "
            f"allocator slack and CUDA context) but the GPU has {have:.1f} GiB: {need / have - 1:.0%} over, beyond the "
            f"memory model's worst measured under-prediction ({UNDER_PREDICTION:.1%}), so the run would stop out of "
            f"GPU memory")
    override = "or set allow_over_plan true to start anyway"
    if pinned:
        unpinned = replace(cfg, gradient_checkpointing=True, **{n: "auto" for n in pinned if n in AUTO_LEVERS})
        auto = auto_plan(unpinned)
        freed = ", ".join("gradient_checkpointing true" if n == "gradient_checkpointing" else f"{n} auto"
                          for n in pinned)
        if auto.predicted.fits:
            raise ConfigError(f"{head}; with {freed} it fits ({auto.predicted.gpu_required_gb:.1f} GiB): "
                              f"{_lever_values(auto, pinned)}; {override}")
        raise ConfigError(f"{head}; even with {freed} it needs {auto.predicted.gpu_required_gb:.1f} GiB: shorten "
                          f"max_length (now {cfg.max_length}) or add GPUs (sp); {override}")
    raise ConfigError(f"{head}; every lever is auto already: shorten max_length (now {cfg.max_length}) or add GPUs "
                      f"(sp); {override}")
