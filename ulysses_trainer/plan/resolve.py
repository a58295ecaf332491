"""One resolved plan: every setting of a run decided once, from the training config, the model's shape and
the machine. `resolve_plan` is the one function the trainer and `ulysses-trainer plan` call.

Every lever is checked here against the model (ConfigError, exit 2, naming the fix; lever_settings.decode_levers
has decoded and checked the values themselves); every `auto` is decided here: of all the settings that fit the
GPU and host memory (plan/memory.py), the one with the shortest predicted step (plan/step_time.py). The search
(plan/fit_search.fastest_fit) covers the optimizer's placement (GPU or host), the checkpoint thinning, the MLP tiles,
the offloaded layer inputs and the kept attention outputs.
Torch-free: the caller measures the machine (GPU memory, host RAM, installed kernels) and passes it in.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..data.attention_share import AttentionShare
from ..errors import ConfigError
from ..layout import Layout, resolve_layout
from ..lever_settings import Levers, decode_levers
from ..names import (
    KEEPING_KERNELS,
    auto_num_tiles,
    choose_experts_implementation,
    choose_kernel,
    choose_norm_kernel,
    default_mlp_tiles,
)
from .fit_search import Fixed, fastest_fit, shortfall, with_headroom
from .inputs import (
    ModelShape,
    Settings,
    check_settings,
    lora_numels,
    num_params,
    saved_layer_count,
)
from .memory import GIB, MemoryEstimate, estimate
from .step_time import StepTime, format_seconds, step_time
from .types import Machine, Plan, ZeroSettings, read_zero

# the engine's measured memory use may exceed the model states' prediction by this much before the plan
# shrinks: DeepSpeed's own buffers and the CUDA context vary by a GiB or so; more means another tenant
ENGINE_TOLERANCE_GB = 2.0


# --------------------------------------------------------------------------------------------
# Levers: each knob of the training config read once


def read_levers(levers: Levers, shape: ModelShape, kernel: str, local: int) -> Fixed:
    """The decoded levers (lever_settings.decode_levers) checked against the model and the kernel (ConfigError
    naming the fix) and bound to it: fixed values or None (auto). `local`: tokens per rank (what
    `tiled_mlp: true` sizes its tiles by)."""
    fx = levers.bind(shape.layers, lambda: auto_num_tiles(local, shape.hidden, shape.mlp_row_width))
    if kernel not in KEEPING_KERNELS and fx.keep not in (0, None):
        raise ConfigError(f"keep_attention_outputs needs a kernel that can keep its outputs (sdpa, "
                          f"flash_attention_4); {kernel} cannot: set keep_attention_outputs false or "
                          f"attn_implementation sdpa")
    return fx


def _with_zero(fx: Fixed, zero: ZeroSettings) -> Fixed:
    """The user's ZeRO JSON says where Adam lives (when it has an offload_optimizer section): it wins."""
    if zero.offload_optimizer is None:
        return fx
    if fx.optimizer_offload is not None and fx.optimizer_offload != zero.offload_optimizer:
        raise ConfigError(f"optimizer_offload {str(fx.optimizer_offload).lower()} but the ZeRO JSON "
                          f"{'has' if zero.offload_optimizer else 'has no'} offload_optimizer: set "
                          f"optimizer_offload auto (the JSON wins) or edit the JSON")
    return replace(fx, optimizer_offload=zero.offload_optimizer)


def _check_machine(machine: Machine) -> None:
    if machine.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {machine.gpus}")
    if machine.gpus_per_host is not None and (machine.gpus_per_host < 1 or machine.gpus % machine.gpus_per_host):
        raise ConfigError(f"--gpus_per_host {machine.gpus_per_host} must divide --gpus {machine.gpus}")
    if (machine.gpu_memory_gb is not None and not machine.gpu_memory_gb > 0) or not machine.host_memory_gb > 0:
        raise ConfigError(f"--gpu_memory_gb and --host_memory_gb must be > 0, got {machine.gpu_memory_gb} "
                          f"and {machine.host_memory_gb}")


# --------------------------------------------------------------------------------------------
# The one entry point


def lora_trainable(cfg: Any, shape: ModelShape) -> tuple[int, ...] | None:
    """use_peft: the adapters' tensor sizes (the base weights are frozen); None: every weight trains."""
    if not cfg.use_peft:
        return None
    pc = cfg.peft_config or {}
    return lora_numels(shape, pc.get("target_modules", cfg.lora_target_modules), int(pc.get("r", cfg.lora_r)))


def _base_settings(cfg: Any, layout: Layout, machine: Machine, zero: ZeroSettings, kernel: str, norm: str,
                   bf16: bool, shape: ModelShape) -> Settings:
    return Settings(max_length=cfg.max_length, sp=layout.sp, dp=layout.dp,
                    micro_batch=cfg.per_device_train_batch_size, bf16=bf16,
                    gradient_checkpointing=cfg.gradient_checkpointing, loss_type=cfg.loss_type,
                    loss_chunk_size=cfg.loss_chunk_size, lean_norm=cfg.lean_norm, norm_kernel=norm, attention=kernel,
                    pad_to_multiple_of=cfg.pad_to_multiple_of, zero3=zero.knobs, gpus_per_host=machine.ranks_per_host,
                    experts_implementation=choose_experts_implementation(cfg.experts_implementation),
                    trainable_numels=lora_trainable(cfg, shape))


WORST_CASE = ("packing: attention timed as one document of max_length, the worst case (`ulysses-trainer plan "
              "--dataset_name ...` times it from the data's document lengths)")


def _first_notes(cfg: Any, machine: Machine, fx: Fixed, kernel: str, norm: str,
                 attention: AttentionShare | None = None) -> list[str]:
    notes = [f"host memory {machine.host_memory_gb:.1f} GiB per host ({machine.host_memory_source})"]
    if cfg.packing:
        notes.append(attention.describe() + "; memory as a dense row of the same length" if attention else WORST_CASE)
    if cfg.attn_implementation == "auto" and not machine.kernels_known:
        notes.append(f"the kernels installed there are unknown: auto planned as {kernel} (pass "
                     f"--attn_implementation flash_attention_4 where it is installed)")
    if cfg.norm_kernel == "auto" and cfg.lean_norm and not machine.kernels_known:
        notes.append(f"norm_kernel auto planned as {norm} (pass --norm_kernel triton where liger-kernel is installed)")
    return notes


def _gpu_budget(machine: Machine, base: Settings, engine_plan: Plan | None, notes: list[str]) -> float | None:
    """The GPU memory to plan with: the machine's, or what the engine left when that is less than expected."""
    budget = machine.gpu_memory_gb
    if budget is not None and engine_plan is not None and machine.gpu_free_after_engine_gb is not None:
        held = sum(t.gpu for t in engine_plan.estimate.terms if t.phase == "static" and t.name != "Adam m, v")
        measured = machine.gpu_free_after_engine_gb + (held + int(base.cuda_context_gb * GIB)) / GIB
        if measured < machine.gpu_memory_gb - ENGINE_TOLERANCE_GB:  # else the planned budget stands
            budget = measured
            notes.append(f"GPU budget {budget:.1f} GiB: measured {machine.gpu_free_after_engine_gb:.1f} GiB free "
                         f"after the engine was built")
    return budget


def _cheapest(shape: ModelShape, base: Settings, fx: Fixed) -> MemoryEstimate:
    """The CPU run: nothing is short of memory; the autos take their cheapest values."""
    every = fx.every or 1
    tiles = fx.tiles if fx.tiles is not None else default_mlp_tiles(base.local_tokens, shape.mlp_row_width)
    s = replace(base, checkpoint_every=every, tiled_mlp=tiles, offload_optimizer=bool(fx.optimizer_offload),
                activation_offload=fx.offload_for(saved_layer_count(shape, every)) or 0,
                kept_attention_layers=fx.keep or 0)
    return estimate(shape, s)


def _placement_note(best: dict, s: Settings) -> str:
    other = best[not s.offload_optimizer]
    return (f"optimizer_offload auto: Adam on the {'host' if s.offload_optimizer else 'GPU'}, predicted "
            f"{format_seconds(best[s.offload_optimizer][0])} s/step against {format_seconds(other[0])} s "
            f"with Adam on the {'GPU' if s.offload_optimizer else 'host'}")


def resolve_plan(cfg: Any, shape: ModelShape, machine: Machine, zero: ZeroSettings | None = None, *,
                 engine_plan: Plan | None = None, attention: AttentionShare | None = None,
                 layout: Layout | None = None) -> Plan:
    """The plan for `cfg` (a TrainConfig) on `machine`. ConfigError for settings that cannot run.

    engine_plan: the plan the engine was built with; with machine.gpu_free_after_engine_gb set, the GPU
    budget becomes what the measurement leaves (free memory plus what the model states were predicted to
    take), and the settings the engine fixed (optimizer placement, kernel, tiles) stay.
    attention: the packed data's attention cost (data/attention_share.py); None: one document per row.
    layout: the run's (config_checks.validate_config decided it); None: resolve_layout of sp_size and machine.gpus.
    """
    zero = zero or ZeroSettings()
    knobs = zero.placement_knobs()
    _check_machine(machine)
    if layout is None:
        layout = resolve_layout(cfg.sp_size, machine.gpus)
    assert layout.world == machine.gpus, f"layout of {layout.world} ranks planned on {machine.gpus} GPUs"
    kernel = engine_plan.kernel if engine_plan else choose_kernel(cfg.attn_implementation, machine.kernels)
    norm = engine_plan.norm_kernel if engine_plan else choose_norm_kernel(cfg.norm_kernel, machine.norm_kernels,
                                                                          cfg.lean_norm)
    gpu = machine.gpu_memory_gb is not None
    bf16 = machine.bf16(cfg.bf16)  # the one rule (plan/types.py)
    base = _base_settings(cfg, layout, machine, zero, kernel, norm, bf16, shape)
    if cfg.packing and attention is not None:
        base = replace(base, attention_fraction=attention.mean)
    fx = _with_zero(read_levers(decode_levers(cfg), shape, kernel, base.local_tokens), zero)
    asked = fx  # what the user (config and ZeRO JSON) fixed: the rest is `auto`, decided below
    if engine_plan is not None:  # the engine fixed these
        fx = replace(fx, optimizer_offload=engine_plan.optimizer_offload, tiles=engine_plan.tiles)
    check_settings(shape, replace(base, kept_attention_layers=0))
    notes = _first_notes(cfg, machine, fx, kernel, norm, attention)
    gas = cfg.gradient_accumulation_steps
    n = num_params(shape)

    def time_of(s: Settings) -> StepTime:
        return step_time(shape, s, n, accumulation=gas, gpu_name=machine.gpu_name)

    budget = _gpu_budget(machine, base, engine_plan, notes)
    if not gpu:
        chosen, fits, best = _cheapest(shape, base, fx), True, {}
    else:
        # packed rows keep outputs as dense rows do (attention/grouped.py: per KV group, buffers of a dense row)
        can_keep = cfg.gradient_checkpointing and kernel in KEEPING_KERNELS
        chosen, fits, best = fastest_fit(shape, base, fx, shape.layers if can_keep else 0, budget,
                                         machine.host_memory_gb, knobs, lambda s: time_of(s).total_s)
        if fits and fx.offload is None:
            chosen = with_headroom(shape, chosen, budget, machine.host_memory_gb)
    st = time_of(chosen.settings) if gpu else None
    if st is not None:
        notes.extend(st.extrapolated)
    if engine_plan is not None:  # the placement was weighed before the engine was built
        notes.extend(n for n in engine_plan.notes if n.startswith("optimizer_offload auto"))
    if fx.optimizer_offload is None and len(best) == 2:
        notes.append(_placement_note(best, chosen.settings))
    gpu_miss, host_miss = shortfall(chosen, budget, machine.host_memory_gb) if gpu else (0, 0)
    limit = None if fits else " and ".join(n for n, m in (("GPU memory", gpu_miss), ("host memory", host_miss)) if m)
    return _assemble(cfg, shape, machine, chosen, st, kernel, fits=fits, limit=limit, misses=(gpu_miss, host_miss),
                     budget=budget, fixed=asked, notes=notes, knobs=knobs,
                     attention_from="" if not cfg.packing else "data" if attention else "one document (worst case)")


def _assemble(cfg: Any, shape: ModelShape, machine: Machine, chosen: MemoryEstimate, st: StepTime | None,
              kernel: str, *, fits: bool, limit: str | None, misses: tuple[int, int], budget: float | None,
              fixed: Fixed, notes: list[str], knobs: dict, attention_from: str = "") -> Plan:
    """The Plan of the chosen settings: layers as indices, memory in GiB."""
    s = chosen.settings
    saved_layers = tuple(range(0, shape.layers, s.checkpoint_every)) if s.gradient_checkpointing else ()
    return Plan(
        model=str(cfg.model_name_or_path), max_length=cfg.max_length, padded_length=s.padded_length, sp=s.sp,
        dp=s.dp, kernel=kernel, loss_type=s.loss_type, loss_chunk_size=s.loss_chunk_size, tiles=s.tiled_mlp,
        lean_norm=s.lean_norm, norm_kernel=s.norm_kernel, gradient_checkpointing=s.gradient_checkpointing,
        checkpoint_every=s.checkpoint_every,
        saved_layers=saved_layers, offload_layers=saved_layers[:s.activation_offload],
        kept_attention_layers=tuple(range(s.kept_attention_layers)), optimizer_offload=s.offload_optimizer,
        num_layers=shape.layers, checkpoint_bytes_per_layer=s.local_tokens * shape.hidden * s.act_bytes,
        kept_attention_bytes_per_layer=_kept_bytes(shape, s),
        terms=tuple((t.name, t.gpu if chosen.counts(t) else 0, t.host) for t in chosen.terms if t.gpu or t.host),
        predicted_peak_gpu_gb=chosen.gpu_peak / GIB, predicted_gpu_required_gb=chosen.gpu_required / GIB,
        predicted_host_gb=chosen.host_per_host / GIB, predicted_step_s=None if st is None else st.total_s,
        step_parts=tuple(st.parts.items()) if st else (), fits=fits, binding_limit=limit,
        missing_gpu_gb=misses[0] / GIB, missing_host_gb=misses[1] / GIB, gpu_budget_gb=budget,
        host_budget_gb=machine.host_memory_gb,
        decided=_decided(cfg, fixed, s, kernel), notes=tuple(notes), settings=s, estimate=chosen, fixed=fixed,
        zero3_by_placement=knobs,
        experts_implementation=s.experts_implementation, attention_fraction=s.attention_fraction,
        attention_from=attention_from)


def plan_for(cfg: Any, model_config: Any, ds: dict, machine: Machine, *,
             attention: AttentionShare | None = None) -> Plan:
    """resolve_plan from what the trainer loads: the HF model config and the ZeRO JSON (a dict). The trainer
    (train/prepare.py) and `ulysses-trainer plan` both call this; attention: the packed data's attention cost."""
    return resolve_plan(cfg, ModelShape.from_config(model_config), machine, read_zero(ds, str(cfg.deepspeed)),
                        attention=attention)


def _kept_bytes(shape: ModelShape, s: Settings) -> int:
    from .layer_terms import kept_attention_bytes_per_layer

    return kept_attention_bytes_per_layer(shape, s)


def _decided(cfg: Any, fx: Fixed, s: Settings, kernel: str) -> tuple[str, ...]:
    out = []
    if cfg.attn_implementation == "auto":
        out.append(f"attn_implementation {kernel}")
    if cfg.norm_kernel == "auto" and s.lean_norm:
        out.append(f"norm_kernel {s.norm_kernel}")
    for name, fixed, value in (("activation_offload", fx.offload, s.activation_offload),
                               ("keep_attention_outputs", fx.keep, s.kept_attention_layers),
                               ("tiled_mlp", fx.tiles, s.tiled_mlp), ("checkpoint_every", fx.every, s.checkpoint_every),
                               ("optimizer_offload", fx.optimizer_offload, s.offload_optimizer)):
        if fixed is None:
            out.append(f"{name} {str(value).lower() if isinstance(value, bool) else value}")
    return tuple(out)

