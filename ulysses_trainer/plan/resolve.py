"""One resolved plan: every setting of a run decided once, from the training config, the model's shape and
the machine. `resolve_plan` is the one function the trainer and `ulysses-trainer plan` call;
`replan_after_engine` runs its search again with the GPU memory measured once the engine is built.

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

from ..errors import ConfigError
from .attention_share import AttentionShare
from .fit_search import cheapest_autos, fastest_fit, shortfall, with_headroom
from .inputs import ModelShape, Settings, check_settings
from .layer_terms import kept_attention_bytes_per_layer
from .layout import Layout, resolve_layout
from .lever_settings import Fixed, decode_levers
from .names import GIB, KEEPING_KERNELS, auto_num_tiles, choose_kernels
from .notes import WORST_CASE, decided, plan_notes  # noqa: F401 - WORST_CASE: the packing note, re-exported
from .partitions import lora_numels
from .step_time import StepTime, step_time
from .types import Machine, Plan, ZeroSettings, read_zero


def resolve_plan(cfg: Any, shape: ModelShape, machine: Machine, zero: ZeroSettings | None = None, *,
                 attention: AttentionShare | None = None, layout: Layout | None = None) -> Plan:
    """The plan for `cfg` (a TrainConfig) on `machine`. ConfigError for settings that cannot run.

    One pass down: the machine's budget, the layout, the kernels, the base settings, the levers decoded and
    bound, the search, the step time, then the Plan with its notes.
    attention: the packed data's attention cost (plan/attention_share.py); None: one document per row.
    layout: the run's (config.checks.validate_config decided it); None: resolve_layout of sp_size and machine.gpus.
    """
    zero = zero or ZeroSettings()
    machine.check()
    bf16 = machine.bf16(cfg.bf16)  # the one rule (plan/types.py)
    budget, budget_note = machine.gpu_budget(None)
    if layout is None:
        layout = resolve_layout(cfg.sp_size, machine.gpus)
    assert layout.world == machine.gpus, f"layout of {layout.world} ranks planned on {machine.gpus} GPUs"
    kernels = choose_kernels(cfg.attn_implementation, cfg.norm_kernel, cfg.experts_implementation, cfg.lean_norm,
                             machine.kernels, machine.norm_kernels, cfg.deltanet_kernel, machine.deltanet_kernels)
    base = Settings(max_length=cfg.max_length, sp=layout.sp, dp=layout.dp,
                    micro_batch=cfg.per_device_train_batch_size, bf16=bf16,
                    gradient_checkpointing=cfg.gradient_checkpointing, loss_type=cfg.loss_type,
                    loss_chunk_size=cfg.loss_chunk_size, lean_norm=cfg.lean_norm, norm_kernel=kernels.norm_kernel,
                    attn_implementation=kernels.attn_implementation, pad_to_multiple_of=cfg.pad_to_multiple_of,
                    zero3=zero.knobs,
                    gpus_per_host=machine.ranks_per_host, experts_implementation=kernels.experts_implementation,
                    deltanet_kernel=kernels.deltanet_kernel if shape.mixer_layers else "",
                    attention_fraction=attention.mean if cfg.packing and attention is not None else 1.0,
                    trainable_numels=_lora_numels(cfg, shape))
    # the levers (lever_settings.decode_levers), the ZeRO JSON's optimizer placement winning over auto, bound to
    # the model: `tiled_mlp: true` sizes its tiles by the tokens per rank. asked: what the config and JSON fixed
    asked = decode_levers(cfg).with_json_placement(zero.optimizer_offload).bind(
        shape.layers, lambda: auto_num_tiles(base.local_tokens, shape.hidden, shape.mlp_row_width))
    if kernels.attn_implementation not in KEEPING_KERNELS and asked.keep_attention_outputs not in (0, None):
        raise ConfigError(f"keep_attention_outputs needs a kernel that can keep its outputs (sdpa, "
                          f"flash_attention_4); {kernels.attn_implementation} cannot: set keep_attention_outputs "
                          f"false or attn_implementation sdpa")
    check_settings(shape, replace(base, keep_attention_outputs=0))
    return _search(cfg, shape, machine, base, asked, asked, zero, budget, budget_note,
                   attention=attention, engine_plan=None)


def replan_after_engine(first: Plan, cfg: Any, shape: ModelShape, machine: Machine, *,
                        attention: AttentionShare | None = None) -> Plan:
    """The plan again once the engine holds the model states (machine.gpu_free_after_engine_gb set): the same
    search over the GPU budget the measurement leaves (free memory plus what `first` predicted the model states
    take). Nothing is decided again: the layout, kernels, base settings and the levers the config fixed are
    `first`'s, and so are the two the engine fixed (optimizer placement, tiles). Equal to `first` when the
    GPU holds what the memory model expected."""
    budget, budget_note = machine.gpu_budget(first)
    fx = replace(first.fixed, optimizer_offload=first.run.optimizer_offload, tiled_mlp=first.run.tiled_mlp)
    return _search(cfg, shape, machine, first.search_base, fx, first.fixed, first.zero, budget,
                   budget_note, attention=attention, engine_plan=first)


def _search(cfg: Any, shape: ModelShape, machine: Machine, base: Settings, fx: Fixed, asked: Fixed,
            zero: ZeroSettings, budget: float | None, budget_note: str | None, *,
            attention: AttentionShare | None, engine_plan: Plan | None) -> Plan:
    """The search over the levers `fx` leaves open (None) within the budgets, the step time, and the Plan."""

    def time_of(s: Settings) -> StepTime:
        return step_time(shape, s, shape.num_params, accumulation=cfg.gradient_accumulation_steps,
                         gpu_name=machine.gpu_name)

    best: dict = {}
    if budget is None:  # no GPU
        chosen, fits, gpu_miss, host_miss = cheapest_autos(shape, base, fx), True, 0, 0
    else:
        # packed rows keep outputs as dense rows do (attention/grouped.py: per KV group, buffers of a dense row)
        can_keep = cfg.gradient_checkpointing and base.attn_implementation in KEEPING_KERNELS
        chosen, fits, best = fastest_fit(shape, base, fx, shape.layers if can_keep else 0, budget,
                                         machine.host_memory_gb, zero.by_placement, lambda s: time_of(s).total_s)
        if fits and fx.activation_offload is None:
            chosen = with_headroom(shape, chosen, budget, machine.host_memory_gb)
        gpu_miss, host_miss = shortfall(chosen, budget, machine.host_memory_gb)
    st = None if budget is None else time_of(chosen.settings)
    s = chosen.settings
    limit = None if fits else " and ".join(n for n, m in (("GPU memory", gpu_miss), ("host memory", host_miss)) if m)
    return Plan(
        model=str(cfg.model_name_or_path), run=s, num_layers=shape.layers,
        checkpoint_bytes_per_layer=s.local_tokens * shape.hidden * s.act_bytes,
        kept_attention_bytes_per_layer=kept_attention_bytes_per_layer(shape, s),
        terms=tuple((t.name, t.gpu if chosen.counts(t) else 0, t.host) for t in chosen.terms if t.gpu or t.host),
        predicted_peak_gpu_gb=chosen.gpu_peak / GIB, predicted_gpu_required_gb=chosen.gpu_required / GIB,
        predicted_host_gb=chosen.host_per_host / GIB, predicted_step_s=None if st is None else st.total_s,
        step_parts=tuple(st.parts.items()) if st else (), fits=fits, binding_limit=limit,
        missing_gpu_gb=gpu_miss / GIB, missing_host_gb=host_miss / GIB, gpu_budget_gb=budget,
        host_budget_gb=machine.host_memory_gb, decided=decided(cfg, asked, s),
        notes=plan_notes(cfg, machine, s, attention=attention, budget_note=budget_note, st=st,
                         engine_plan=engine_plan, fx=fx, best=best),
        estimate=chosen, fixed=asked, zero=zero,
        attention_from="" if not cfg.packing else "data" if attention else "one document (worst case)",
        search_base=base)


def _lora_numels(cfg: Any, shape: ModelShape) -> tuple[int, ...] | None:
    """use_peft: the adapters' tensor sizes (the base weights are frozen); None: every weight trains."""
    if not cfg.use_peft:
        return None
    pc = cfg.peft_config or {}
    return lora_numels(shape, pc.get("target_modules", cfg.lora_target_modules), int(pc.get("r", cfg.lora_r)))


def plan_for(cfg: Any, model_config: Any, ds: dict, machine: Machine, *,
             attention: AttentionShare | None = None) -> Plan:
    """resolve_plan from what the trainer loads: the HF model config and the ZeRO JSON (a dict). The trainer
    (train/prepare.py) and `ulysses-trainer plan` both call this; attention: the packed data's attention cost."""
    return resolve_plan(cfg, ModelShape.from_config(model_config), machine, read_zero(ds, str(cfg.deepspeed)),
                        attention=attention)
