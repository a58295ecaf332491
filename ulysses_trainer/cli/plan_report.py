"""What `ulysses-trainer plan` prints (cli/plan.py decides): the memory table, the plan's text report with its step
floor and the largest length that fits, and the JSON's pieces."""

from __future__ import annotations

from typing import Any

from ..plan.inputs import Settings, local_tokens
from ..plan.longest_fit import Choice
from ..plan.memory_record import MemoryEstimate
from ..plan.types import Machine, Plan
from ..vocabulary.names import GIB

_JSON_KEYS = {"gpus_per_node": "gpus_per_host"}  # `plan --json` keeps the key it has always written


def hardware_json(machine: Machine) -> dict[str, Any]:
    return {**{_JSON_KEYS.get(k, k): v for k, v in machine.__dict__.items()}, "kernels": list(machine.kernels)}


def _gb(b: int) -> str:
    return f"{b / GIB:8.2f}" if b else f"{'-':>8}"


def format_estimate(e: MemoryEstimate) -> str:
    """The term table: GPU GiB (per GPU) and host GiB (per rank), the peak phase marked."""
    s = e.settings
    lines = [f"{'term':<52} {'GPU GiB':>8} {'host GiB':>8}  phase", "-" * 80]
    for t in e.terms:
        if not t.gpu and not t.host:
            continue
        mark = "" if e.counts(t) or not t.gpu else "  (not at the peak)"
        lines.append(f"{t.name[:52]:<52} {_gb(t.gpu)} {_gb(t.host)}  {t.phase}{mark}")
    lines.append("-" * 80)
    lines.append(f"{'GPU peak allocated (' + e.peak_phase.replace('_', ' ') + ')':<52} {_gb(e.gpu_peak)}")
    lines.append(f"{'GPU needed (peak + slack + context)':<52} {_gb(e.gpu_required)}")
    lines.append(f"{'host per rank':<52} {'':>8} {_gb(e.host_per_rank)}")
    lines.append(f"{f'host per host ({s.ranks_per_node} ranks)':<52} {'':>8} {_gb(e.host_per_host)}")
    return "\n".join(lines)


def settings_summary(s: Settings) -> dict[str, Any]:
    lv = s.levers
    return {"max_length": s.max_length, "sp_size": s.sp_size, "dp": s.dp_size,
            "activation_offload": lv.activation_offload,
            "tiled_mlp": lv.tiled_mlp if lv.tiled_mlp > 1 else False, "offload_optimizer": lv.optimizer_offload,
            "checkpoint_every": lv.checkpoint_every, "loss_type": s.loss_type, "loss_chunk_size": s.loss_chunk_size}


def shortage(plan: Plan) -> str:
    p = plan.predicted
    return (f"{p.shortage()}; binding limit: {p.binding_limit} (the closest settings are shown); add GPUs "
            f"(sp), shorten max_length or give the run more memory")


def floor_of(plan: Plan) -> dict[str, float] | None:
    """The predicted step's floor (Prediction.floor) and the step's ratio to it; None without a step time."""
    p = plan.predicted
    if not p.floor:
        return None
    floor = dict(p.floor)
    return {**floor, "predicted over floor": p.step_s / floor["floor s"]}


def text_report(plan: Plan, machine: Machine, longest: int | None, best: Choice | None,
            floor: dict[str, float] | None = None) -> str:
    s, p = plan.run, plan.predicted
    ranks = f"{machine.gpus} GPU(s) x {machine.gpu_memory_gb:g} GiB" if machine.gpu_memory_gb is not None else \
        f"{machine.gpus} CPU rank(s) (no GPU here: the CPU run this machine would train)"
    head = (f"{plan.model}, max_length {s.max_length:,}, {ranks}, "
            f"host {machine.host_memory_gb:g} GiB per host ({machine.host_memory_source}), sp {s.sp_size} x dp "
            f"{s.dp_size}, {local_tokens(s):,} tokens per GPU")
    lines = [head, "", format_estimate(p.estimate), ""]
    if p.fits:
        lines.append("fits: " + plan.summary())
    else:
        lines.append(f"DOES NOT FIT: {shortage(plan)}")
        lines.append("closest: " + plan.summary())
    if p.step_parts:
        lines.append("predicted step: " + ", ".join(f"{k} {v:.1f} s" for k, v in p.step_parts))
    if floor is not None:
        terms = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in floor.items() if k.endswith(" s") and k != "floor s")
        lines.append(f"floor: {floor['floor s']:.1f} s ({terms}; matmuls at the measured {floor['matmul tflops']:g} "
                     f"TFLOP/s); the predicted step is {floor['predicted over floor']:.2f}x its floor")
    if plan.decided:
        lines.append("auto chose: " + ", ".join(plan.decided))
    lines.extend(f"note: {n}" for n in plan.notes)
    if p.fits:
        lines.append("recipe lines: " + "; ".join(
            [f"activation_offload: {len(plan.offload_layers)}",
             f"keep_attention_outputs: {len(plan.kept_attention_layers)}",
             f"tiled_mlp: {s.levers.tiled_mlp if s.levers.tiled_mlp > 1 else 'false'}",
             f"checkpoint_every: {s.levers.checkpoint_every}",
             f"optimizer_offload: {str(s.levers.optimizer_offload).lower()}"]))
    if s.levers.checkpoint_every > 1:
        lines.append(_rebuild_cost(s.levers.checkpoint_every))
    if longest is None:
        lines.append("largest max_length that fits: not searched (no GPU: pass --gpu_memory_gb to plan one)")
    elif best is not None:
        b = best.settings.levers
        lines.append(f"largest max_length that fits: {longest:,} (activation_offload {b.activation_offload}, "
                     f"tiled_mlp {b.tiled_mlp}, optimizer_offload {str(b.optimizer_offload).lower()}, "
                     f"checkpoint_every {b.checkpoint_every}, no attention outputs kept; "
                     f"searched in multiples of {1024 * best.settings.sp_size:,})")
    else:
        lines.append("largest max_length that fits: none (not even 1024 x sp tokens)")
    lines.append("memory in GiB (2**30 bytes)")
    return "\n".join(lines)


def _rebuild_cost(every: int) -> str:
    """What checkpoint_every costs in compute: a checkpointed step runs each layer's forward twice and its
    backward (~2 forwards) once, ~4 forwards; rebuilding adds one for (k-1)/k of the layers."""
    extra = (every - 1) / every
    return (f"checkpoint_every {every}: {extra:.0%} of the layers run forward once more in backward "
            f"(about +{extra / 4:.0%} step compute)")
