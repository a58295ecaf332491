"""What a training run says about itself (rank 0 calls these): the plan, the data, a stop request, the
predicted step time and peak against the measured ones at the end, and the record config.json keeps."""

from __future__ import annotations

import json
import logging

from ..config import config_to_dict
from ..messages import ON_STDERR
from ..plan.memory import UNDER_PREDICTION
from ..plan.types import Plan
from .metrics import peak_gpu_mem_gb, predicted_vs_measured
from .prepare import PreparedRun
from .resume_check import run_record

log = logging.getLogger(__name__)


def report_data(prepared: PreparedRun) -> None:
    if getattr(prepared.tokenizer, "stand_in", False):  # a preset's stand-in, not the model's own tokenizer: say so
        log.info(f"tokenizer: {prepared.tokenizer.name}")
    for what, data in (("data", prepared.train_data), ("eval data", prepared.eval_data)):
        counts = getattr(data, "counts", None)
        if counts is not None:
            log.info(f"{what}: {counts.summary()}")
    if prepared.zero_filled:
        log.info(prepared.zero_filled)
    if prepared.disk:
        log.info(prepared.disk)


def data_record(prepared: PreparedRun) -> dict:
    """The train and eval data's accounting, as config.json keeps it."""
    return {what: data.counts.to_dict() for what, data in (("train", prepared.train_data), ("eval", prepared.eval_data))
            if getattr(data, "counts", None) is not None}


def say_stopping(save_strategy: str) -> None:
    """The first stop request (from the signal handler): what the stop will do, one line. No step number: the
    ranks agree on the stop at the next boundary, and a request that lands while they agree on one belongs to
    the following one (the step is named once saved: `stop signal: saved step N`)."""
    line = "interrupted: saving at the next step boundary" if save_strategy != "no" else \
        "interrupted: stopping at the next step boundary, not saving (save_strategy no)"
    log.info(f"{line} (a second Ctrl-C stops at once; the last checkpoint stays)", extra=ON_STDERR)


def report_run_name(run_name: str | None) -> None:
    """The first line of a named run (run_name)."""
    if run_name:
        log.info(f"run {run_name}")


def report_plan(r: Plan, before_build: bool, digest: str) -> None:
    """The plan the run runs; digest: its digest, checked equal on every rank (train/agreement.py)."""
    log.info(f"plan{'' if before_build else ' with the free GPU memory measured'}: "
             f"{r.summary()}; digest {digest} on every rank")
    if r.decided:
        log.info(f"auto chose: {', '.join(r.decided)}")
    for note in r.notes:
        log.info(f"plan note: {note}")
    p = r.predicted
    if not p.fits:
        over = p.gpu_budget_gb is not None and p.gpu_required_gb > p.gpu_budget_gb * (1 + UNDER_PREDICTION)
        why = (f"allow_over_plan: over by more than the memory model's worst measured under-prediction "
               f"({UNDER_PREDICTION:.1%}); "
               f"the run will most likely stop out of GPU memory") if over else \
            (f"within the memory model's worst measured under-prediction ({UNDER_PREDICTION:.1%}), and it errs on the "
             f"high side: the run may still fit")
        log.warning(f"warning: the plan does not fit: {p.shortage()} ({why})")
    if r.levers.gradient_checkpointing:
        n, saved, off = r.num_layers, len(r.saved_layers), len(r.offload_layers)
        kept = f"1 in {r.levers.checkpoint_every} layers keeps its input" if r.levers.checkpoint_every > 1 else \
            "every layer keeps its input"
        log.info(f"checkpoints: {kept} ({saved}/{n}), {off} in pinned host memory "
              f"({r.checkpoint_bytes_per_layer * off / 2**30:.2f} GiB)")
        log.info(f"attention outputs kept for the recompute: {len(r.kept_attention_layers)}/{n} "
              "layers")


def replan_line(first: Plan, after: Plan, free_gb: float) -> str:
    """The after-engine phase in one line: the plan searched again with the GPU memory the engine left (`free_gb`,
    the least of any rank's) and what it changed of `first` (the settings under their config names)."""
    before, now = first.run.flat(), after.run.flat()
    changed = [f"{name} {before[name]} -> {now[name]}" for name in before if before[name] != now[name]]
    what = f"changed {', '.join(changed)}" if changed else "unchanged"
    return f"replanned after the engine ({free_gb:.1f} GiB GPU memory free on the fullest rank): {what}"


def report_replan(first: Plan, after: Plan, free_gb: float | None, digest: str) -> None:
    """After the engine is built, on a GPU run (free_gb measured): one line, and the whole plan again when it
    changed. A CPU run has no such phase."""
    if free_gb is None:
        return
    log.info(replan_line(first, after, free_gb))
    if after != first:  # the GPU holds less than expected
        report_plan(after, before_build=False, digest=digest)


def report_predicted_vs_measured(r: Plan, step_times: list[float]) -> None:
    """End of run: the plan's step time and GPU peak next to what the run measured."""
    p = r.predicted
    if p.step_s is None or not step_times:
        return
    log.info(predicted_vs_measured(p.step_s, p.peak_gpu_gb, step_times, peak_gpu_mem_gb()))


def run_config_record(prepared: PreparedRun, step: int, path: str) -> dict:
    """config.json's content: this run's config, layout and data accounting; on resume the earlier runs' configs
    (read from `path`) stay in its `history` with the step each change took effect."""
    record = {**run_record(config_to_dict(prepared.cfg), prepared.world_size, prepared.sp_size, prepared.dp_size),
              "data": data_record(prepared), "plan_digest": prepared.plan_digest, "history": []}
    try:
        with open(path) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        previous = None
    if prepared.resume_path and isinstance(previous, dict):
        history = previous.pop("history", []) if isinstance(previous.get("history"), list) else []
        record["history"] = history + [{"until_step": step, **previous,
                                        "changes_at_resume": {k: list(v) for k, v in prepared.config_changes.items()}}]
    return record
