"""Resume: the run's config against the one that wrote the checkpoint.

A resumed run reproduces the uninterrupted one bitwise only if everything that decides the model, the
data, their order and the numerics is the same. Such a change is refused, naming both values, unless
`allow_config_change` is true. Settings that change memory or bookkeeping, not results, go through;
each change is recorded (events.jsonl, config.json's history) at the step it took effect.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ConfigError

# changes that keep a resumed run's results those of the uninterrupted run (memory levers are tested to
# change memory only); any field not listed here breaks exactness
HARMLESS = frozenset({
    "output_dir", "max_shard_size",
    "logging_steps", "save_steps", "save_strategy", "save_total_limit", "eval_steps", "max_eval_samples",
    "per_device_eval_batch_size", "eval_dataset_name", "dataset_test_split", "report_to",
    "plot_per_position_loss", "eval_recall_probe", "nan_policy", "deepspeed",
    "logging_strategy", "logging_first_step", "run_name", "save_only_model", "eval_strategy", "dataset_num_proc",
    "attn_implementation", "gradient_checkpointing", "checkpoint_every", "activation_offload",
    "keep_attention_outputs", "tiled_mlp", "lean_norm", "norm_kernel", "optimizer_offload", "host_memory_gb",
    "loss_type", "loss_chunk_size",
})
# changes that go through but change what follows; the note says how
NOTED = {
    "learning_rate": "the schedule continues from this step with the new peak learning rate",
    "max_steps": "the data order continues where it stopped; the schedule is rebuilt for the new number of steps",
    "num_train_epochs": "the data order continues where it stopped; the schedule is rebuilt for the new number "
                        "of steps",
}
LAYOUT = ("world_size", "sp_size", "dp_size")
# how this run was started, not what it trains: never compared
# how this start of the run begins, not what it trains: verify_sp runs once before step 1 on a private copy (auto:
# off at a resume), and no number of the run moves with it (tests/test_e2e_train.py)
NOT_COMPARED = frozenset({"resume_from_checkpoint", "allow_config_change", "overwrite_output_dir",
                          "allow_beyond_positions", "verify_sp"})


def run_record(config: dict[str, Any], world_size: int, sp_size: int, dp_size: int) -> dict[str, Any]:
    """What a checkpoint stores about the run that wrote it (run_config.json)."""
    return {"config": config, "layout": {"world_size": world_size, "sp_size": sp_size, "dp_size": dp_size}}


def read_run_record(checkpoint: str) -> dict[str, Any] | None:
    """The checkpoint's run_config.json, or None for a checkpoint written before it existed."""
    path = os.path.join(checkpoint, "run_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"resume_from_checkpoint: cannot read {path} ({exc}); pass an intact checkpoint") \
            from None


def compare(saved: dict[str, Any], ours: dict[str, Any]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """({name: (checkpoint's, this run's)} that break exactness, {name: (old, new)} that do not)."""
    breaking, harmless = {}, {}
    old_cfg, new_cfg = saved.get("config", {}), ours["config"]
    for name in sorted(set(old_cfg) | set(new_cfg)):
        a, b = old_cfg.get(name), new_cfg.get(name)
        # (a field the checkpoint's version had and this one dropped is skipped too)
        if a == b or name not in new_cfg or name in NOT_COMPARED:
            continue
        (harmless if name in HARMLESS or name in NOTED else breaking)[name] = (a, b)
    for name in LAYOUT:
        a, b = saved.get("layout", {}).get(name), ours["layout"][name]
        if a is not None and a != b:
            breaking[name] = (a, b)
    return breaking, harmless


def check_resume_config(checkpoint: str, ours: dict[str, Any], allow_change: bool) -> dict[str, tuple]:
    """Refuse a change that breaks exactness (ConfigError, exit 2) unless allowed; returns every change
    that goes through ({name: (old, new)}), for the record."""
    saved = read_run_record(checkpoint)
    if saved is None:
        return {}
    breaking, harmless = compare(saved, ours)
    if breaking and not allow_change:
        shown = "; ".join(f"{n}: {json.dumps(a)} in the checkpoint, {json.dumps(b)} now"
                          for n, (a, b) in breaking.items())
        raise ConfigError(f"resume_from_checkpoint: {checkpoint} was written with other settings that change "
                          f"the results ({shown}); resume with the checkpoint's values, or set "
                          f"allow_config_change true to continue anyway (the run is then no longer the "
                          f"uninterrupted one)")
    return {**breaking, **harmless}


def notes(changes: dict[str, tuple]) -> list[str]:
    """One line per change that goes through."""
    out = []
    for name, (a, b) in changes.items():
        why = NOTED.get(name, "does not change the results" if name in HARMLESS else
                        "changes the results (allow_config_change true)")
        out.append(f"{name} {json.dumps(a)} -> {json.dumps(b)}: {why}")
    return out
