"""verify_sp in a run (the check itself: verify_sp.py): whether a copy of the model and its gradients fits beside the
run (`auto`), the copy built as the engine's model is, and the first row step 1 trains."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..model.load import build_model as load_model
from ..model.lora import add_lora
from ..parallel.state import ParallelState
from . import data_order as order
from .agreement import agree_free_memory
from .prepare import PreparedRun
from .verify_sp import run_check

log = logging.getLogger(__name__)

VERIFY_FREE_SHARE = 0.8  # verify_sp auto: the copy may take this share of the memory free on every rank


def free_memory_bytes(device: torch.device) -> int:
    """Memory free now where the check's copy would live: the GPU's, or the host's on a CPU run."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def verify_run(prepared: PreparedRun, engine_model: nn.Module, state: ParallelState, device: torch.device) -> None:
    """The parallelized model against the stock one on the first row (verify_sp.run_check), on the weights of
    `engine_model` (the engine's causal LM): a line in the startup log, or a VerifySpError (exit 2). Collective."""
    cfg = prepared.cfg
    dtype = torch.bfloat16 if prepared.bf16 else torch.float32

    def new_model() -> nn.Module:  # as build_model makes it, without initializing (run_check copies every
        # parameter and buffer from the engine's model): 8 s of random init for the tiny preset on CPU
        with torch.device("meta"):
            model = load_model(prepared.model_config, dtype, None, seed=cfg.seed)
            model = add_lora(model, cfg)[0] if cfg.use_peft else model
        model = model.to_empty(device=device)
        model.tie_weights()  # to_empty makes a tied embedding's two uses two tensors
        return model

    # auto runs it where a copy of the model and its gradients fits beside the run (the copy is whole on every
    # rank: a 35B model's would not fit a GPU the run already fills); true insists
    need = prepared.shape.num_params * (2 if prepared.bf16 else 4) * 2
    free = agree_free_memory(free_memory_bytes(device))  # the least of any rank's: every rank decides alike
    if cfg.verify_sp == "auto" and need > VERIFY_FREE_SHARE * free:
        if state.is_main:
            log.info(f"verify_sp: skipped: a copy of the model and its gradients ({need / 2**30:.1f} GiB) does "
                     f"not fit beside the run ({free / 2**30:.1f} GiB free); verify_sp true insists")
        return
    mechanisms = prepared.resolved.model_setup(cfg.host_memory_gb, prepared.machine.ranks_per_node, levers=False,
                                          host_held_slots=prepared.host_held_slots)
    row = prepared.train_data[int(order.step_rows(prepared, 0)[0])]  # the first row step 1 trains
    pad = getattr(prepared.tokenizer, "pad_token_id", None) or 0
    result = run_check(engine_model, new_model, mechanisms, state, row, prepared.bf16, cfg.pad_to_multiple_of,
                       cfg.max_length, device, pad)
    if state.is_main:
        log.info(result.line() if result is not None else "verify_sp: skipped (the first row is too short to shard)")
