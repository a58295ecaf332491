"""Model config and weights: a preset (random init) or an HF checkpoint, the run's rope applied
(model/rope_config.py: YaRN, a llama3 checkpoint's own scaling stretched, or its default). Training may use
max_length > original × factor (the reference run does).
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ..config import TrainConfig
from ..errors import ConfigError
from ..families import FAMILIES, PRESETS, family, supported
from ..families.presets import is_preset, preset_config
from ..vocabulary.names import CHECKPOINT_MARKER
from .generic import is_generic, register_generic
from .positions import check_positions, rope_dict
from .rope_config import resolve_rope_parameters

_ROPE_KEYS = ("rope_parameters", "rope_scaling")  # rope_scaling: the pre-5.0 name
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def checkpoint_source(name_or_path: str) -> str | None:
    """None for a preset, else the local directory or Hub id to load weights from."""
    if is_preset(name_or_path) and not Path(name_or_path).exists():
        return None
    return name_or_path


def _missing(name_or_path: str, why: str) -> ConfigError:
    return ConfigError(f"model_name_or_path {name_or_path!r}: {why}; use a preset ({', '.join(PRESETS)}) "
                       f"or a local HF checkpoint directory holding config.json")


def training_output_hint(p: Path) -> str | None:
    """Why a directory this trainer wrote is not a model to load, and which one is: a checkpoint-<step> (ZeRO
    shards and optimizer state) or an output_dir (its model is final/). None for any other directory."""
    if (p / CHECKPOINT_MARKER).is_file():
        final = p.parent / "final"
        return (f"{p} is a training checkpoint (ZeRO shards and optimizer state for resume_from_checkpoint), not a "
                f"Hugging Face model; train from the model the run exported, {final} (written when that run ends), "
                f"or continue that run with --output_dir {p.parent} --resume_from_checkpoint {p}")
    if (p / "final").is_dir() or (p / "latest").is_file() or (p / "metrics.jsonl").is_file():
        return (f"{p} is a training output_dir, not a Hugging Face model; its exported model is {p / 'final'} "
                f"(written when the run ends): set model_name_or_path to {p / 'final'}")
    return None


def _load_checkpoint_config(name_or_path: str) -> PretrainedConfig:
    p = Path(name_or_path)
    if p.exists():
        if not p.is_dir():
            raise _missing(name_or_path, "is a file, not a checkpoint directory")
        hint = training_output_hint(p)
        if not (p / "config.json").is_file():
            raise ConfigError(f"model_name_or_path {name_or_path!r}: {hint}") if hint else \
                _missing(name_or_path, "the directory has no config.json")
        try:
            return AutoConfig.from_pretrained(str(p), local_files_only=True)
        except Exception as exc:  # malformed or unreadable config.json (or a run's config.json)
            if hint:
                raise ConfigError(f"model_name_or_path {name_or_path!r}: {hint}") from None
            raise ConfigError(f"cannot read {p / 'config.json'}: {exc}; fix the file or copy the checkpoint "
                              f"again") from None
    if not _HUB_ID.match(name_or_path):
        raise _missing(name_or_path, "no such path")
    try:  # a Hub id: the local cache first, then the network where HF_HUB_OFFLINE allows it
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except Exception:
        pass
    from .hub import hub_offline, hub_unreachable

    fetch = (f"download it where the network allows (hf download {name_or_path} --local-dir DIR) and set "
             f"model_name_or_path to DIR")
    if hub_offline():
        raise ConfigError(f"model_name_or_path {name_or_path!r}: no such path and not in the Hugging Face cache, "
                          f"and HF_HUB_OFFLINE is set; {fetch}, or unset HF_HUB_OFFLINE")
    unreachable = hub_unreachable()  # one short probe: transformers would retry for half a minute
    if unreachable:
        raise ConfigError(f"model_name_or_path {name_or_path!r}: no such path and not in the Hugging Face cache, "
                          f"and the Hub cannot be reached: {unreachable}; {fetch}, or check the network "
                          f"(HF_ENDPOINT for a mirror)")
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except Exception as exc:
        why = f"no such path, and not loadable as a Hub id ({type(exc).__name__})"
        raise _missing(name_or_path, why) from None


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def check_local_weights(name_or_path: str, model_config: PretrainedConfig | None = None) -> None:
    """A local checkpoint directory must hold readable weights: checked before any model is built.

    Reads only the safetensors headers (a truncated or foreign file fails there); with `model_config`, every
    tensor must load into that model and every parameter of it be loaded (model/checkpoint_keys.py). Presets
    and Hub ids pass untouched.
    """
    source = checkpoint_source(name_or_path)
    p = Path(source) if source is not None else None
    if p is None or not p.is_dir():
        return
    found = [f for f in _WEIGHT_FILES if (p / f).is_file()]
    if not found:
        raise ConfigError(f"model_name_or_path {name_or_path!r} holds no weights (none of "
                          f"{', '.join(_WEIGHT_FILES)}); copy the checkpoint's weight files there")
    files = [p / found[0]]
    if found[0].endswith(".index.json"):
        try:
            weight_map = json.loads((p / found[0]).read_text())["weight_map"]
            files = [p / f for f in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"cannot read the weight index {p / found[0]}: {exc}; re-save the checkpoint") \
                from None
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            lost = sorted(k for k, f in weight_map.items() if f in absent)
            more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
            raise ConfigError(f"{p / found[0]} lists weight files missing from {p}: {absent[:3]} "
                              f"({len(absent)} files holding {len(lost)} tensors: {', '.join(lost[:3])}{more}); "
                              f"copy the whole checkpoint")
    for f in files:
        if f.suffix != ".safetensors":
            continue
        try:
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as handle:
                handle.keys()
        except Exception as exc:  # truncated, not safetensors, unreadable
            raise ConfigError(f"cannot read the weights {f}: {exc}; re-download or re-save the checkpoint") \
                from None
    if model_config is not None and all(f.suffix == ".safetensors" for f in files):
        from .checkpoint_keys import check_checkpoint_tensors

        check_checkpoint_tensors(p, files, model_config)


def source_config(name_or_path: str) -> PretrainedConfig:
    """The preset's or checkpoint's own config, as transformers loads it (no overrides, nothing for training)."""
    return preset_config(name_or_path) if checkpoint_source(name_or_path) is None \
        else _load_checkpoint_config(name_or_path)


def language_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """The part of `config` that text training builds: a multimodal checkpoint's language model (Qwen3.5's
    `Qwen3_5Config` -> its `text_config`), else `config` itself. transformers loads such a checkpoint's
    language-model tensors into the text model's causal LM and leaves the vision tower's unread."""
    text = config.get_text_config(decoder=True)
    return text if text is not config and text.model_type in FAMILIES else config


def load_model_config(name_or_path: str, model_init_kwargs: dict | None = None) -> PretrainedConfig:
    """The model config of a preset or checkpoint (its language model, for a multimodal one), with
    `model_init_kwargs` overrides applied.

    rope_parameters / rope_scaling in model_init_kwargs are left for resolve_rope_parameters.
    """
    source = source_config(name_or_path)
    why = quantized_checkpoint(source, name_or_path)  # the whole checkpoint's config: a multimodal one's holds it
    if why:
        raise ConfigError(why)
    config = language_model_config(source)
    generic = config.model_type not in FAMILIES or is_generic(FAMILIES[config.model_type])
    why = None if generic else family(config.model_type).check_config(config)
    if why:
        raise ConfigError(f"model {name_or_path!r}: {why}")
    overrides = {k: v for k, v in (model_init_kwargs or {}).items() if k not in _ROPE_KEYS}
    if overrides:
        config = _override(config, overrides)
    if generic:  # no family folder: the generic path (model/generic.py) registers one for it, or says why not
        why = register_generic(config)
        if why:
            raise ConfigError(f"model {name_or_path!r} has model_type {config.model_type!r}, which no family of "
                              f"this trainer covers and the generic path refuses: {why}; this trainer supports "
                              f"{supported()}")
    config.use_cache = False  # training: no KV cache
    return config


def quantized_checkpoint(config: PretrainedConfig, name_or_path: str) -> str | None:
    """Why a checkpoint stored quantized (its config's quantization_config: gpt-oss's MXFP4 experts) is refused,
    None for one that is not. The trainer trains and exports full-precision weights: transformers would dequantize
    on some machines and not on others, build it outside ZeRO-3's partitioned init, and the export's config.json
    would still name the quantization its tensors no longer have."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    method = getattr(method, "value", method)
    if method == "mxfp4":
        fix = (f"dequantize it once into a bf16 checkpoint: AutoModelForCausalLM.from_pretrained({name_or_path!r}, "
               f"quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(OUT), then "
               f"set model_name_or_path to OUT")
    else:
        fix = "train from its unquantized weights"
    return (f"model {name_or_path!r} is stored quantized ({method}), and this trainer trains and exports "
            f"full-precision weights; {fix}")


def _override(config: PretrainedConfig, overrides: dict[str, Any]) -> PretrainedConfig:
    data = config.to_dict()
    for key in overrides:
        if key in ("torch_dtype", "dtype", "attn_implementation"):
            raise ConfigError(f"model_init_kwargs may not set {key}: use the bf16 / attn_implementation "
                              f"fields")
        if key not in data:
            close = difflib.get_close_matches(key, list(data), 1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"model_init_kwargs: {key!r} is not a field of the {config.model_type} "
                              f"config{hint}")
    data.update(overrides)
    if "num_hidden_layers" in overrides:  # derived per-layer lists must follow the new depth
        if "layer_types" not in overrides:
            data.pop("layer_types", None)
        if "max_window_layers" in data and "max_window_layers" not in overrides:
            data["max_window_layers"] = min(data["max_window_layers"], overrides["num_hidden_layers"])
    try:
        return type(config).from_dict(data)
    except Exception as exc:  # the config class's own type/range validation
        raise ConfigError(f"model_init_kwargs {overrides} rejected by the {config.model_type} config: "
                          f"{str(exc).strip()}") from None


def model_config_for(cfg: TrainConfig) -> PretrainedConfig:
    """load_model_config + resolve_rope_parameters for a training config (the one call the trainer needs)."""
    kwargs = cfg.model_init_kwargs or {}
    both = [k for k in _ROPE_KEYS if k in kwargs]
    if len(both) > 1:
        raise ConfigError("model_init_kwargs sets both rope_parameters and rope_scaling; "
                          "keep rope_parameters")
    config = load_model_config(cfg.model_name_or_path, kwargs)
    family(config.model_type).mlp.training_config(config, kwargs)  # e.g. the router logits of a sparse block
    rope = kwargs.get(both[0]) if both else None
    own = rope_dict(config)  # the checkpoint's own rope, before any requested one replaces it
    resolve_rope_parameters(config, rope, cfg.max_length)
    if not cfg.allow_beyond_positions:
        check_positions(config, cfg.max_length, own, requested=rope is not None)
    return config


def _built_attention(config: PretrainedConfig) -> str:
    """sdpa, or eager where the family's causal-LM class does not take SDPA."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def build_model(config: PretrainedConfig, dtype: torch.dtype, from_pretrained_path: str | None = None,
                seed: int = 0) -> torch.nn.Module:
    """The family's causal LM (Qwen3ForCausalLM, Qwen3MoeForCausalLM): random init (seeded, global RNG untouched)
    for presets, else the checkpoint.

    Built with SDPA (eager for a class without it: gpt-oss, whose sinks SDPA cannot take); the trainer switches
    attention afterwards. Under ZeRO-3 call it inside deepspeed.zero.Init (presets) or with an HfDeepSpeedConfig
    alive (checkpoints).
    """
    attn = _built_attention(config)
    if from_pretrained_path is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    else:
        local = Path(from_pretrained_path).exists()
        # use_kernels=False: transformers >= 5.25 swaps in Hub kernels by default; the levers wrap its own forwards
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                from_pretrained_path, config=config, dtype=dtype, attn_implementation=attn,
                local_files_only=local, output_loading_info=True, use_kernels=False)
        except OSError as exc:
            raise ConfigError(f"cannot load weights from {from_pretrained_path!r}: {exc}") from None
        from .checkpoint_keys import info_problems, refusal

        # a Hub id or .bin weights are checked here, after the load
        problems = info_problems(info, config.num_hidden_layers)
        if problems:
            raise refusal(from_pretrained_path, config.model_type, problems)
    model.config.use_cache = False
    return model
