"""ZeRO JSON: load it, fill every "auto" from the training config, and refuse conflicts.

The trainer passes no mpu to DeepSpeed, so DeepSpeed counts every rank as data-parallel: its
train_batch_size is micro × gas × world_size. Users think in sequences per optimizer step
(micro × gas × dp_size), so a train_batch_size written in the JSON is read that way.

The learning-rate schedule is always the trainer's (it needs the epoch length, resumes exactly and
logs the rate), so a "scheduler" section is checked against the training config and removed.
The optimizer section stays with DeepSpeed only where its Adam op can build (CUDA); elsewhere it is
removed and returned as an OptimizerSpec for the trainer to build torch.optim.AdamW.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import FIELDS, PACKAGE_DIR, TrainConfig
from .ds_config_record import validate_with_deepspeed
from .errors import ConfigError
from .vocabulary.names import ZERO_AUTO_SIZES, check_zero_stage, offload_sub_group_size
from .zero_json import check_zero_keys, read_zero_json, zero_key
from .zero_json import resolve_ds_path as _resolve_ds_path

AUTO = "auto"


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW settings for the trainer to build itself (where DeepSpeed's Adam is not used)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    def build(self, params: Any) -> torch.optim.AdamW:
        params = list(params)
        fused = bool(params) and all(p.is_cuda for p in params)  # one CUDA kernel, no JIT build
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                 weight_decay=self.weight_decay, fused=fused)


def resolve_ds_path(path: str) -> Path:
    """The JSON path as given, else the package's copy of a shipped one (zero_json.resolve_ds_path)."""
    return _resolve_ds_path(path, PACKAGE_DIR)


def load_ds_config(path: str | dict) -> dict:
    """Read a ZeRO JSON as DeepSpeed reads it (zero_json.read_zero_json: hjson, duplicate keys refused) and refuse
    the keys DeepSpeed would ignore or this trainer would not honour; a ConfigError naming the fix."""
    return read_zero_json(path, PACKAGE_DIR)


def deepspeed_adam_buildable(offload_optimizer: bool) -> bool:
    """Whether DeepSpeed's own Adam (CPUAdam when offloaded, FusedAdam otherwise) can load or JIT-build."""
    try:
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
    except Exception:  # DeepSpeed ops missing entirely
        return False
    builder = CPUAdamBuilder() if offload_optimizer else FusedAdamBuilder()
    if installed_ops.get(builder.NAME, False):
        return True
    if not builder.is_compatible(verbose=False):
        return False
    if offload_optimizer:
        return shutil.which("c++") is not None or shutil.which("g++") is not None
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").exists()


class _Filler:
    """Fills one key at a time; an explicit value that disagrees with the training config is an error naming where
    the training config's value came from (the recipe, the command line or the default: TrainConfig.origin)."""

    def __init__(self, ds: dict, path: str, cfg: TrainConfig) -> None:
        self.ds, self.path, self.cfg = ds, path, cfg

    def _from(self, cfg_name: str) -> str:
        names = [n for n in FIELDS if n == cfg_name or f"[{n}," in cfg_name or f" {n}]" in cfg_name]
        origins = list(dict.fromkeys(self.cfg.origin(n) for n in names))  # [adam_beta1, adam_beta2]: both
        return " and ".join(origins) if origins else "the trainer"

    def _fix(self, cfg_name: str, have: Any) -> str:
        origin, value = self._from(cfg_name), json.dumps(have)
        if origin == "the command line":
            return f"pass --{cfg_name} {value} on the command line"
        if origin.startswith("recipe ") and " and " not in origin:
            return f"set {cfg_name} {value} in {origin}"
        return f"set {cfg_name} {value} in the recipe or on the command line"

    def fill(self, section: dict, key: str, want: Any, where: str, cfg_name: str, fix: str | None = None,
             equal: Any = None) -> None:
        have = section.get(key, AUTO)
        if have == AUTO:
            section[key] = want
            return
        same = equal(have, want) if equal else have == want
        if not same:
            raise ConfigError(
                f"{where} is {json.dumps(have)} in {self.path} but the training config gives {cfg_name} = "
                f"{json.dumps(want)} (from {self._from(cfg_name)}); set it to \"auto\" in the JSON or "
                f"{fix or self._fix(cfg_name, have)}")


def _close(a: Any, b: Any) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    except (TypeError, ValueError):
        return False


def _betas_equal(a: Any, b: Any) -> bool:
    return isinstance(a, (list, tuple)) and len(a) == 2 and all(_close(x, y) for x, y in zip(a, b))


_SCHEDULERS = {"WarmupDecayLR": "linear", "WarmupLR": "constant_with_warmup"}


def _fill_batch(ds: dict, f: _Filler, cfg: TrainConfig, world_size: int, dp_size: int, source: str) -> None:
    micro, gas = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    f.fill(ds, "train_micro_batch_size_per_gpu", micro, "train_micro_batch_size_per_gpu",
           "per_device_train_batch_size")
    f.fill(ds, "gradient_accumulation_steps", gas, "gradient_accumulation_steps",
           "gradient_accumulation_steps")
    sequences = micro * gas * dp_size  # per optimizer step, over dp ranks (sp ranks share a sequence)
    user_tbs = ds.get("train_batch_size", AUTO)
    if user_tbs != AUTO and user_tbs != sequences:
        raise ConfigError(
            f"train_batch_size is {json.dumps(user_tbs)} in {source} but the training config gives "
            f"{sequences} sequences per optimizer step (per_device_train_batch_size {micro} x "
            f"gradient_accumulation_steps {gas} x dp {dp_size}; sp ranks share a sequence); "
            f"set it to \"auto\"")
    ds["train_batch_size"] = micro * gas * world_size  # DeepSpeed sees every rank as data-parallel


def _fill_precision(ds: dict, f: _Filler, cfg: TrainConfig, bf16: bool, source: str) -> None:
    """Clipping and precision: bf16 (as the plan decided it, Machine.bf16) or fp32, never fp16 or amp."""
    f.fill(ds, "gradient_clipping", cfg.max_grad_norm, "gradient_clipping", "max_grad_norm", equal=_close)
    bf16_key = "bfloat16" if "bfloat16" in ds and "bf16" not in ds else "bf16"
    bf16_sec = ds.setdefault(bf16_key, {})
    if not isinstance(bf16_sec, dict):
        raise ConfigError(f"{bf16_key} in {source} must be an object like {{\"enabled\": \"auto\"}}")
    f.fill(bf16_sec, "enabled", bf16, f"{bf16_key}.enabled", "bf16")
    fp16 = ds.get("fp16", {})  # enabled true or amp was refused with the keys (zero_json.check_zero_keys)
    if isinstance(fp16, dict) and fp16:
        fp16["enabled"] = False


def _fill_zero(ds: dict, hidden_size: int | None, optimizer_offload: bool | None, source: str) -> bool:
    """ZeRO-3's "auto" sizes (vocabulary/names.ZERO_AUTO_SIZES) and the plan's optimizer offload; whether Adam is
    offloaded."""
    zero = ds.get("zero_optimization", {})
    check_zero_stage(zero, source)
    if not isinstance(zero, dict):
        return False
    for name, rule in ZERO_AUTO_SIZES.items():
        key = zero_key(zero, name)  # DeepSpeed takes the alias or the field name
        if zero.get(key) == AUTO:
            if hidden_size:
                zero[key] = rule(hidden_size)
            else:
                del zero[key]  # DeepSpeed's default
    if optimizer_offload and zero.get("offload_optimizer") is None:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["sub_group_size"] = offload_sub_group_size(zero.get("sub_group_size"))
    off = zero.get("offload_optimizer")
    return isinstance(off, dict) and off.get("device", "none") not in ("none", None)


def _fill_optimizer(ds: dict, f: _Filler, spec: OptimizerSpec, source: str) -> None:
    """An "optimizer" section must be AdamW, its settings the training config's."""
    opt = ds.get("optimizer")
    if opt is None:
        return
    if not isinstance(opt, dict) or str(opt.get("type", "")).lower() not in ("adamw", "adam"):
        kind = opt.get("type") if isinstance(opt, dict) else opt
        raise ConfigError(f"optimizer type {json.dumps(kind)} in {source} is not supported; use "
                          f"\"AdamW\" (its settings come from learning_rate, adam_beta1/2, adam_epsilon, "
                          f"weight_decay)")
    if str(opt["type"]).lower() == "adam" and opt.get("params", {}).get("adam_w_mode") is False:
        raise ConfigError(f"optimizer Adam with adam_w_mode false in {source} is not supported; "
                          f"use AdamW")
    params = opt.setdefault("params", {})
    f.fill(params, "lr", spec.lr, "optimizer.params.lr", "learning_rate", equal=_close)
    f.fill(params, "betas", list(spec.betas), "optimizer.params.betas", "[adam_beta1, adam_beta2]",
           fix=f"set adam_beta1 and adam_beta2 to those values (from {f._from('[adam_beta1, adam_beta2]')})",
           equal=_betas_equal)
    f.fill(params, "eps", spec.eps, "optimizer.params.eps", "adam_epsilon", equal=_close)
    f.fill(params, "weight_decay", spec.weight_decay, "optimizer.params.weight_decay", "weight_decay",
           equal=_close)


def fill_ds_config(ds: dict, cfg: TrainConfig, world_size: int, dp_size: int, device_is_cuda: bool, *,
                   bf16: bool, total_steps: int | None = None, hidden_size: int | None = None,
                   use_deepspeed_optimizer: bool | None = None, optimizer_offload: bool | None = None,
                   source: str = "the ZeRO config") -> tuple[dict, OptimizerSpec | None]:
    """Return (the config for deepspeed.initialize, AdamW settings for the trainer or None).

    `bf16`: the run's precision, decided once (Machine.bf16; the plan's `bf16`).
    OptimizerSpec is None exactly when the returned dict keeps an "optimizer" section for DeepSpeed.
    `total_steps` (optimizer steps of the run) checks an explicit scheduler total; `hidden_size` fills
    ZeRO bucket sizes that say "auto" (without it DeepSpeed's defaults are used). `optimizer_offload`
    (the plan's placement of Adam, plan/resolve.py): True adds ZeRO-Offload of the optimizer where the JSON
    has no offload_optimizer section (a section in the JSON wins: the plan read it). `source` names the
    JSON in messages.
    """
    ds = copy.deepcopy(ds)
    check_zero_keys(ds, source)  # what load_ds_config refuses, for a dict given here directly
    f = _Filler(ds, source, cfg)
    if world_size % dp_size:
        raise ValueError(f"dp_size {dp_size} must divide world_size {world_size}")  # caller bug
    _fill_batch(ds, f, cfg, world_size, dp_size, source)
    _fill_precision(ds, f, cfg, bf16, source)
    offload_opt = _fill_zero(ds, hidden_size, optimizer_offload, source)
    # scheduler: always the trainer's; an explicit section must agree with the recipe
    sched = ds.pop("scheduler", None)
    if sched is not None:
        _check_scheduler(sched, cfg, total_steps, source, f)
    spec = OptimizerSpec(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                         weight_decay=cfg.weight_decay)
    _fill_optimizer(ds, f, spec, source)
    use_ds = use_deepspeed_optimizer
    if use_ds is None:
        use_ds = device_is_cuda and deepspeed_adam_buildable(offload_opt)
    if ds.get("optimizer") is not None and use_ds:
        out_spec = None
    else:
        ds.pop("optimizer", None)
        out_spec = spec
        if offload_opt:  # a client optimizer with ZeRO-Offload: DeepSpeed refuses unless told
            ds["zero_force_ds_cpu_optimizer"] = False
    # quiet DeepSpeed's own step logging: the trainer logs
    ds.setdefault("steps_per_print", 2**31 - 1)
    ds.setdefault("wall_clock_breakdown", False)
    left = _find_auto(ds)
    if left:
        raise ConfigError(f"{source} has \"auto\" at {', '.join(left)}, which this trainer does not fill; "
                          f"write a value there")
    validate_with_deepspeed(ds, source)
    return ds, out_spec


def zero_config_for(ds: dict, cfg: TrainConfig, plan: Any, world_size: int, *, device_is_cuda: bool,
                    hidden_size: int | None, source: str, total_steps: int | None = None
                    ) -> tuple[dict, OptimizerSpec | None]:
    """The ZeRO JSON the trainer hands DeepSpeed for a resolved plan (plan/types.Plan: its run's dp, precision
    and Adam's placement) and AdamW's settings (fill_ds_config). The trainer calls it right after planning, so a
    conflict is refused before the data is read, and again once the run's steps are known; `ulysses-trainer
    plan` calls it too: both refuse the same JSONs with the same message (exit 2)."""
    return fill_ds_config(ds, cfg, world_size, plan.run.dp_size, device_is_cuda, bf16=plan.run.bf16,
                          total_steps=total_steps, hidden_size=hidden_size, source=source,
                          use_deepspeed_optimizer=None if plan.levers.optimizer_offload else False,
                          optimizer_offload=plan.levers.optimizer_offload)


def fill_zero_config(config: str | os.PathLike | dict, *, world_size: int, dp_size: int, micro_batch: int = 1,
                     grad_accum: int = 1, lr: float = 1e-4, bf16: bool = False, max_grad_norm: float = 1.0,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                     hidden_size: int | None = None, deepspeed_optimizer: bool = False) -> dict:
    """A ZeRO JSON (path or dict) with every "auto" filled, ready for `deepspeed.initialize(config=...)`.

    For a loop of your own; the trainer fills its JSON from the recipe the same way. `world_size` and
    `dp_size` are the ParallelState's: DeepSpeed, given no mpu, counts every rank as data-parallel, so
    train_batch_size becomes micro_batch x grad_accum x world_size (an explicit train_batch_size in
    the JSON is read as sequences per optimizer step, micro_batch x grad_accum x dp_size).
    `hidden_size` sizes the ZeRO buckets that say "auto" (DeepSpeed's defaults without it).

    With `deepspeed_optimizer` False (the default) the JSON's "optimizer" section is removed: pass your
    own optimizer to deepspeed.initialize (DeepSpeed's Adam needs CUDA or a compiler). True keeps it,
    filled from lr, betas, eps and weight_decay, for DeepSpeed to build. A "scheduler" section is left
    as written (it may not say "auto"). An explicit value that disagrees with an argument, or an
    unreadable JSON, raises ConfigError (a ValueError) naming the fix.
    """
    raw = load_ds_config(os.fspath(config) if isinstance(config, os.PathLike) else config)
    source = "the ZeRO config" if isinstance(config, dict) else str(config)
    sched = raw.pop("scheduler", None)  # yours to pass to DeepSpeed as written (the trainer uses its own)
    cfg = TrainConfig(per_device_train_batch_size=micro_batch, gradient_accumulation_steps=grad_accum,
                      learning_rate=lr, bf16=bf16, max_grad_norm=max_grad_norm, adam_beta1=betas[0],
                      adam_beta2=betas[1], adam_epsilon=eps, weight_decay=weight_decay)
    ds, _ = fill_ds_config(raw, cfg, world_size, dp_size, device_is_cuda=False, bf16=bf16, hidden_size=hidden_size,
                           use_deepspeed_optimizer=deepspeed_optimizer, source=source)
    if sched is not None:
        left = _find_auto(sched)
        if left:
            raise ConfigError(f"{source} has \"auto\" at scheduler.{', scheduler.'.join(left)}; write values "
                              f"there or remove the section and pass lr_scheduler to deepspeed.initialize")
        ds["scheduler"] = sched
    return ds


def _check_scheduler(sched: Any, cfg: TrainConfig, total_steps: int | None, source: str, f: _Filler) -> None:
    if not isinstance(sched, dict) or sched.get("type") not in _SCHEDULERS:
        kind = sched.get("type") if isinstance(sched, dict) else sched
        raise ConfigError(
            f"scheduler {json.dumps(kind)} in {source} is not supported; remove the \"scheduler\" "
            f"section and set lr_scheduler_type (linear, cosine, constant, constant_with_warmup) "
            f"and warmup_steps in the recipe")
    want = _SCHEDULERS[sched["type"]]
    if cfg.lr_scheduler_type != want:
        raise ConfigError(f"scheduler {sched['type']} in {source} means lr_scheduler_type {want!r} but the "
                          f"training config has {cfg.lr_scheduler_type!r}; remove the \"scheduler\" section "
                          f"or set lr_scheduler_type {want}")
    params = dict(sched.get("params", {}))
    f.fill(params, "warmup_num_steps", cfg.warmup_steps, "scheduler.params.warmup_num_steps", "warmup_steps")
    f.fill(params, "warmup_max_lr", cfg.learning_rate, "scheduler.params.warmup_max_lr", "learning_rate",
           equal=_close)
    f.fill(params, "warmup_min_lr", 0, "scheduler.params.warmup_min_lr", "the trainer's warmup start (0)",
           fix="remove it", equal=_close)
    f.fill(params, "warmup_type", "linear", "scheduler.params.warmup_type", "the trainer's warmup",
           fix="set it to \"linear\"")
    if total_steps is not None and "total_num_steps" in params:
        f.fill(params, "total_num_steps", total_steps, "scheduler.params.total_num_steps",
               "the run's optimizer steps", fix="remove it")


def _find_auto(obj: Any, prefix: str = "") -> list[str]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _find_auto(v, f"{prefix}{k}.")]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _find_auto(v, f"{prefix}{i}.")]
    return [prefix.rstrip(".")] if obj == AUTO else []
