"""What a training run says about itself (rank 0 calls these): the plan, the data, a stop request, the
predicted step time and peak against the measured ones at the end, and the record config.json keeps."""

from __future__ import annotations

import json
import sys

from ..config import config_to_dict
from ..plan.memory import UNDER_PREDICTION
from ..plan.types import Plan
from .metrics import peak_gpu_mem_gb, predicted_vs_measured
from .prepare import RunPlan
from .resume_check import run_record


def report_data(plan: RunPlan) -> None:
    for what, data in (("data", plan.train_data), ("eval data", plan.eval_data)):
        counts = getattr(data, "counts", None)
        if counts is not None:
            print(f"[ulysses_trainer] {what}: {counts.summary()}", flush=True)
    if plan.disk:
        print(f"[ulysses_trainer] {plan.disk}", flush=True)


def data_record(plan: RunPlan) -> dict:
    """The train and eval data's accounting, as config.json keeps it."""
    return {what: data.counts.to_dict() for what, data in (("train", plan.train_data), ("eval", plan.eval_data))
            if getattr(data, "counts", None) is not None}


def say_stopping(next_step: int, save_strategy: str) -> None:
    """The first stop request (from the signal handler): what the stop will do, one line."""
    line = f"interrupted: saving step {next_step}" if save_strategy != "no" else \
        f"interrupted: stopping after step {next_step}, not saving (save_strategy no)"
    print(f"[ulysses_trainer] {line} (a second Ctrl-C stops at once; the last checkpoint stays)",
          file=sys.stderr, flush=True)


def report_run_name(run_name: str | None) -> None:
    """The first line of a named run (run_name)."""
    if run_name:
        print(f"[ulysses_trainer] run {run_name}", flush=True)


def report_plan(r: Plan, before_build: bool) -> None:
    print(f"[ulysses_trainer] plan{'' if before_build else ' with the free GPU memory measured'}: "
          f"{r.summary()}", flush=True)
    if r.decided:
        print(f"[ulysses_trainer] auto chose: {', '.join(r.decided)}", flush=True)
    for note in r.notes:
        print(f"[ulysses_trainer] plan note: {note}", flush=True)
    if not r.fits:
        over = r.gpu_budget_gb is not None and r.predicted_gpu_required_gb > r.gpu_budget_gb * (1 + UNDER_PREDICTION)
        why = (f"allow_over_plan: over by more than the memory model's worst measured under-prediction "
               f"({UNDER_PREDICTION:.1%}); "
               f"the run will most likely stop out of GPU memory") if over else \
            (f"within the memory model's worst measured under-prediction ({UNDER_PREDICTION:.1%}), and it errs on the "
             f"high side: the run may still fit")
        print(f"[ulysses_trainer] warning: the plan does not fit: {r.shortage()} ({why})", flush=True)
    if r.gradient_checkpointing:
        n, saved, off = r.num_layers, len(r.saved_layers), len(r.offload_layers)
        kept = f"1 in {r.checkpoint_every} layers keeps its input" if r.checkpoint_every > 1 else \
            "every layer keeps its input"
        print(f"[ulysses_trainer] checkpoints: {kept} ({saved}/{n}), {off} in pinned host memory "
              f"({r.checkpoint_bytes_per_layer * off / 2**30:.2f} GiB)", flush=True)
        print(f"[ulysses_trainer] attention outputs kept for the recompute: {len(r.kept_attention_layers)}/{n} "
              "layers", flush=True)


def report_predicted_vs_measured(r: Plan, step_times: list[float]) -> None:
    """End of run: the plan's step time and GPU peak next to what the run measured."""
    if r.predicted_step_s is None or not step_times:
        return
    print(predicted_vs_measured(r.predicted_step_s, r.predicted_peak_gpu_gb, step_times, peak_gpu_mem_gb()),
          flush=True)


def run_config_record(plan: RunPlan, step: int, path: str) -> dict:
    """config.json's content: this run's config, layout and data accounting; on resume the earlier runs' configs
    (read from `path`) stay in its `history` with the step each change took effect."""
    record = {**run_record(config_to_dict(plan.cfg), plan.world_size, plan.sp_size, plan.dp_size),
              "data": data_record(plan), "history": []}
    try:
        with open(path) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        previous = None
    if plan.resume_path and isinstance(previous, dict):
        history = previous.pop("history", []) if isinstance(previous.get("history"), list) else []
        record["history"] = history + [{"until_step": step, **previous,
                                        "changes_at_resume": {k: list(v) for k, v in plan.config_changes.items()}}]
    return record
