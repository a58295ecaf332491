"""The resolved plan and what resolving it reads: the machine and the run's ZeRO JSON (plan/resolve.py
decides; the trainer, `ulysses-trainer plan` and the rehearsal read the Plan). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError
from ..vocabulary.lever_settings import Levers
from ..vocabulary.model_setup import LayerLists, ModelSetup
from ..vocabulary.names import DEFAULT_SUB_GROUP_SIZE, GIB, check_zero_stage, offload_sub_group_size
from ..zero_json import zero_size
from .inputs import Settings, Zero3Knobs
from .memory_record import MemoryEstimate
from .step_time import format_seconds

# the engine's measured memory use may exceed the model states' prediction by this much before the plan
# shrinks: DeepSpeed's own buffers and the CUDA context vary by a GiB or so; more means another tenant
ENGINE_TOLERANCE_GB = 2.0


@dataclass(frozen=True)
class Machine:
    """What the run gets. Memory in GiB. gpu_memory_gb None: no GPU (the CPU run: nothing to search)."""

    gpus: int
    gpu_memory_gb: float | None
    host_memory_gb: float  # per host
    gpus_per_node: int | None = None  # None: all GPUs on one host
    kernels: tuple[str, ...] = ("sdpa",)  # installed attention kernels, fastest first
    kernels_known: bool = True  # False: planning another machine (auto = the first of `kernels`, said)
    norm_kernels: tuple[str, ...] = ("torch",)  # installed RMSNorm kernels, fastest first
    deltanet_kernels: tuple[str, ...] = ("torch",)  # installed Gated DeltaNet rule kernels, fastest first
    gpu_name: str | None = None
    gpu_free_after_engine_gb: float | None = None  # measured once the engine holds the model states
    host_memory_source: str = "given"  # how host_memory_gb was obtained (said in the plan)
    bf16_supported: bool = True  # the GPUs take bf16 (every GPU planned for does; probed on this machine)
    host_cores: int | None = None  # CPU cores per node (CPU Adam's ranks share them); None: 16 per GPU assumed

    def bf16(self, setting: bool | str) -> bool:
        """The one rule for the `bf16` setting, shared by the trainer, `plan` and `rehearse`: true/false as
        given; 'auto' = on exactly when the run has GPUs and they take bf16."""
        if isinstance(setting, bool):
            return setting
        return self.gpu_memory_gb is not None and self.bf16_supported

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node or self.gpus

    def check(self) -> None:
        """ConfigError naming the flag for a machine no run can have."""
        if self.gpus < 1:
            raise ConfigError(f"--gpus must be >= 1, got {self.gpus}")
        if self.gpus_per_node is not None and (self.gpus_per_node < 1 or self.gpus % self.gpus_per_node):
            raise ConfigError(f"--gpus_per_node {self.gpus_per_node} must divide --gpus {self.gpus}")
        if (self.gpu_memory_gb is not None and not self.gpu_memory_gb > 0) or not self.host_memory_gb > 0:
            raise ConfigError(f"--gpu_memory_gb and --host_memory_gb must be > 0, got {self.gpu_memory_gb} "
                              f"and {self.host_memory_gb}")

    def gpu_budget(self, engine_plan: Plan | None) -> tuple[float | None, str | None]:
        """(the GPU memory to plan with, the note saying why when it is not the machine's): what the engine left
        (free memory after it was built plus what engine_plan predicted it holds) when that is less than
        expected."""
        if self.gpu_memory_gb is None or engine_plan is None or self.gpu_free_after_engine_gb is None:
            return self.gpu_memory_gb, None
        held = sum(t.gpu for t in engine_plan.predicted.estimate.terms if t.phase == "static" and t.name != "Adam m, v")
        measured = self.gpu_free_after_engine_gb + (held + int(engine_plan.run.cuda_context_gb * GIB)) / GIB
        if measured >= self.gpu_memory_gb - ENGINE_TOLERANCE_GB:  # the planned budget stands
            return self.gpu_memory_gb, None
        return measured, (f"GPU budget {measured:.1f} GiB: measured {self.gpu_free_after_engine_gb:.1f} GiB free "
                          f"after the engine was built")


@dataclass(frozen=True)
class ZeroSettings:
    """What the run's ZeRO JSON fixes: its stage, optimizer placement (None: not said) and bucket sizes."""

    stage: int = 3
    optimizer_offload: bool | None = None
    knobs: Zero3Knobs = field(default_factory=Zero3Knobs)
    # the ZeRO-3 sizes with Adam on the GPU (False) and on the host (True), derived once here: offload the JSON
    # did not ask for gets the smaller sub-groups ds_config.py fills in. Every search over the placement uses these
    by_placement: dict[bool, Zero3Knobs] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        added = replace(self.knobs, sub_group_size=offload_sub_group_size(self.knobs.sub_group_size))
        object.__setattr__(self, "by_placement",
                           {False: self.knobs, True: self.knobs if self.optimizer_offload else added})


def read_zero(ds: dict, source: str = "the ZeRO config") -> ZeroSettings:
    """ZeroSettings of a loaded ZeRO JSON (dict; only stage 3 is planned): its sizes as DeepSpeed runs them
    (zero_json.zero_size: the value written, DeepSpeed's default for a key left out, None for "auto", which the
    trainer fills per hidden size). The plan, the filler and the rehearsal's communication read these."""
    zero = ds.get("zero_optimization", {}) or {}
    check_zero_stage(zero, source)
    stage = zero["stage"]
    off = zero.get("offload_optimizer")
    offload = None if off is None else isinstance(off, dict) and off.get("device", "none") not in ("none", None)

    def num(key: str) -> int | None:
        return zero_size(zero, key, source)

    return ZeroSettings(stage, offload, Zero3Knobs(
        reduce_bucket_size=num("reduce_bucket_size"), prefetch_bucket_size=num("stage3_prefetch_bucket_size"),
        param_persistence_threshold=num("stage3_param_persistence_threshold"),
        sub_group_size=num("sub_group_size") or DEFAULT_SUB_GROUP_SIZE,
        max_live_parameters=num("stage3_max_live_parameters") or DEFAULT_SUB_GROUP_SIZE,
        max_reuse_distance=num("stage3_max_reuse_distance") or DEFAULT_SUB_GROUP_SIZE))


@dataclass(frozen=True)
class Prediction:
    """What the memory model (plan/memory.py) and the step time (plan/step_time.py) predict for a plan's settings,
    the budgets they were held to and any shortfall. Memory in GiB (allocated, as torch reads it)."""

    terms: tuple[tuple[str, int, int], ...]  # (term, GPU bytes in the peak, host bytes per rank)
    peak_gpu_gb: float  # what torch.cuda.max_memory_allocated should read
    gpu_required_gb: float  # + allocator slack + CUDA context: what must fit
    host_gb: float  # per host
    step_s: float | None  # None: no GPU, no prediction
    step_parts: tuple[tuple[str, float], ...]
    # the step's floor (plan/step_time.step_floor: its kernels and every matmul at the measured rate, "floor s"
    # their sum); () without a step time
    floor: tuple[tuple[str, float], ...]
    fits: bool
    binding_limit: str | None  # "GPU memory" | "host memory" | "GPU memory and host memory" when it does not fit
    missing_gpu_gb: float  # what the closest settings need beyond the GPU budget (0 when it fits)
    missing_host_gb: float  # ... beyond the host RAM
    gpu_budget_gb: float | None  # None: no GPU
    host_budget_gb: float
    estimate: MemoryEstimate = field(compare=False, repr=False)  # the memory model's terms in full

    def shortage(self) -> str:
        """What does not fit, in GiB, per limit (empty when it fits)."""
        parts = []
        if self.missing_gpu_gb > 0:
            parts.append(f"GPU memory is short by {self.missing_gpu_gb:.2f} GiB (needs "
                         f"{self.gpu_required_gb:.1f} of {self.gpu_budget_gb:.1f} GiB per GPU)")
        if self.missing_host_gb > 0:
            parts.append(f"host memory is short by {self.missing_host_gb:.2f} GiB (needs "
                         f"{self.host_gb:.1f} of {self.host_budget_gb:.1f} GiB per host)")
        return " and ".join(parts)


@dataclass(frozen=True)
class Plan(LayerLists):
    """The concrete run: no `auto` left. `run` holds every setting under its training-config name (layout, kernels,
    precision, each lever decided); the layers each lever covers are properties; `predicted` what the memory model
    and the step time predict for `run` (Prediction)."""

    model: str
    run: Settings  # the settings the search chose
    num_layers: int
    checkpoint_bytes_per_layer: int
    kept_attention_bytes_per_layer: int
    predicted: Prediction  # what the memory model and the step time predict for `run`, against the budgets
    decided: tuple[str, ...]  # the `auto` settings and what they became
    notes: tuple[str, ...]  # extrapolations, assumptions, alternatives weighed
    # the levers as the config and the ZeRO JSON fixed them (None: auto, decided by the search); the longest
    # length `plan` reports searches the same autos
    fixed: Levers = field(compare=False, repr=False)
    # what the run's ZeRO JSON fixes (read_zero): its ZeRO-3 sizes per optimizer placement (by_placement) are the
    # re-plan's and the longest-length search's too
    zero: ZeroSettings = field(default_factory=ZeroSettings, compare=False, repr=False)
    # packed rows: where run.attention_fraction (sum(l_i^2) / L^2) came from: "data" or "one document (worst
    # case)"; "" without packing
    attention_from: str = ""
    # the settings the search started from (layout, kernels, precision; every lever at its default): a re-plan
    # (plan/resolve.replan_after_engine) searches from them again instead of deciding them again
    search_base: Settings | None = field(default=None, compare=False, repr=False)

    @property
    def levers(self) -> Levers:
        """The levers the search chose, every one concrete: the record the config's were decoded into (`fixed`)."""
        return replace(self.run.levers, pinned=self.fixed.pinned)

    def model_setup(self, host_memory_gb: float | None, ranks_per_node: int, *, levers: bool = True,
                    host_held_slots: int | None = None) -> ModelSetup:
        """What parallelize installs for this plan. levers False: the mechanisms only (no input offloaded, no
        attention output kept yet: the trainer sets those with apply once the engine is built); the stash is
        installed wherever a layer may keep its output (lever_settings.Levers.attention_stash), so that plan may."""
        r = self.run
        chosen = self.levers if levers else replace(self.levers, activation_offload=0, keep_attention_outputs=0)
        return ModelSetup.of(
            chosen, self.num_layers, attention_stash=self.fixed.attention_stash,
            attn_implementation=r.attn_implementation, loss_type=r.loss_type, loss_chunk_size=r.loss_chunk_size,
            lean_norm=r.lean_norm, norm_kernel=r.norm_kernel,
            checkpoint_bytes_per_layer=self.checkpoint_bytes_per_layer if levers else 0,
            host_memory_gb=host_memory_gb, ranks_per_node=ranks_per_node, host_held_slots=host_held_slots,
            experts_implementation=r.experts_implementation, deltanet_kernel=r.deltanet_kernel or "torch")

    def summary(self) -> str:
        """One line: what runs, the predicted step time and peak memory."""
        p, r, lv = self.predicted, self.run, self.levers
        gpu = p.gpu_budget_gb is not None
        adam = "Adam on the host" if lv.optimizer_offload else f"Adam on the {'GPU' if gpu else 'device'}"
        step = f"{format_seconds(p.step_s)} s/step" if gpu else "no step time (no GPU)"
        deltanet = f", {r.deltanet_kernel} deltanet" if r.deltanet_kernel else ""
        return (f"sp {r.sp_size} x dp {r.dp_size}, {r.attn_implementation}{deltanet}, {r.norm_kernel} norms, "
                f"tiled_mlp {lv.tiled_mlp}, "
                f"checkpoint_every {lv.checkpoint_every}, {len(self.offload_layers)}/{len(self.saved_layers)} "
                f"layer inputs offloaded, {len(self.kept_attention_layers)}/{self.num_layers} attention outputs kept, "
                f"{adam}{self._attention()}; predicted {step}, peak {p.peak_gpu_gb:.1f} GiB "
                f"{'GPU' if gpu else 'device'} (allocated), "
                f"{p.host_gb:.1f} GiB host")

    def _attention(self) -> str:
        if self.attention_from == "data":
            return f", packed attention {self.run.attention_fraction:.1%} of one document"
        return ", packed attention timed as one document (worst case)" if self.attention_from else ""

    def to_dict(self) -> dict[str, Any]:
        r, p, lv = self.run, self.predicted, self.levers
        return {"model": self.model, "max_length": r.max_length, "padded_length": r.padded_length,
                "bf16": r.bf16,
                "sp_size": r.sp_size, "dp": r.dp_size, "attn_implementation": r.attn_implementation,
                "loss_type": r.loss_type, "loss_chunk_size": r.loss_chunk_size, "tiled_mlp": lv.tiled_mlp,
                "lean_norm": r.lean_norm, "norm_kernel": r.norm_kernel,
                "experts_implementation": r.experts_implementation, "deltanet_kernel": r.deltanet_kernel,
                "gradient_checkpointing": lv.gradient_checkpointing,
                "checkpoint_every": lv.checkpoint_every, "saved_layers": list(self.saved_layers),
                "offload_layers": list(self.offload_layers), "activation_offload": len(self.offload_layers),
                "keep_attention_outputs": len(self.kept_attention_layers),
                "kept_attention_layers": list(self.kept_attention_layers),
                "optimizer_offload": lv.optimizer_offload, "num_layers": self.num_layers,
                "checkpoint_bytes_per_layer": self.checkpoint_bytes_per_layer,
                "kept_attention_bytes_per_layer": self.kept_attention_bytes_per_layer,
                "terms": [{"name": n, "gpu_bytes": g, "host_bytes": h} for n, g, h in p.terms],
                "predicted_peak_gpu_gb": p.peak_gpu_gb, "predicted_gpu_required_gb": p.gpu_required_gb,
                "predicted_host_gb": p.host_gb, "predicted_step_s": p.step_s,
                "step_parts_s": dict(p.step_parts), "fits": p.fits, "binding_limit": p.binding_limit,
                "missing_gpu_gb": p.missing_gpu_gb, "missing_host_gb": p.missing_host_gb,
                "gpu_budget_gb": p.gpu_budget_gb,
                "host_budget_gb": p.host_budget_gb, "decided": list(self.decided), "notes": list(self.notes),
                "attention_fraction": r.attention_fraction, "attention_from": self.attention_from}
