"""The rope a run trains with, applied to a model config: YaRN, a llama3 checkpoint's own scaling stretched, or the
checkpoint's default, checked and written so the saved config reloads to the same rope (model/load.py calls it).

YaRN as transformers computes it (`_compute_yarn_parameters`): the inverse frequencies depend on rope_theta,
head_dim, `factor` and `original_max_position_embeddings`; attention_scaling = 0.1*ln(factor) + 1. The config's
`max_position_embeddings` only enters when `factor` is missing (factor = max_pos / original) and in a consistency
warning, so it is written as original x factor.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig

from ..errors import ConfigError
from .positions import describe_rope_by_layer_type, rope_by_layer_type, rope_dict

_YARN_OPTIONAL = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
# an already-YaRN checkpoint's options that a longer YaRN keeps (gpt-oss: truncate false); attention_factor is
# left out: transformers derives it from the factor, which changes
_YARN_KEPT = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
# a llama3 checkpoint's keys that a larger llama3 factor keeps (unless given)
_LLAMA3_KEPT = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# rope keys kept from the checkpoint whatever scaling is asked for: which dimensions rotate (Qwen3.5)
_ROPE_SHAPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"rope_parameters.{name} must be a number, got {value!r}")
    return float(value)


def resolve_rope_parameters(config: PretrainedConfig, rope_params: dict | None,
                            max_length: int) -> dict | None:
    """Apply the requested rope (YaRN, a llama3 checkpoint's llama3 with a larger factor, or default) to `config` in
    place; return the resolved dict.

    YaRN keys: factor (number or "auto" = max_length / original), original_max_position_embeddings
    (default: the checkpoint's pretraining length), rope_theta (must equal the checkpoint's), and
    transformers' optional beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate (an already-YaRN
    checkpoint's own, attention_factor apart, where not given). None leaves the checkpoint's own rope untouched.
    """
    if rope_params is None:
        return None
    if not isinstance(rope_params, dict):
        raise ConfigError(f"rope_parameters must be a mapping like {{rope_type: yarn, factor: auto}}, "
                          f"got {rope_params!r}")
    by_type = rope_by_layer_type(config)
    if by_type is not None:  # Gemma 3: one rope per layer type; a single YaRN dict would replace both
        raise ConfigError(f"rope_parameters: this {config.model_type} model gives each layer type its own rope "
                          f"({describe_rope_by_layer_type(by_type)}), which the trainer does not replace; drop "
                          f"rope_parameters (allow_beyond_positions true trains past max_position_embeddings)")
    params = dict(rope_params)
    ckpt = rope_dict(config)
    rope_type = params.pop("rope_type", params.pop("type", None))
    theta = ckpt.get("rope_theta")
    if "rope_theta" in params:
        want = _number("rope_theta", params.pop("rope_theta"))
        if theta is None or not math.isclose(want, float(theta), rel_tol=1e-9):
            raise ConfigError(
                f"rope_parameters.rope_theta {want:g} differs from the checkpoint's rope_theta {theta}: the "
                f"weights were trained with {theta}; drop rope_theta from rope_parameters "
                f"(YaRN keeps the base)")
    # what the rope is applied to (Qwen3.5: the first 25% of each head; its multimodal sections), not how
    # positions are scaled: the checkpoint's, whatever the scaling asked for
    shape = {k: ckpt[k] for k in _ROPE_SHAPE_KEYS if k in ckpt}
    if rope_type == "default":
        if params:
            raise ConfigError(f"rope_parameters with rope_type default takes only rope_theta; "
                              f"got {sorted(params)}")
        resolved = {"rope_type": "default", "rope_theta": theta, **shape}
        config.rope_parameters = resolved
        return resolved
    if rope_type == "llama3":
        return _stretch_llama3(config, ckpt, params, theta, shape, max_length)
    if rope_type != "yarn":
        raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported; use yarn "
                          f"(e.g. {{rope_type: yarn, factor: auto}}), llama3 (over a llama3 checkpoint) or default")

    if ckpt.get("rope_type") == "yarn" and ckpt.get("original_max_position_embeddings"):
        default_original = ckpt["original_max_position_embeddings"]  # already YaRN: its pretraining length
        params = {**{k: ckpt[k] for k in _YARN_KEPT if k in ckpt}, **params}  # and its options, unless given
    else:
        default_original = config.max_position_embeddings
    original = params.pop("original_max_position_embeddings", default_original)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ConfigError(f"rope_parameters.original_max_position_embeddings must be a positive integer, "
                          f"got {original!r}")
    if original > max_length:
        raise ConfigError(
            f"YaRN original_max_position_embeddings {original} exceeds the target length max_length "
            f"{max_length}: YaRN only stretches positions beyond what the model was trained on; drop "
            f"rope_parameters (the model already covers {max_length}) or raise max_length")
    factor = params.pop("factor", "auto")
    factor = max_length / original if factor == "auto" else _number("factor", factor)
    if factor <= 1:
        raise ConfigError(f"YaRN factor must be > 1, got {factor:g}; use factor auto "
                          f"(= max_length / original_max_position_embeddings) or a larger factor")
    unknown = sorted(set(params) - set(_YARN_OPTIONAL))
    if unknown:
        raise ConfigError(f"rope_parameters: unknown YaRN keys {unknown}; allowed: rope_type, factor, "
                          f"original_max_position_embeddings, rope_theta, {', '.join(_YARN_OPTIONAL)}")
    resolved = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor),
                "original_max_position_embeddings": int(original), **params, **shape}
    config.rope_parameters = resolved
    config.max_position_embeddings = int(round(original * factor))
    return resolved


def _stretch_llama3(config: PretrainedConfig, ckpt: dict[str, Any], params: dict[str, Any], theta: Any,
                    shape: dict[str, Any], max_length: int) -> dict[str, Any]:
    """A llama3 checkpoint's own scaling with a larger factor; its other keys (low/high_freq_factor,
    original_max_position_embeddings) kept unless given. The positions it covers keep the checkpoint's ratio to
    original x factor (Llama 3.1: 131,072 = 2 x 8,192 x 8), so factor auto = the checkpoint's factor x max_length /
    its max_position_embeddings (Llama 3.1 to 1,048,576: 64)."""
    if ckpt.get("rope_type") != "llama3":
        raise ConfigError(f"rope_parameters.rope_type llama3 stretches a checkpoint's own llama3 scaling; this "
                          f"{config.model_type} model's rope is {ckpt.get('rope_type')}; use "
                          f"{{rope_type: yarn, factor: auto}}")
    unknown = sorted(set(params) - {"factor", *_LLAMA3_KEPT})
    if unknown:
        raise ConfigError(f"rope_parameters: unknown llama3 keys {unknown}; allowed: rope_type, factor, rope_theta, "
                          f"{', '.join(_LLAMA3_KEPT)}")
    own_factor = _number("factor", ckpt.get("factor", 1.0))
    merged = {**{k: ckpt[k] for k in _LLAMA3_KEPT if k in ckpt}, **params}
    original = merged.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ConfigError(f"rope_parameters.original_max_position_embeddings must be a positive integer, "
                          f"got {original!r}")
    # the checkpoint's positions over its original x factor (Llama 3.1: 2), kept by the stretch
    ratio = config.max_position_embeddings / (ckpt.get("original_max_position_embeddings", original) * own_factor)
    factor = merged.pop("factor", "auto")
    factor = max_length / (ratio * original) if factor == "auto" else _number("factor", factor)
    if factor <= own_factor:
        raise ConfigError(f"llama3 factor {factor:g} does not stretch the checkpoint's own factor {own_factor:g}; "
                          f"use factor auto (= {own_factor:g} x max_length / max_position_embeddings "
                          f"{config.max_position_embeddings:,}) or a larger factor")
    for key in ("low_freq_factor", "high_freq_factor"):
        merged[key] = _number(key, merged.get(key))
    resolved = {"rope_type": "llama3", "rope_theta": theta, "factor": float(factor), **merged, **shape}
    config.rope_parameters = resolved
    config.max_position_embeddings = int(round(ratio * original * factor))
    return resolved
