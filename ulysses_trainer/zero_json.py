"""The ZeRO JSON as DeepSpeed reads it: one reader for the planner (plan/types.read_zero), the filler
(ds_config.py) and the rehearsal, and the keys this trainer refuses before any work.

DeepSpeed loads a config file with hjson (JSON plus comments and trailing commas) and refuses a key written twice
(deepspeed/runtime/config.py: `hjson.load(..., object_pairs_hook=dict_raise_error_on_duplicate_keys)`); so does
this reader. DeepSpeed silently ignores a top-level key it does not know, so a misspelt one would do nothing: it is
refused here, naming the key it probably meant. Torch-free: DeepSpeed's own config models (the zero_optimization
names) are imported only where a zero_optimization key is checked.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

from .errors import ConfigError, close_name

AUTO = "auto"

# Every top-level key DeepSpeed 0.19 reads (DeepSpeedConfig, the engine, the launcher's autotuner);
# tests/test_zero_json.py checks that every key DeepSpeedConfig looks up is here.
DEEPSPEED_TOP_LEVEL = frozenset({
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint", "comet",
    "comms_logger", "communication_data_type", "compile", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "data_types", "dataloader_drop_last", "datastates_ckpt",
    "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity", "expert_parallel",
    "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping",
    "gradient_predivide_factor", "graph_harvesting", "hybrid_engine", "legacy_fusion", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "nebula", "optimizer", "pipeline", "prescale_gradients",
    "progressive_layer_drop", "quantize_training", "scheduler", "seq_parallel_communication_data_type",
    "sequence_parallel_size", "sparse_attention", "sparse_gradients", "steps_per_print", "tensor_parallel",
    "tensorboard", "timers", "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism", "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization",
})

# ZeRO JSON keys the trainer fills from the training config -> the setting(s) to use instead
FILLED_FROM = {"gradient_clipping": "max_grad_norm", "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
               "train_batch_size": "per_device_train_batch_size (x gradient_accumulation_steps x dp)",
               "optimizer": "learning_rate, adam_beta1, adam_beta2, adam_epsilon, weight_decay",
               "scheduler": "lr_scheduler_type, warmup_steps"}

# DeepSpeedZeroConfig's defaults for the sizes the plan reads (a key left out runs with these; a test ties them to
# DeepSpeed's model). "auto" is the trainer's fill instead (vocabulary/names.ZERO_AUTO_SIZES: per hidden size).
DEEPSPEED_ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                           "stage3_param_persistence_threshold": 100_000,
                           "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                           "sub_group_size": 1_000_000_000}

_ACTIVATION_CHECKPOINTING_FIX = (
    "this trainer checkpoints every decoder layer itself (gradient_checkpointing, checkpoint_every) and keeps "
    "layer inputs in pinned host memory with activation_offload (true, N layers or auto); remove the "
    "activation_checkpointing section and set those in the recipe")
_OFFLOAD_PARAM_FIX = (
    "the plan does not model ZeRO-Infinity parameter offload (neither the memory it frees nor the host<->GPU "
    "copies of every parameter in each forward and backward), so its step time and memory would be unchecked. "
    "This trainer keeps the bf16 parameters on the GPUs, partitioned over all ranks; to free GPU memory use "
    "optimizer_offload (Adam's states on the host), activation_offload, or more GPUs (sp_size). Remove "
    "offload_param (or set its device to \"none\")")


class _Duplicate(ValueError):
    def __init__(self, keys: list[str]) -> None:
        super().__init__(keys)
        self.keys = keys


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    """DeepSpeed's object_pairs_hook (runtime/config_utils.dict_raise_error_on_duplicate_keys): a key written
    twice in one object is refused, not silently the last value."""
    out = dict(pairs)
    if len(out) != len(pairs):
        counts = Counter(k for k, _ in pairs)
        raise _Duplicate(sorted(k for k, n in counts.items() if n > 1))
    return out


def parse_zero_json(text: str, source: str) -> dict:
    """The ZeRO JSON's text read as DeepSpeed reads a config file (hjson, duplicate keys refused)."""
    import hjson

    try:
        data = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        keys = ", ".join(repr(k) for k in exc.keys)
        raise ConfigError(f"ZeRO config {source} writes {keys} twice in one object; DeepSpeed refuses duplicate "
                          f"keys (it would not guess which one you meant): keep one") from None
    except hjson.HjsonDecodeError as exc:
        raise ConfigError(f"ZeRO config {source} is not valid at line {exc.lineno}, column {exc.colno}: {exc.msg} "
                          f"(it is read as DeepSpeed reads it: JSON, plus comments and trailing commas); fix the "
                          f"syntax there") from None
    if not isinstance(data, dict):
        raise ConfigError(f"ZeRO config {source} must be a JSON object, got {type(data).__name__}")
    return data


def resolve_ds_path(path: str, package_dir: Path) -> Path:
    """The JSON path as given, else the package's copy of a shipped one (recipes say ds_configs/zero3.json):
    the same file in a checkout and in an installed package."""
    p = Path(path)
    if p.is_file() or p.is_absolute():
        return p
    alt = package_dir / p
    return alt if alt.is_file() else p


def read_zero_json(path: str | dict, package_dir: Path) -> dict:
    """A ZeRO JSON (a path, or the mapping a recipe gives) read and its keys checked (check_zero_keys)."""
    if isinstance(path, dict):
        data, source = copy.deepcopy(path), "the ZeRO config"
    else:
        p = resolve_ds_path(path, package_dir)
        if not p.is_file():
            raise ConfigError(f"ZeRO config {path!r} not found; set `deepspeed` to a JSON file such as "
                              f"ds_configs/zero3.json or ds_configs/zero3_offload.json")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read ZeRO config {p}: {exc}") from None
        data, source = parse_zero_json(text, str(p)), str(p)
    check_zero_keys(data, source)
    return data


# ---------------------------------------------------------------- the keys
def _zero_names() -> dict[str, frozenset[str]]:
    """The names DeepSpeed's zero_optimization models take (field names and their aliases), per section."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    def names(model: Any) -> frozenset[str]:
        return frozenset(n for name, f in model.model_fields.items() for n in (name, f.alias) if n)

    return {"zero_optimization": names(DeepSpeedZeroConfig),
            "zero_optimization.offload_optimizer": names(DeepSpeedZeroOffloadOptimizerConfig),
            "zero_optimization.offload_param": names(DeepSpeedZeroOffloadParamConfig)}


def _unknown(key: str, where: str, known: frozenset[str], source: str, ignored: bool) -> ConfigError:
    close = close_name(key, sorted(known))
    what = f"{where}.{key}" if where else key
    hint = f"did you mean {close!r}?" if close else "remove it"
    effect = ("DeepSpeed ignores a key it does not know, so it would silently do nothing" if ignored
              else "DeepSpeed refuses it")
    return ConfigError(f"unknown key {what!r} in ZeRO config {source}: {hint} ({effect})")


def check_zero_keys(ds: dict, source: str) -> None:
    """Refuse, before any work, what DeepSpeed would ignore or this trainer would not honour: an unknown key
    (top level, zero_optimization and its offload sections; the likely key named), fp16 or amp, DeepSpeed's
    activation_checkpointing settings, parameter offload, an optimizer offloaded to NVMe."""
    for key in ds:
        if key not in DEEPSPEED_TOP_LEVEL:
            raise _unknown(key, "", DEEPSPEED_TOP_LEVEL, source, ignored=True)
    fp16 = ds.get("fp16")
    if isinstance(fp16, dict) and fp16.get("enabled", False) not in (False, AUTO):
        raise ConfigError(f"fp16.enabled is true in {source}; fp16 is not supported (use bf16: set "
                          f"fp16.enabled false or \"auto\", and bf16 true in the recipe)")
    amp = ds.get("amp")
    if isinstance(amp, dict) and amp.get("enabled"):
        raise ConfigError(f"amp.enabled is true in {source}; use bf16 instead (set amp.enabled false)")
    ac = ds.get("activation_checkpointing")
    if ac is not None:
        on = sorted(k for k, v in ac.items() if v) if isinstance(ac, dict) else ["(the section)"]
        if on:
            raise ConfigError(f"activation_checkpointing ({', '.join(on)}) in {source} configures DeepSpeed's "
                              f"checkpointing API (deepspeed.checkpointing, for Megatron-style models), which this "
                              f"trainer never calls: it would do nothing. {_ACTIVATION_CHECKPOINTING_FIX}")
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    known = _zero_names()
    for key in zero:
        if key not in known["zero_optimization"]:
            raise _unknown(key, "zero_optimization", known["zero_optimization"], source, ignored=False)
    for sub in ("offload_optimizer", "offload_param"):
        section = zero.get(sub)
        if isinstance(section, dict):
            where = f"zero_optimization.{sub}"
            for key in section:
                if key not in known[where]:
                    raise _unknown(key, where, known[where], source, ignored=False)
    both = [(alias, name) for alias, name in _SIZE_NAMES.items() if alias in zero and name in zero]
    if both:
        alias, name = both[0]
        raise ConfigError(f"zero_optimization has both {alias!r} and {name!r} in {source}: DeepSpeed takes "
                          f"either name for one setting; keep one")
    param = zero.get("offload_param")
    if isinstance(param, dict) and param.get("device", "none") not in ("none", None):
        raise ConfigError(f"zero_optimization.offload_param (device {json.dumps(param.get('device'))}) in "
                          f"{source}: {_OFFLOAD_PARAM_FIX}")
    opt = zero.get("offload_optimizer")
    if isinstance(opt, dict) and opt.get("device") == "nvme":
        raise ConfigError(f"zero_optimization.offload_optimizer device \"nvme\" in {source}: the plan models "
                          f"optimizer offload to host memory only; set its device to \"cpu\"")


# DeepSpeed's alias (what the shipped JSONs write) -> its field name; either spelling sets the setting
_SIZE_NAMES = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
               "stage3_param_persistence_threshold": "param_persistence_threshold",
               "stage3_max_live_parameters": "max_live_parameters",
               "stage3_max_reuse_distance": "max_reuse_distance"}


def zero_key(zero: dict, key: str) -> str:
    """The spelling of a zero_optimization setting this JSON uses: `key` (DeepSpeed's alias, as the shipped JSONs
    write it) or DeepSpeed's field name for it; `key` where neither is written."""
    other = _SIZE_NAMES.get(key)
    return other if other is not None and key not in zero and other in zero else key


def zero_size(zero: dict, key: str, source: str = "the ZeRO config") -> int | None:
    """A ZeRO-3 size as DeepSpeed will run it, in elements: the value written (either spelling), DeepSpeed's
    default where the key is left out, None for "auto" (the trainer fills it per hidden size:
    vocabulary/names.ZERO_AUTO_SIZES)."""
    v = zero.get(zero_key(zero, key), DEEPSPEED_ZERO_DEFAULTS[key])
    if v == AUTO:
        return None
    try:
        return int(float(v))
    except (TypeError, ValueError):
        raise ConfigError(f"zero_optimization.{zero_key(zero, key)} is {json.dumps(v)} in {source}; write a number "
                          f"of elements (or \"auto\" where the trainer fills it)") from None
