"""One resolved plan: every setting of a run decided once, from the training config, the model's shape and
the machine. `resolve_plan` is the one function `ulysses-trainer plan` calls: `search_plan` (every decision
before the step time, then the one search, memory only) and `plan_from` (the fastest of what it found, timed
with the packed data's attention share). The trainer calls the two apart: it searches before reading the data and
times after (train/prepare.py). `replan_after_engine` runs the search again with the GPU memory measured once the
engine is built, the lever fields only.

Every lever is checked here against the model (ConfigError, exit 2, naming the fix; lever_settings.decode_levers
has decoded and checked the values themselves); every `auto` is decided here: of all the settings that fit the
GPU and host memory (plan/memory.py), the one with the shortest predicted step (plan/step_time.py). The search
(plan/fit_search.search_fits) covers the optimizer's placement (GPU or host), the checkpoint thinning, the MLP tiles,
the offloaded layer inputs and the kept attention outputs.
Torch-free: the caller measures the machine (GPU memory, host RAM, installed kernels) and passes it in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError
from ..vocabulary.layout import Layout, resolve_layout
from ..vocabulary.lever_settings import AUTO_LEVERS, EVERY_LAYER, Levers, decode_levers
from ..vocabulary.names import GIB, KEEPING_KERNELS, auto_num_tiles, choose_kernels
from .attention_share import AttentionShare
from .attention_time import fastest_attention
from .card_rates import rates_for
from .fit_search import HOST_HEADROOM, Fits, cheapest_autos, search_fits, shortfall, with_headroom
from .inputs import ModelShape, Settings, check_settings
from .layer_terms import kept_attention_bytes_per_layer
from .notes import WORST_CASE, decided, plan_notes  # noqa: F401 - WORST_CASE: the packing note, re-exported
from .partitions import lora_numels
from .rates import MEASURED_HEAD_SHAPE
from .step_time import StepTime, step_floor, step_time
from .types import Machine, Plan, Prediction, ZeroSettings, read_zero


def resolve_plan(cfg: Any, shape: ModelShape, machine: Machine, zero: ZeroSettings | None = None, *,
                 attention: AttentionShare | None = None, layout: Layout | None = None) -> Plan:
    """The plan for `cfg` (a TrainConfig) on `machine`: `search_plan`, then `plan_from` with the data's share.
    ConfigError for settings that cannot run.
    attention: the packed data's attention cost (plan/attention_share.py); None: one document per row.
    layout: the run's (config.checks.validate_config decided it); None: resolve_layout of sp_size and machine.gpus.
    """
    return plan_from(search_plan(cfg, shape, machine, zero, layout=layout), attention=attention)


@dataclass(frozen=True)
class LeverSearch:
    """Every decision before the step time and the one search over the levers (memory only: the data's attention
    share moves the time, never the memory). `plan_from` makes the Plan of it, with or without the share."""

    cfg: Any
    shape: ModelShape
    machine: Machine
    base: Settings  # the search's starting settings; plan_from sets their attention_fraction
    searched: Levers  # the levers the search decides: None
    fixed: Levers  # what the config and the ZeRO JSON fixed
    zero: ZeroSettings
    budget: float | None  # GiB per GPU; None: no GPU
    budget_note: str | None
    found: Fits | None  # None: no GPU (every auto at its cheapest: fit_search.cheapest_autos)
    engine_plan: Plan | None = None  # the re-plan after the engine: the first plan
    # the search over the whole host where `found` is the one within HOST_HEADROOM of it (None: that found nothing,
    # and `found` is the whole host's): what the plan says it gave up for the room
    fuller: Fits | None = None

    @property
    def fits(self) -> bool:
        """Whether anything fits: the same with or without the data's share (memory does not depend on it)."""
        return self.found is None or self.found.fits


def search_plan(cfg: Any, shape: ModelShape, machine: Machine, zero: ZeroSettings | None = None, *,
                layout: Layout | None = None) -> LeverSearch:
    """One pass down: the machine's budget, the layout, the kernels, the base settings, the levers decoded and
    bound, then the search. ConfigError for settings that cannot run."""
    zero = zero or ZeroSettings()
    machine.check()
    bf16 = machine.bf16(cfg.bf16)  # the one rule (plan/types.py)
    budget, budget_note = machine.gpu_budget(None)
    if layout is None:
        layout = resolve_layout(cfg.sp_size, machine.gpus)
    assert layout.world_size == machine.gpus, f"layout of {layout.world_size} ranks planned on {machine.gpus} GPUs"
    kernels = choose_kernels(cfg.attn_implementation, cfg.norm_kernel, cfg.experts_implementation, cfg.lean_norm,
                             machine.kernels, machine.norm_kernels, cfg.deltanet_kernel, machine.deltanet_kernels)
    if cfg.attn_implementation == "auto" and machine.kernels_known and shape.head_dim != MEASURED_HEAD_SHAPE[2]:
        # auto past the head size the kernel order was measured at: the installed kernel the card's rates make
        # fastest at this head size and length (at head_dim 256 an H100 runs flash-attn-4's backward at 1M at
        # 161 TFLOP/s fwd+bwd, cuDNN's at 417)
        fastest = fastest_attention(shape, cfg.max_length, layout.sp_size, machine.kernels,
                                    rates_for(machine.gpu_name, machine.gpu_memory_gb)[0])
        kernels = replace(kernels, attn_implementation=fastest or kernels.attn_implementation)
    base = Settings(max_length=cfg.max_length, layout=layout,
                    micro_batch=cfg.per_device_train_batch_size, bf16=bf16,
                    levers=replace(EVERY_LAYER, gradient_checkpointing=cfg.gradient_checkpointing),
                    loss_type=cfg.loss_type,
                    loss_chunk_size=cfg.loss_chunk_size, lean_norm=cfg.lean_norm, norm_kernel=kernels.norm_kernel,
                    attn_implementation=kernels.attn_implementation, pad_to_multiple_of=cfg.pad_to_multiple_of,
                    zero3=zero.knobs,
                    gpus_per_node=machine.ranks_per_node, experts_implementation=kernels.experts_implementation,
                    deltanet_kernel=kernels.deltanet_kernel if shape.mixer_layers else "",
                    trainable_numels=_lora_numels(cfg, shape))
    # the levers (lever_settings.decode_levers), the ZeRO JSON's optimizer placement winning over auto, bound to
    # the model: `tiled_mlp: true` sizes its tiles by the tokens per rank. fixed: what the config and JSON fixed
    fixed = decode_levers(cfg).with_json_placement(zero.optimizer_offload).bind(
        shape.layers, lambda: auto_num_tiles(base.local_tokens, shape.hidden, shape.mlp_row_width))
    if kernels.attn_implementation not in KEEPING_KERNELS and fixed.keep_attention_outputs not in (0, None):
        raise ConfigError(f"keep_attention_outputs needs a kernel that can keep its outputs (sdpa, "
                          f"flash_attention_4); {kernels.attn_implementation} cannot: set keep_attention_outputs "
                          f"false or attn_implementation sdpa")
    check_settings(shape, base)
    return _search(cfg, shape, machine, base, fixed, fixed, zero, budget, budget_note, engine_plan=None)


def replan_after_engine(first: Plan, cfg: Any, shape: ModelShape, machine: Machine, *,
                        attention: AttentionShare | None = None) -> Plan:
    """The plan again once the engine holds the model states (machine.gpu_free_after_engine_gb set): the same
    search over the GPU budget the measurement leaves (free memory plus what `first` predicted the model states
    take). Nothing is decided again: the layout, kernels, base settings and the levers the config fixed are
    `first`'s, and so are the two the engine fixed (optimizer placement, tiles). Equal to `first` when the
    GPU holds what the memory model expected."""
    budget, budget_note = machine.gpu_budget(first)
    searched = replace(first.fixed, optimizer_offload=first.levers.optimizer_offload, tiled_mlp=first.levers.tiled_mlp)
    return plan_from(_search(cfg, shape, machine, first.search_base, searched, first.fixed, first.zero, budget,
                             budget_note, engine_plan=first), attention=attention)


def _search(cfg: Any, shape: ModelShape, machine: Machine, base: Settings, searched: Levers, fixed: Levers,
            zero: ZeroSettings, budget: float | None, budget_note: str | None, *,
            engine_plan: Plan | None) -> LeverSearch:
    """The search over the levers `searched` leaves open (None) within the budgets (none without a GPU)."""
    found = fuller = None
    if budget is not None:
        # packed rows keep outputs as dense rows do (attention/grouped.py: per KV group, buffers of a dense row)
        can_keep = cfg.gradient_checkpointing and base.attn_implementation in KEEPING_KERNELS \
            and not shape.family.attention_sinks  # the sinks' path keeps no output
        keep = shape.layers if can_keep else 0
        whole = search_fits(shape, base, searched, keep, budget, machine.host_memory_gb, zero.by_placement)
        # auto leaves the host room for the OS, the data workers and the page cache where a plan fits within it:
        # searched again within that room only where some plan the whole host allows holds more
        full = machine.host_memory_gb is not None and any(
            e.host_per_host > HOST_HEADROOM * machine.host_memory_gb * GIB for es in whole.found.values() for e in es)
        roomy = search_fits(shape, base, searched, keep, budget, HOST_HEADROOM * machine.host_memory_gb,
                            zero.by_placement) if full else whole
        found, fuller = (roomy, whole) if roomy.fits and roomy is not whole else (whole, None)
    return LeverSearch(cfg, shape, machine, base, searched, fixed, zero, budget, budget_note, found, engine_plan,
                       fuller)


def plan_from(sr: LeverSearch, *, attention: AttentionShare | None = None) -> Plan:
    """The Plan of a search: the fastest of what it found, timed with the packed data's attention share
    (None: one document per row), then the step time and the notes. No search runs here."""
    cfg, shape, machine, searched, budget = sr.cfg, sr.shape, sr.machine, sr.searched, sr.budget
    fraction = attention.mean if cfg.packing and attention is not None else 1.0
    base = replace(sr.base, attention_fraction=fraction)

    def time_of(s: Settings) -> StepTime:
        return step_time(shape, s, shape.num_params, accumulation=cfg.gradient_accumulation_steps,
                         gpu_name=machine.gpu_name, gpu_memory_gb=machine.gpu_memory_gb,
                         host_cores=machine.host_cores)

    best: dict = {}
    roomy_note = None
    if sr.found is None:  # no GPU
        chosen, fits, gpu_miss, host_miss = cheapest_autos(shape, base, searched), True, 0, 0
    else:
        assert budget is not None
        chosen, fits, best = sr.found.fastest(lambda s: time_of(s).total_s, fraction)
        fuller = sr.fuller.fastest(lambda s: time_of(s).total_s, fraction)[0] if sr.fuller else chosen
        if time_of(fuller.settings).total_s < time_of(chosen.settings).total_s:  # room for the host, at a cost
            levers = ", ".join(f"{k} {str(getattr(fuller.settings.levers, k)).lower()}" for k in AUTO_LEVERS
                               if getattr(fuller.settings.levers, k) != getattr(chosen.settings.levers, k))
            roomy_note = (f"auto left the host room (under {HOST_HEADROOM:.0%} of its memory): the fastest plan "
                          f"that fits holds {fuller.host_per_host / GIB:.1f} GiB per host and would take "
                          f"{time_of(fuller.settings).total_s:.1f} s/step; set {levers} to run it")
        if fits and searched.activation_offload is None:
            chosen = with_headroom(shape, chosen, budget, machine.host_memory_gb)
        gpu_miss, host_miss = shortfall(chosen, budget, machine.host_memory_gb)
    st = None if budget is None else time_of(chosen.settings)
    s = chosen.settings
    card = rates_for(machine.gpu_name, machine.gpu_memory_gb)[0]
    floor = step_floor(shape, s, st.parts, cfg.gradient_accumulation_steps, card) if st and st.parts else {}
    limit = None if fits else " and ".join(n for n, m in (("GPU memory", gpu_miss), ("host memory", host_miss)) if m)
    return Plan(
        model=str(cfg.model_name_or_path), run=s, num_layers=shape.layers,
        checkpoint_bytes_per_layer=s.local_tokens * shape.hidden * s.act_bytes,
        kept_attention_bytes_per_layer=kept_attention_bytes_per_layer(shape, s),
        predicted=Prediction(
            terms=tuple((t.name, t.gpu if chosen.counts(t) else 0, t.host) for t in chosen.terms if t.gpu or t.host),
            peak_gpu_gb=chosen.gpu_peak / GIB, gpu_required_gb=chosen.gpu_required / GIB,
            host_gb=chosen.host_per_host / GIB, step_s=None if st is None else st.total_s,
            step_parts=tuple(st.parts.items()) if st else (), floor=tuple(floor.items()), fits=fits,
            binding_limit=limit,
            missing_gpu_gb=gpu_miss / GIB, missing_host_gb=host_miss / GIB, gpu_budget_gb=budget,
            host_budget_gb=machine.host_memory_gb, estimate=chosen),
        decided=decided(cfg, sr.fixed, s),
        notes=plan_notes(cfg, machine, s, attention=attention, budget_note=sr.budget_note, st=st,
                         engine_plan=sr.engine_plan, searched=searched, best=best, host_gb=chosen.host_per_host / GIB)
        + ((roomy_note,) if roomy_note else ()) + ((shape.family.plan_note,) if shape.family.plan_note else ()),
        fixed=sr.fixed, zero=sr.zero,
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
    """resolve_plan from what the trainer loads: the HF model config and the ZeRO JSON (a dict); attention: the
    packed data's attention cost. The trainer (train/prepare.py) and `ulysses-trainer plan` make the same two calls
    apart (search_plan before the data, plan_from after it)."""
    return resolve_plan(cfg, ModelShape.from_config(model_config), machine, read_zero(ds, str(cfg.deepspeed)),
                        attention=attention)
