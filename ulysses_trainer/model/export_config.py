"""The config.json that final/ carries: the user's model config, changed only where training changed the model.

For a checkpoint that is its own config.json, key for key (the Hub's names such as `torch_dtype`, `num_experts`,
`rope_theta` stay as written), with: the dtype trained in; what model_init_kwargs changed; the rope as trained
(YaRN's `rope_parameters` and `max_position_embeddings`). Settings that only the training run needed go back to
the user's values: `use_cache` (off while training) and `output_router_logits` (on while training for the
load-balancing loss, unless model_init_kwargs set it). For a preset: its config with the same rules. A multimodal
checkpoint (Qwen3.5's `text_config` + `vision_config`) keeps every section as written; its language-model section
takes the rules above.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from ..config import TrainConfig
from .load import checkpoint_source, source_config

# set for the training run only: the export keeps the user's (checkpoint's) value
_RUN_ONLY = ("use_cache", "output_router_logits")
# not model settings: written by whoever saves, or the dtype, set below
_NOT_COMPARED = ("transformers_version", "dtype", "torch_dtype", "_name_or_path", "architectures")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def exported_config(trained: PretrainedConfig, source: PretrainedConfig, original_json: dict[str, Any] | None,
                    dtype: torch.dtype, model_init_kwargs: dict | None) -> dict[str, Any]:
    """config.json of final/. trained: the config the run built the model from; source: the checkpoint's or
    preset's config as loaded (no overrides); original_json: the checkpoint's config.json (None for a preset)."""
    import transformers

    text = source.get_text_config(decoder=True)
    if text is not source and original_json is not None:  # multimodal: the language model is one section of it
        key = next(k for k in source.sub_configs if getattr(source, k, None) is text)
        out = dict(original_json)
        out[key] = exported_config(trained, text, original_json.get(key) or {}, dtype, model_init_kwargs)
        out[key].pop("transformers_version", None)
        for k in [k for k in ("dtype", "torch_dtype") if k in out] or ["dtype"]:
            out[k] = _dtype_name(dtype)
        out["transformers_version"] = transformers.__version__
        return out
    ours, theirs = trained.to_dict(), source.to_dict()
    kept = {k for k in _RUN_ONLY if k not in (model_init_kwargs or {})}
    changed = {k: v for k, v in ours.items()
               if k not in kept and k not in _NOT_COMPARED and not k.startswith("_") and theirs.get(k) != v}
    if original_json is None:  # a preset: its config with the trained values
        out = {k: v for k, v in ours.items() if not k.startswith("_")}
        out.update({k: theirs.get(k) for k in kept if k in theirs})
        out.pop("torch_dtype", None)
    else:
        out = dict(original_json)
        if "rope_parameters" in changed:  # one rope entry: the trained one replaces the legacy name
            out.pop("rope_scaling", None)
        alias = {real: name for name, real in getattr(type(trained), "attribute_map", {}).items()}
        for k, v in changed.items():  # under the name the file uses (num_experts for num_local_experts)
            out[alias[k] if k not in out and alias.get(k) in out else k] = v
    keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["dtype"]
    out.update({k: _dtype_name(dtype) for k in keys})
    out["transformers_version"] = transformers.__version__  # the version that wrote these weights
    return out


def read_config_json(source: str | None) -> dict[str, Any] | None:
    """A checkpoint's config.json as written (a local directory, or a Hub id's cached copy); None for a preset."""
    if source is None:
        return None
    path = Path(source) / "config.json"
    if not path.is_file():
        from transformers.utils import cached_file

        try:
            path = Path(cached_file(source, "config.json", local_files_only=True))
        except Exception:  # not cached: the export writes transformers' own rendering of the config
            return None
    return json.loads(path.read_text())


def export_config_json(cfg: TrainConfig, trained: PretrainedConfig, bf16: bool) -> dict[str, Any]:
    """exported_config for a training run: its model source, the dtype it trained in, its model_init_kwargs."""
    source = checkpoint_source(cfg.model_name_or_path)
    return exported_config(trained, source_config(cfg.model_name_or_path), read_config_json(source),
                           torch.bfloat16 if bf16 else torch.float32, cfg.model_init_kwargs)


def dtype_change_note(source: str | None, bf16: bool) -> str | None:
    """The line saying final/ holds another dtype than the checkpoint it started from (a bf16 checkpoint trained
    in fp32 on a CPU exports float32: the weights as trained, twice the size); None when they agree or for a
    preset."""
    written = read_config_json(source) or {}
    stored = written.get("dtype") or written.get("torch_dtype")
    trained = "bfloat16" if bf16 else "float32"
    if not isinstance(stored, str) or stored == trained:
        return None
    how = ("bf16 was off (bf16 auto is off without a CUDA device that has it)" if not bf16
           else "bf16 was on")
    return (f"final/ holds {trained} weights, the dtype trained in, while {source} stores {stored}: {how}; "
            f"load it with dtype=torch.{stored} to get {stored} back")
