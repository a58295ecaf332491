"""The build step of a run: the model with every mechanism installed (parallelize), the DeepSpeed engine, and
the plan made again from the free GPU memory the engine left, agreed by every rank before step 1."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import deepspeed
import torch

from .. import probe
from ..levers.copy_back import PinnedCopyBack
from ..model.load import build_model as load_model
from ..model.lora import add_lora
from ..model.parallelize import SequenceParallelCausalLM, apply, parallelize
from ..parallel.integrations import quiet_deepspeed_deprecations
from ..parallel.state import ParallelState
from ..plan.resolve import replan_after_engine
from ..plan.types import Plan
from .agreement import agree_free_memory, check_same_plan
from .prepare import PreparedRun
from .schedule import build_schedule


def build_model(prepared: PreparedRun, state: ParallelState,
                device: torch.device) -> tuple[SequenceParallelCausalLM, Any]:
    """(the model with every mechanism installed, its PEFT wrapper or None); which layers offload or keep
    outputs is set by `build_engine` once the plan after the engine is known."""
    cfg = prepared.cfg
    dtype = torch.bfloat16 if prepared.bf16 else torch.float32
    with torch.device(device):
        model = load_model(prepared.model_config, dtype, prepared.source, seed=cfg.seed)
    peft_model = None
    if cfg.use_peft:  # adapters before the mechanisms, which call the wrapped projections as modules
        model, peft_model = add_lora(model, cfg)
    # host_memory_gb None: the pool detects, with a margin
    mechanisms = prepared.resolved.model_setup(cfg.host_memory_gb, prepared.machine.ranks_per_node, levers=False,
                                          host_held_slots=prepared.host_held_slots)
    return parallelize(model, state, mechanisms), peft_model


def build_engine(prepared: PreparedRun, model: SequenceParallelCausalLM,
                 device: torch.device) -> tuple[Any, PreparedRun]:
    """(the DeepSpeed engine, the prepared run holding the plan the run runs from now). Collective: every rank
    checks the same plan digest here, before step 1, or stops with a PlanMismatchError."""
    cfg = prepared.cfg
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = prepared.optimizer.build(trainable) if prepared.optimizer is not None else None

    def schedule(opt):  # DeepSpeed hands over its base optimizer; it steps and saves the schedule
        return build_schedule(cfg, opt, prepared.total_steps)

    quiet_deepspeed_deprecations(model)  # torch's notice on DeepSpeed's own collectives, for the engine's life
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=prepared.ds_config,
                                           lr_scheduler=schedule)
    # Adam on the host: the parameters go back to the GPU through pinned buffers, beside the next sub-group's step
    PinnedCopyBack.install(engine.optimizer, say=model.state.is_main)
    machine = measured_machine(prepared, device)
    resolved = resolve_after_engine(prepared, machine)
    digest = check_same_plan(resolved, "with the free GPU memory measured")  # before step 1
    apply(model, resolved.model_setup(cfg.host_memory_gb, prepared.machine.ranks_per_node))
    return engine, replace(prepared, resolved=resolved, plan_digest=digest, machine=machine)


def measured_machine(prepared: PreparedRun, device: torch.device | str) -> Any:
    """The run's machine with the free GPU memory the engine left (the least of any rank's, so every rank
    re-plans alike); unchanged on a CPU job."""
    free = probe.free_gpu_memory_gb(device)  # None on every rank of a CPU job, a number on every GPU rank
    if free is None:
        return prepared.machine
    return replace(prepared.machine, gpu_free_after_engine_gb=agree_free_memory(free))


def resolve_after_engine(prepared: PreparedRun, machine: Any) -> Plan:
    """The plan's search again (plan/resolve.py) on `machine` (measured_machine): it differs from the first one
    only when a GPU holds less than the memory model expected; the first plan itself without a measurement."""
    if machine.gpu_free_after_engine_gb is None:
        return prepared.resolved
    # packed rows: attention timed from the same rows as the first plan (prepare.data_share), not one document a row
    return replan_after_engine(prepared.resolved, prepared.cfg, prepared.shape, machine, attention=prepared.attention)
