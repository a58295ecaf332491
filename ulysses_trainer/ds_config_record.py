"""The ZeRO JSON as run: DeepSpeed's own checks on it before the engine exists (`validate_with_deepspeed`), what
the trainer filled into the user's JSON (`filled_values`, the startup's `filled_line`), and the file in output_dir
that keeps it (DS_CONFIG_FILE). ds_config.py fills it."""

from __future__ import annotations

import copy
import json
from typing import Any

from .errors import ConfigError

_DS_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization.", "DeepSpeedBF16Config": "bf16.",
                "DeepSpeedFP16Config": "fp16.", "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing.",
                "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer.",
                "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param."}


def validate_with_deepspeed(ds: dict, source: str = "the ZeRO config") -> None:
    """Run DeepSpeed's own config checks (its pydantic models) now, not when the engine is built.

    The batch sizes are ours (checked above); DeepSpeedConfig derives its own from the world it sees.
    """
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    probe = copy.deepcopy(ds)
    probe.pop("train_batch_size", None)  # without a process group DeepSpeedConfig counts one rank
    try:
        DeepSpeedConfig(probe)
    except ValidationError as exc:
        section = _DS_SECTIONS.get(exc.title, "")
        problems = "; ".join(f"{section}{'.'.join(str(p) for p in e['loc'])} = "
                             f"{json.dumps(e.get('input'), default=str)}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"DeepSpeed rejects {source}: {problems}; fix or remove that field (see "
                          f"ds_configs/zero3.json)") from None
    except (ValueError, AssertionError, KeyError, TypeError) as exc:
        raise ConfigError(f"DeepSpeed rejects {source}: {type(exc).__name__}: {exc}; fix that field (see "
                          f"ds_configs/zero3.json)") from None


DS_CONFIG_FILE = "ds_config.json"  # in output_dir: the JSON the engine ran with
_QUIET = ("steps_per_print", "wall_clock_breakdown")  # the trainer logs; DeepSpeed's own step log stays off


def _leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        return {p: v for k, v in obj.items() for p, v in _leaves(v, f"{prefix}{k}.").items()}
    return {prefix.rstrip("."): obj}


def filled_values(raw: dict, filled: dict) -> tuple[dict[str, Any], list[str]]:
    """({dotted key: value} the trainer wrote where the user's JSON said "auto" or nothing, the sections it took
    out: a scheduler, an optimizer it builds itself). DeepSpeed's log settings are left out."""
    before, after = _leaves(raw), _leaves(filled)
    changed = {k: v for k, v in after.items() if (k not in before or before[k] != v) and k.split(".")[0] not in _QUIET}
    removed = [k for k in raw if k not in filled]
    return changed, removed


def filled_line(raw: dict, filled: dict, source: str) -> str:
    """One line: what the trainer filled into the ZeRO JSON `source`, and where the result is kept."""
    changed, removed = filled_values(raw, filled)
    parts = [f"{k} {json.dumps(v)}" for k, v in changed.items()]
    said = ", ".join(parts) if parts else "nothing"
    gone = f"; taken out: {', '.join(removed)} (the trainer's own)" if removed else ""
    return f"ZeRO config {source}, filled: {said}{gone}; as run: {DS_CONFIG_FILE} in output_dir"
