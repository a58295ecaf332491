"""The model's parameter counts as functions of its shape: each reads a field ModelShape derived once, when the
shape was made (plan/inputs.py), for the memory model, the step time, the trainer's FLOPs and disk checks and the
tests."""

from __future__ import annotations

from .inputs import ModelShape


def layer_param_numels(shape: ModelShape) -> list[int]:
    """Parameters of one decoder layer, in layer_params' order (dense Qwen3: q, k, v, o, q_norm, k_norm, gate,
    up, down, input_layernorm, post_attention_layernorm)."""
    return [n for _, n in shape.layer_params]


def matmul_params(shape: ModelShape) -> int:
    """Parameters that take part in a matmul per token: every layer's linear weights plus lm_head (embedding
    lookups and norms do no matmul); of a sparse MLP, the router and the top_k experts a token runs through
    (active FLOPs); what the model FLOPs count (train/metrics.py)."""
    return shape.matmul_params


def param_numels(shape: ModelShape) -> list[int]:
    """Every parameter tensor of the causal LM: embedding, the layers, final norm, untied lm_head."""
    return list(shape.param_numels)


def num_params(shape: ModelShape) -> int:
    """N: parameters, tied embeddings counted once."""
    return shape.num_params


def num_active_params(shape: ModelShape) -> int:
    """Parameters one token's forward uses (tied embeddings counted once): N for a dense model; a sparse one
    counts top_k of its experts."""
    return shape.num_active_params
