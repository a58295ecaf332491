"""The gated RMSNorm of a Gated DeltaNet layer (Qwen3.5), keeping only its input and gate for backward.

transformers' Qwen3_5RMSNormGated: rms-normalise x in fp32, cast back, times the weight, times SiLU of the gate in
fp32, cast back. Autograd then keeps an fp32 copy of x, the normalised tensor, the weighted one, the fp32 gate and
its SiLU: about 18 bytes per element in bf16, on [tokens, value heads x dv] (Qwen3.5-27B at 1M tokens on 8 GPUs:
~12 GiB in one layer's backward). This one runs the same forward ops (bitwise the same output), keeps x, the gate
and one fp32 scale per row, and rebuilds the rest in backward a bounded slab of rows at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_BACKWARD_SLAB_ELEMENTS = 16 * 2**20  # elements of x rebuilt at once in backward (64 MiB of fp32 per tensor)


def gated_norm_forward(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """transformers' forward, op for op; also rstd = 1/sqrt(mean(x^2) + eps), fp32 [..., 1]."""
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * (xf * rstd).to(x.dtype)
    return (y * F.silu(gate.to(torch.float32))).to(x.dtype), rstd


class _LeanGatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        out, rstd = gated_norm_forward(x, gate, weight, eps)
        ctx.save_for_backward(x, gate, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, gate, weight, rstd = ctx.saved_tensors
        width = x.shape[-1]
        x2, z2, g2 = x.reshape(-1, width), gate.reshape(-1, width), grad_out.reshape(-1, width)  # [N, W]
        r2 = rstd.reshape(-1, 1)  # [N, 1]
        need_x, need_z, need_w = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(x2) if need_x else None
        grad_z = torch.empty_like(z2) if need_z else None
        grad_w = torch.zeros(width, dtype=torch.float32, device=x.device) if need_w else None
        rows = max(1, _BACKWARD_SLAB_ELEMENTS // width)
        for s in range(0, x2.shape[0], rows):
            xf, r = x2[s:s + rows].to(torch.float32), r2[s:s + rows]
            zf, g = z2[s:s + rows].to(torch.float32), g2[s:s + rows].to(torch.float32)
            n = (xf * r).to(x.dtype)  # the forward's normalised tensor, rebuilt
            y = weight * n  # [n, W] in the weight's dtype, as the forward made it
            sig = torch.sigmoid(zf)
            if grad_z is not None:  # d(y * silu(z))/dz = y * sigmoid(z) * (1 + z * (1 - sigmoid(z)))
                grad_z[s:s + rows] = (g * y.to(torch.float32) * sig * (1 + zf * (1 - sig))).to(gate.dtype)
            gy = (g * zf * sig).to(y.dtype)  # d/dy, cast to y's dtype as autograd does
            if grad_w is not None:
                grad_w += (gy * n).to(torch.float32).sum(0)
            if grad_x is not None:  # the chain rule through weight*, .to(dtype), x*rstd, rsqrt, mean and pow(2)
                gn = (gy * weight).to(torch.float32)
                grad_r = (gn * xf).sum(-1, keepdim=True)
                grad_x[s:s + rows] = (gn * r + (-0.5 * grad_r * r.pow(3) / width) * (2 * xf)).to(x.dtype)
        return (None if grad_x is None else grad_x.view_as(x), None if grad_z is None else grad_z.view_as(gate),
                None if grad_w is None else grad_w.to(weight.dtype), None)


class LeanGatedRMSNorm(nn.Module):
    """Drop-in for transformers' Qwen3_5RMSNormGated (`weight`, `variance_epsilon` adopted under the same names):
    forward(x, gate)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        assert getattr(norm, "activation", "silu") == "silu", "the gated norm's gate is SiLU in Qwen3.5"
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        if not torch.is_grad_enabled() or not (x.requires_grad or gate.requires_grad or self.weight.requires_grad):
            return gated_norm_forward(x, gate, self.weight, self.variance_epsilon)[0]
        return _LeanGatedNorm.apply(x, gate, self.weight, self.variance_epsilon)


def is_gated_rms_norm(module: nn.Module) -> bool:
    """transformers' gated RMSNorm by class name (Qwen3_5RMSNormGated, Qwen3_5MoeRMSNormGated), not one replaced."""
    return type(module).__name__.endswith("RMSNormGated") and not isinstance(module, LeanGatedRMSNorm)


def use_lean_gated_norms(model: nn.Module) -> int:
    """Replace every transformers gated RMSNorm in `model` by a LeanGatedRMSNorm in place; returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if is_gated_rms_norm(child)]
    for parent, name, child in targets:
        setattr(parent, name, LeanGatedRMSNorm(child))
    return len(targets)
