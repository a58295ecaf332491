"""What a TrainConfig is given in TRL's spellings, decoded when it is made: each spelling becomes the field it
stands for (`dtype`, `gradient_checkpointing_kwargs.offload`, `padding_free`, `use_liger_kernel`, `max_steps -1`),
and a combination that would be accepted and have no effect is refused with the fix. Every problem is a
ConfigError (exit 2). The same value given twice, once in each spelling, is no conflict."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..errors import ConfigError

_LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "peft_config", "merge_lora")


def decode_trl_spellings(cfg: Any) -> None:
    """Sets, on a TrainConfig being made, the fields TRL's spellings stand for; refuses what would be ignored."""
    if cfg.max_steps == -1:
        cfg.max_steps = None
    gck = cfg.gradient_checkpointing_kwargs
    if gck is not None:
        bad = sorted(set(gck) - {"offload", "use_reentrant"})
        if bad:
            raise ConfigError(f"gradient_checkpointing_kwargs: unknown keys {bad}; accepted: offload (bool), "
                              f"use_reentrant")
        if "offload" in gck:
            if not isinstance(gck["offload"], bool):
                raise ConfigError(f"gradient_checkpointing_kwargs.offload must be true or false, "
                                  f"got {gck['offload']!r}")
            cfg.activation_offload = _same_or_auto("activation_offload", cfg.activation_offload,
                                                    gck["offload"], "gradient_checkpointing_kwargs.offload")
    if cfg.dtype is not None and cfg.dtype != "auto":
        if cfg.dtype == "float16":
            raise ConfigError("dtype float16 is not supported (fp16 needs loss scaling); use bfloat16")
        cfg.bf16 = _same_or_auto("bf16", cfg.bf16, cfg.dtype == "bfloat16", f"dtype {cfg.dtype}")
    _trl_options(cfg)
    if cfg.eval_strategy == "no":
        cfg.eval_steps = None
    elif cfg.eval_strategy == "steps" and cfg.eval_steps is None:
        cfg.eval_steps = cfg.logging_steps
    elif cfg.eval_strategy == "epoch" and cfg.eval_steps is not None:
        raise ConfigError(f"eval_strategy epoch evaluates at each epoch end, but eval_steps is "
                          f"{cfg.eval_steps}; set only one of them")


def _trl_options(cfg: Any) -> None:
    """TRL options that stand for one of our settings (the rest are read where they act)."""
    if cfg.padding_free:  # TRL: padding-free = packed examples, attention kept within each one
        cfg.packing = True
    if cfg.use_liger_kernel:
        if not cfg.lean_norm:
            raise ConfigError("use_liger_kernel true uses Liger's RMSNorm through the lean norms; "
                              "set lean_norm true (or use_liger_kernel false)")
        cfg.norm_kernel = _same_or_auto("norm_kernel", cfg.norm_kernel, "triton", "use_liger_kernel true")
    if not cfg.save_safetensors:
        raise ConfigError("save_safetensors false is not supported: final/ is always written as safetensors; "
                          "remove save_safetensors")
    if not (0.0 <= cfg.warmup_ratio <= 1.0):
        raise ConfigError(f"warmup_ratio must be in [0, 1], got {cfg.warmup_ratio}")
    if not cfg.use_peft:  # LoRA settings without LoRA would be accepted and ignored
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        unused = [n for n in _LORA_FIELDS if getattr(cfg, n) != defaults[n]]
        if unused:
            raise ConfigError(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without "
                              f"use_peft true (every weight is trained); set use_peft true or remove "
                              f"{'it' if len(unused) == 1 else 'them'}")
    # (save_strategy / logging_strategy no over a recipe's intervals is a dry run's override: let through)
    if cfg.save_strategy == "epoch" and cfg.save_steps is not None:
        raise ConfigError(f"save_steps {cfg.save_steps} has no effect with save_strategy {cfg.save_strategy}; "
                          f"set save_strategy steps or remove save_steps")
    if cfg.logging_strategy == "epoch" and cfg.logging_steps != 1:
        raise ConfigError(f"logging_steps {cfg.logging_steps} has no effect with logging_strategy "
                          f"{cfg.logging_strategy}; set logging_strategy steps or remove logging_steps")
    if cfg.logging_strategy == "no" and cfg.logging_first_step:
        raise ConfigError("logging_first_step true has no effect with logging_strategy no; remove one of them")
    if cfg.dataset_num_proc is not None and cfg.dataset_num_proc < 1:
        raise ConfigError(f"dataset_num_proc must be >= 1 (or null), got {cfg.dataset_num_proc}")
    if cfg.save_only_model and cfg.save_strategy == "no":
        raise ConfigError("save_only_model true has no effect with save_strategy no (no checkpoint is written); "
                          "remove one of them")
    if cfg.run_name is not None and (not cfg.run_name.strip() or "/" in cfg.run_name
                                      or cfg.run_name in (".", "..")):
        raise ConfigError(f"run_name {cfg.run_name!r} must be a non-empty name without '/' (it names "
                          f"output_dir/runs/RUN_NAME/)")


def _same_or_auto(name: str, current: Any, wanted: Any, spelling: str) -> Any:
    """`wanted` for a field left at auto (or already equal); a contradiction is an error."""
    if current == "auto" or current == wanted and type(current) is type(wanted):
        return wanted
    raise ConfigError(f"{spelling} asks for {name} {json.dumps(wanted)} but {name} is {json.dumps(current)}; "
                      f"set only one of them")
