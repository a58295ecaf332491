"""LoRA through PEFT: the config from TRL's names, the adapters on the HF model, the merged weights.

The adapters go onto the HF causal LM before the trainer installs its mechanisms (Ulysses attention,
loss head, tiled MLP, checkpoints): PEFT's LoRA layers wrap the projections, which the mechanisms call
as modules, so they run unchanged. The base weights are frozen (requires_grad false): ZeRO-3
partitions them but keeps no gradient and no Adam state for them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..config import TrainConfig
from ..errors import ConfigError
from ..families import Family, family

ADAPTER = "default"  # PEFT's adapter name


def lora_kwargs(cfg: TrainConfig, fam: Family | None = None) -> dict[str, Any]:
    """LoraConfig keyword arguments: the lora_* fields, then peft_config's keys over them. fam: the model's
    family, which names the targets (Family.lora_targets: the default and "all-linear" as the plan counts
    them; PEFT's own all-linear would also wrap a sparse block's fused experts and router, which the
    trainer's sparse block calls directly); None: as given (checked before the model is known)."""
    kw: dict[str, Any] = {"r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
                          "target_modules": cfg.lora_target_modules, "task_type": "CAUSAL_LM"}
    kw.update(cfg.peft_config or {})
    if fam is not None:
        kw["target_modules"] = list(fam.lora_targets(kw.get("target_modules")))
    kw.pop("peft_type", None)
    return kw


def check_lora(cfg: TrainConfig, fam: Family | None = None) -> Any:
    """The LoraConfig, or a ConfigError naming the fix (peft missing, a bad key or value)."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise ConfigError("use_peft needs the peft package: pip install peft") from None
    kw = lora_kwargs(cfg, fam)
    if not (isinstance(kw["r"], int) and kw["r"] >= 1):
        raise ConfigError(f"lora_r must be an integer >= 1, got {kw['r']!r}")
    if not 0 <= float(kw.get("lora_dropout", 0.0)) < 1:
        raise ConfigError(f"lora_dropout must be in [0, 1), got {kw['lora_dropout']!r}")
    try:
        return LoraConfig(**kw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"peft_config / lora_* settings are not a valid LoraConfig: {exc}") from None


def add_lora(model: torch.nn.Module, cfg: TrainConfig) -> tuple[torch.nn.Module, Any]:
    """(the HF causal LM with LoRA layers and frozen base weights, the PeftModel that saves the adapter)."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # lora_A's init: every rank alike
        # PEFT reads transformers' deprecated `is_gradient_checkpointing` (transformers >= 5.2x): its call, not ours
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        torch.manual_seed(cfg.seed)
        peft_model = get_peft_model(model, check_lora(cfg, family(model.config.model_type)))
    return peft_model.base_model.model, peft_model


def merged_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full state dict of LoRA layers (…proj.base_layer.weight, …proj.lora_A/B.default.weight) as plain
    weights: W + scaling * B @ A (fp32 product, stored in W's dtype)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key or ".lora_dropout." in key:
            continue
        if ".base_layer." in key:
            prefix, _, leaf = key.partition(".base_layer.")
            if leaf == "weight":
                a = state[f"{prefix}.lora_A.{ADAPTER}.weight"].float()  # [r, in]
                b = state[f"{prefix}.lora_B.{ADAPTER}.weight"].float()  # [out, r]
                value = (value.float() + scaling * (b @ a)).to(value.dtype)
            key = f"{prefix}.{leaf}"
        out[key] = value
    return out


def lora_scaling(peft_model: Any) -> float:
    """The adapter's scale (alpha / r, or alpha / sqrt(r) with rslora), as PEFT applies it."""
    lcfg = peft_model.peft_config[ADAPTER]
    return lcfg.lora_alpha / (lcfg.r ** 0.5 if getattr(lcfg, "use_rslora", False) else lcfg.r)
