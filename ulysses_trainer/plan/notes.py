"""What a plan says besides its numbers: its notes (what it assumed, measured or weighed, in that order) and the
`auto` settings it decided. Torch-free; plan/resolve.py writes both once, when the plan is assembled."""

from __future__ import annotations

from typing import Any

from ..vocabulary.lever_settings import Levers
from .attention_share import AttentionShare
from .fit_search import HOST_HEADROOM
from .inputs import Settings
from .memory_record import MemoryEstimate
from .step_time import StepTime, format_seconds
from .types import Machine, Plan

WORST_CASE = ("packing: attention timed as one document of max_length, the worst case (`ulysses-trainer plan "
              "--dataset_name ...` times it from the data's document lengths)")


def plan_notes(cfg: Any, machine: Machine, s: Settings, *, attention: AttentionShare | None, budget_note: str | None,
               st: StepTime | None, engine_plan: Plan | None, searched: Levers,
               best: dict[bool, tuple[float, MemoryEstimate]], host_gb: float | None = None) -> tuple[str, ...]:
    """The notes of the plan whose chosen settings are `s`: the machine and the data it assumed, the GPU budget it
    measured, what its step time extrapolates, and the optimizer placements it weighed (`best`: the predicted
    step per placement, when the search weighed both; `host_gb`: what the plan holds on each host)."""
    notes = [f"host memory {machine.host_memory_gb:.1f} GiB per host ({machine.host_memory_source})"]
    if host_gb is not None and host_gb > HOST_HEADROOM * machine.host_memory_gb:
        notes.append(f"the plan holds {host_gb:.1f} of {machine.host_memory_gb:.1f} GiB of host memory per host "
                     f"({host_gb / machine.host_memory_gb:.1%}): under {1 - HOST_HEADROOM:.0%} is left for the OS, "
                     f"the data workers and the page cache; give the run a host with more memory or offload fewer "
                     f"layer inputs (activation_offload)")
    if cfg.packing:
        notes.append(attention.describe() + "; memory as a dense row of the same length" if attention else WORST_CASE)
    if cfg.attn_implementation == "auto" and not machine.kernels_known:
        notes.append(f"the kernels installed there are unknown: auto planned as {s.attn_implementation} (pass "
                     f"--attn_implementation flash_attention_4 where it is installed)")
    if cfg.norm_kernel == "auto" and cfg.lean_norm and not machine.kernels_known:
        notes.append(f"norm_kernel auto planned as {s.norm_kernel} (pass --norm_kernel triton where liger-kernel "
                     f"is installed)")
    if cfg.deltanet_kernel == "auto" and s.deltanet_kernel and not machine.kernels_known:
        notes.append(f"deltanet_kernel auto planned as {s.deltanet_kernel} (pass --deltanet_kernel fla where "
                     f"flash-linear-attention is installed)")
    if budget_note:
        notes.append(budget_note)
    if st is not None:
        notes.extend(st.extrapolated)
    if engine_plan is not None:  # the placement was weighed before the engine was built
        notes.extend(n for n in engine_plan.notes if n.startswith("optimizer_offload auto"))
    if searched.optimizer_offload is None and len(best) == 2:
        host = s.levers.optimizer_offload
        notes.append(f"optimizer_offload auto: Adam on the {'host' if host else 'GPU'}, predicted "
                     f"{format_seconds(best[host][0])} s/step against {format_seconds(best[not host][0])} s "
                     f"with Adam on the {'GPU' if host else 'host'}")
    return tuple(notes)


def decided(cfg: Any, fixed: Levers, s: Settings) -> tuple[str, ...]:
    """The settings `auto` left to the plan, each with what it became (`fixed`: the levers the config and the ZeRO
    JSON fixed)."""
    out = []
    if cfg.attn_implementation == "auto":
        out.append(f"attn_implementation {s.attn_implementation}")
    if cfg.norm_kernel == "auto" and s.lean_norm:
        out.append(f"norm_kernel {s.norm_kernel}")
    if cfg.deltanet_kernel == "auto" and s.deltanet_kernel:
        out.append(f"deltanet_kernel {s.deltanet_kernel}")
    for name in ("activation_offload", "keep_attention_outputs", "tiled_mlp", "checkpoint_every", "optimizer_offload"):
        if getattr(fixed, name) is None:
            value = getattr(s.levers, name)
            out.append(f"{name} {str(value).lower() if isinstance(value, bool) else value}")
    return tuple(out)
