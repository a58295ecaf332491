"""The positions a model covers: max_position_embeddings, or what its rope scaling stretches them to; a max_length
past them is refused unless the user says they mean it (allow_beyond_positions)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ..errors import ConfigError


def rope_dict(config: PretrainedConfig) -> dict[str, Any]:
    """The config's rope parameters as a dict, rope_theta and rope_type filled in."""
    rp = getattr(config, "rope_parameters", None)
    rp = dict(rp) if isinstance(rp, dict) else {}
    if "rope_theta" not in rp and getattr(config, "rope_theta", None) is not None:
        rp["rope_theta"] = config.rope_theta
    rp.setdefault("rope_type", "default")
    return rp


def rope_by_layer_type(config: PretrainedConfig) -> dict[str, dict[str, Any]] | None:
    """The rope of a config that gives each layer type its own (Gemma 3: full_attention, sliding_attention), else
    None."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        return rp
    return None


def describe_rope_by_layer_type(rp: dict[str, dict[str, Any]]) -> str:
    """'full_attention: linear factor 8, sliding_attention: default' (each layer type's scaling)."""
    return ", ".join(f"{kind}: {p.get('rope_type', 'default')}" + (f" factor {p['factor']:g}" if "factor" in p else "")
                     for kind, p in rp.items())


def positions_covered(config: PretrainedConfig) -> int | None:
    """The positions the model covers: max_position_embeddings, or original x factor where its rope scales
    them (YaRN, linear, dynamic), whichever is larger. None for a config without max_position_embeddings."""
    config = getattr(config, "text_config", None) or config  # a multimodal layout: its text model's
    base = getattr(config, "max_position_embeddings", None)
    if not isinstance(base, int):
        return None
    rp = rope_dict(config)
    factor = rp.get("factor")
    if rp.get("rope_type", "default") == "default" or not isinstance(factor, (int, float)) or factor <= 1:
        return base
    original = rp.get("original_max_position_embeddings") or base
    return max(base, int(round(original * factor)))


YARN_AUTO = """--model_init_kwargs '{"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}'"""
LLAMA3_AUTO = """--model_init_kwargs '{"rope_parameters": {"rope_type": "llama3", "factor": "auto"}}'"""


def check_positions(config: PretrainedConfig, max_length: int, own_rope: dict[str, Any],
                    requested: bool) -> None:
    """A max_length past the positions the model covers is refused (ConfigError) naming the checkpoint's own scaling
    and the stretches that reach max_length (its own llama3 with factor auto for a llama3 checkpoint, YaRN with
    factor auto); allow_beyond_positions lets it through (the fields' docs say so)."""
    config = getattr(config, "text_config", None) or config  # a multimodal layout: its text model's
    covered = positions_covered(config)
    if covered is None or max_length <= covered:
        return
    rp = rope_dict(config)
    by_type = rope_by_layer_type(config)
    if by_type is not None:  # its scaling is per layer type and already inside max_position_embeddings (Gemma 3)
        raise ConfigError(f"max_length {max_length:,} is beyond the model's positions: max_position_embeddings is "
                          f"{covered:,} with its own rope per layer type ({describe_rope_by_layer_type(by_type)}), "
                          f"which YaRN cannot replace here; set allow_beyond_positions true to train past them "
                          f"anyway")
    if requested:
        how = (f"the rope_parameters given ({rp.get('rope_type')} factor {rp.get('factor', 1):g} over "
               f"{rp.get('original_max_position_embeddings', config.max_position_embeddings):,} positions) "
               f"cover {covered:,}")
        fix = ("set rope_parameters factor to auto (= the checkpoint's factor x max_length / its "
               "max_position_embeddings)" if rp.get("rope_type") == "llama3" else
               "set rope_parameters factor to auto (= max_length / original_max_position_embeddings)")
    else:
        scaled = own_rope.get("rope_type", "default") != "default"
        how = (f"the checkpoint's own {own_rope.get('rope_type')} scaling (factor {own_rope.get('factor', 1):g}) "
               f"covers {covered:,}" if scaled else f"max_position_embeddings is {covered:,} and it has no rope "
               f"scaling")
        fix = f"stretch them with YaRN to max_length: {YARN_AUTO}"
        if own_rope.get("rope_type") == "llama3":  # its own scheme stretched, or YaRN over its positions
            fix = f"stretch its own llama3 scaling to max_length: {LLAMA3_AUTO}, or {fix}"
    raise ConfigError(f"max_length {max_length:,} is beyond the model's positions: {how}; {fix}, or set "
                      f"allow_beyond_positions true to train past them anyway")
