"""The loss's memory terms (final norm, loss buffers, gathered lm_head), kept apart as layer_terms keeps one layer's."""

from __future__ import annotations

from .inputs import ModelShape, Settings
from .layer_terms import FP32, rmsnorm_saved_bytes


def final_norm_bytes(shape: ModelShape, s: Settings) -> int:
    """The final RMSNorm's saved tensors plus its output (the loss input, alive during the loss)."""
    t, e = s.local_tokens, s.act_bytes
    return rmsnorm_saved_bytes(t, shape.hidden, e, s.lean_norm) + t * shape.hidden * e


LOSS_GRAD_GROUP = 8  # = levers.chunked_loss.GRAD_GROUP (the planner imports no torch; a test ties them)


def chunked_loss_bytes(shape: ModelShape, s: Settings) -> int:
    """levers/chunked_loss.py: the hidden grad [t, H] and the fp32 lm_head grad [V, H], both built in
    forward; one chunk's fp32 logits (turned into probabilities in place) next to the dlogits buffer of
    GRAD_GROUP chunks (training dtype); in bf16 the final bf16 weight grad. Soft-capped logits (Gemma's
    final_logit_softcapping): the chunk's tanh, fp32, beside them."""
    t, e, v, h, c = s.local_tokens, s.act_bytes, shape.vocab, shape.hidden, s.loss_chunk_size
    c = min(c, t)
    group = min(c * LOSS_GRAD_GROUP, t)
    vh_lowp = v * h * e if e < FP32 else 0
    chunk = c * v * FP32 * (2 if shape.final_logit_softcap else 1) + group * v * e
    return t * h * e + v * h * FP32 + max(chunk, vh_lowp)


def plain_loss_bytes(shape: ModelShape, s: Settings) -> int:
    """Full logits (levers' nll_sum / HF's loss): in backward the fp32 log-softmax output it saved, the
    NLL grad and the log-softmax grad coexist: 3 fp32 [t, V]; plus the lm_head weight grad."""
    t, e, v, h = s.local_tokens, s.act_bytes, shape.vocab, shape.hidden
    return 3 * t * v * FP32 + v * h * e


def loss_bytes(shape: ModelShape, s: Settings) -> int:
    """The loss's own buffers for the configured loss type."""
    return chunked_loss_bytes(shape, s) if s.loss_type == "chunked_nll" else plain_loss_bytes(shape, s)


def lm_head_gathered_bytes(shape: ModelShape, s: Settings) -> int:
    """ZeRO-3 gathers the full lm_head weight [V, H] for the loss."""
    return 0 if s.zero_stage == 0 else shape.vocab * shape.hidden * s.act_bytes
