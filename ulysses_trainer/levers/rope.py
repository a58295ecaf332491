"""Rotary position embeddings in one pass: q and k read once and written once, forward and backward.

HF applies RoPE as `q * cos + rotate_half(q) * sin` (and the same for k): a slice, a negation, a concatenation and
three multiplies and adds, each a pass over q or k in memory, again in the checkpoint's recompute, and their
autograd in backward. On the H200 that was 2.9 s of a 131 s Qwen3-4B step at 256K (docs/benchmarks.md). The
Triton kernel here reads each token's q and k heads once and writes them once, and rounds where PyTorch's eager
ops round (each product to the tensor's dtype, then their sum), so its output and gradients equal HF's bitwise in
bf16 (tests/test_gpu_rope.py). A CPU (or a machine without Triton) runs HF's own function: the same ops as before.

`use_fused_rope(model)` gives each Qwen3 / Qwen3-MoE attention module (q/k norms, one q projection) a forward that
applies RoPE this way (`FusedRopeAttention`: the module's own projections, norms and attention function, the same
state-dict keys); a layer of another structure keeps its own. Every path that applies RoPE runs it: the forward,
a checkpoint's recompute (the same forward) and the backward (the Function's).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import Tensor, nn

# the attention classes whose forward FusedRopeAttention reproduces (transformers 5.17-5.25)
ROPE_ATTENTIONS = ("Qwen3Attention", "Qwen3MoeAttention")


def _has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def rope_kernel_for(q: Tensor) -> str:
    """`triton` for a CUDA tensor where Triton is installed, else `torch` (HF's rotate_half ops)."""
    return "triton" if q.is_cuda and _has_triton() else "torch"


def rotate_half(x: Tensor) -> Tensor:
    """HF's rotate_half: [x1, x2] -> [-x2, x1] over the last dimension."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def torch_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """HF's apply_rotary_pos_emb, op for op: q, k [b, h, s, d], cos, sin [b, s, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, s, d] -> [b, 1, s, d]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _kernel():
    """The Triton kernel (levers/rope_triton.py, imported on first use: this module needs no Triton)."""
    from .rope_triton import rope_kernel

    return rope_kernel


def _launch(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    """One pass of the kernel over x [b, h, s, d] (any strides, unit stride over d) -> a tensor like x."""
    import triton

    b, h, s, d = x.shape
    assert d % 2 == 0 and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride(), \
        "rope: unit stride over head_dim, cos and sin alike"
    out = torch.empty_like(x)  # x's strides (a dense view of [b, s, h, d] stays one)
    if x.numel() == 0:
        return out
    cb = cos.stride(0) if cos.shape[0] > 1 else 0  # a position table shared by the batch
    _kernel()[(b * s,)](x, out, cos, sin, s, h, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1),
                        out.stride(2), cb, cos.stride(1), HALF=d // 2, BLOCK_H=triton.next_power_of_2(h),
                        BACKWARD=backward)
    return out


class TritonRope(torch.autograd.Function):
    """q, k [b, h, s, d] (HF's layout: views of [b, s, h, d]), cos, sin [b or 1, s, d] (no grad) -> q, k rotated;
    one read and one write of q and k each way."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = cos.to(q.dtype).contiguous(), sin.to(q.dtype).contiguous()
        ctx.save_for_backward(cos, sin)
        return _launch(q, cos, sin, False), _launch(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq: Tensor | None, dk: Tensor | None):
        cos, sin = ctx.saved_tensors

        def grad(g: Tensor | None) -> Tensor | None:
            if g is None:
                return None
            if g.stride(-1) != 1:
                g = g.contiguous()
            return _launch(g, cos, sin, True)

        return grad(dq), grad(dk), None, None


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE on q, k [b, h, s, d] with cos, sin [b, s, d]: the Triton kernel on CUDA, HF's ops elsewhere."""
    if rope_kernel_for(q) == "triton" and q.dtype == k.dtype and cos.dtype == q.dtype:
        return TritonRope.apply(q, k, cos, sin)
    return torch_rope(q, k, cos, sin)


class FusedRopeAttention(nn.Module):
    """Drop-in for a Qwen3 attention module (ROPE_ATTENTIONS): the same children under the same names (q_proj,
    k_proj, v_proj, o_proj, q_norm, k_norm) and attributes, HF's forward with RoPE through apply_rope."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            setattr(self, name, getattr(attn, name))
        for name in ("config", "layer_idx", "head_dim", "num_key_value_groups", "scaling", "attention_dropout",
                     "is_causal", "sliding_window", "layer_type"):
            setattr(self, name, getattr(attn, name, None))

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                attention_mask: Tensor | None = None, past_key_values: Any = None, cache: Any = None,
                cache_position: Any = None, **kwargs: Any) -> tuple[Tensor, Any]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        assert past_key_values is None and cache is None, "FusedRopeAttention trains without a KV cache"
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        # [b, s, h*d] -> [b, s, h, d] -> [b, h, s, d] (views): HF's layout for the attention function
        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rope(q, k, cos, sin)
        attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, weights = attend(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                              self.attention_dropout, scaling=self.scaling, sliding_window=self.sliding_window,
                              **kwargs)
        out = out.reshape(*input_shape, -1).contiguous()  # [b, s, h, d] -> [b, s, h*d]
        return self.o_proj(out), weights


def use_fused_rope(model: nn.Module) -> int:
    """Replace every ROPE_ATTENTIONS module of `model` by a FusedRopeAttention in place; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child).__name__ in ROPE_ATTENTIONS]
    for parent, name, child in targets:
        setattr(parent, name, FusedRopeAttention(child))
    return len(targets)
