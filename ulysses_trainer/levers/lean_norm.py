"""RMSNorm that keeps only its input for backward: the HF RMSNorm's math, a fraction of its memory.

HF's Qwen3RMSNorm upcasts its input to fp32 and multiplies by the weight after casting back, so
autograd keeps an fp32 copy of the input (4 bytes per element) and the normalized tensor (2 more in
bf16) for every norm: a Qwen3 layer has four (input, q, k, post-attention), which at Qwen3-4B hold
about 14 bytes x tokens x hidden during the layer's backward — 35 GiB of the 126 GiB one layer needs
at 1M tokens on one GPU. This one runs the same forward ops (bitwise the same output), saves the
input (already alive: the layer checkpoint, the projection output or the residual sum) and one fp32
scale per row, and rebuilds the rest in backward a bounded slab of rows at a time.

Two kernels, the same saved tensors (input, fp32 1/rms per row) and the same math (fp32 rms, the
normalized tensor cast to the input dtype, then times the weight): `torch` runs it as torch ops (any
device; bitwise HF's forward), `triton` as Liger-Kernel's fused Triton RMSNorm (CUDA; one read and one
write per pass instead of a dozen fp32 passes: the norms are most of a layer's elementwise time at
long lengths; same results to bf16 rounding).
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor, nn

from ..vocabulary.names import NORM_KERNELS

_PACKAGE = __name__.split(".")[0] + "."  # this package's own modules are never HF norms

# Backward rebuilds the fp32 copy for at most this many elements at once (64 MiB of fp32 per tensor).
_BACKWARD_SLAB_ELEMENTS = 16 * 2**20


@functools.cache
def _triton_function():
    """Liger-Kernel's RMSNorm autograd Function, None where it (or Triton) is not installed."""
    try:
        return importlib.import_module("liger_kernel.ops.rms_norm").LigerRMSNormFunction
    except Exception:  # ImportError, or a Triton that fails to load without a GPU
        return None


def available_norm_kernels() -> list[str]:
    """Installed RMSNorm kernels, fastest first: triton needs CUDA and liger-kernel."""
    fused = torch.cuda.is_available() and _triton_function() is not None
    return ["triton", "torch"] if fused else ["torch"]


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                     fp32_weight: bool = False) -> tuple[Tensor, Tensor]:
    """HF RMSNorm's forward, op for op; also returns rstd = 1/sqrt(mean(x^2) + eps), fp32 [..., 1]. offset 0:
    Qwen3's (normalized, cast, times weight); offset > 0: the zero-centred norm of Qwen3.5 (normalized times
    offset + weight in fp32, then cast); fp32_weight: offset 0 the same way (OLMo 2's: weight times the fp32
    normalized, then cast)."""
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset or fp32_weight:
        return ((xf * rstd) * (offset + weight.float())).type_as(x), rstd
    return weight * (xf * rstd).to(x.dtype), rstd


class _LeanRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: float, fp32_weight: bool = False) -> Tensor:
        out, rstd = rms_norm_forward(x, weight, eps, offset, fp32_weight)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.fp32_weight = offset, fp32_weight
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, rstd = ctx.saved_tensors
        offset = ctx.offset
        width = x.shape[-1]
        x2 = x.reshape(-1, width)  # [..., W] -> [N, W]: rows are independent
        g2 = grad_out.reshape(-1, width)  # [N, W]
        r2 = rstd.reshape(-1, 1)  # [N, 1]
        grad_x = torch.empty_like(x2) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(width, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        rows = max(1, _BACKWARD_SLAB_ELEMENTS // width)
        for s in range(0, x2.shape[0], rows):
            xf = x2[s:s + rows].to(torch.float32)  # [n, W]
            r, g = r2[s:s + rows], g2[s:s + rows]
            if offset or ctx.fp32_weight:  # fp32 throughout: out = (x * rstd) * (offset + weight)
                nf = xf * r  # [n, W]
                gf = g.to(torch.float32)
                if grad_w is not None:
                    grad_w += (gf * nf).sum(0)
                gn = gf * (offset + weight.float())  # [n, W]
            else:
                n = (xf * r).to(x.dtype)  # the forward's normalized tensor, rebuilt
                if grad_w is not None:  # d(weight * n)/d(weight), summed over rows (fp32 across slabs)
                    grad_w += (g * n).to(torch.float32).sum(0)
                # the chain rule through weight*, .to(dtype), x*rstd, rsqrt, mean and pow(2), as autograd
                # takes it for the HF module
                gn = (g * weight).to(torch.float32)  # [n, W]
            if grad_x is not None:
                grad_r = (gn * xf).sum(-1, keepdim=True)  # [n, 1]
                grad_var = -0.5 * grad_r * r.pow(3)  # rsqrt'(v) = -1/2 rsqrt(v)^3
                grad_x[s:s + rows] = (gn * r + (grad_var.expand_as(xf) / width) * (2 * xf)).to(x.dtype)
        return (None if grad_x is None else grad_x.view_as(x),
                None if grad_w is None else grad_w.to(weight.dtype), None, None, None)


class LeanRMSNorm(nn.Module):
    """Drop-in for an HF RMSNorm (Qwen3RMSNorm, LlamaRMSNorm): `weight` and `variance_epsilon` are
    adopted under the same names, so state_dict keys are unchanged."""

    def __init__(self, norm: nn.Module, kernel: str = "torch", offset: float = 0.0, fp32_weight: bool = False):
        super().__init__()
        self.offset = float(offset)  # scale by offset + weight (Qwen3.5's zero-centred norms: 1.0)
        self.fp32_weight = bool(fp32_weight)  # the weight multiplies in fp32, then the cast (OLMo 2's norms)
        if kernel not in NORM_KERNELS:
            raise ValueError(f"norm kernel {kernel!r}: use one of {', '.join(NORM_KERNELS)}")
        if kernel == "triton" and _triton_function() is None:
            raise ValueError("norm kernel 'triton' needs liger-kernel (pip install 'ulysses_trainer[liger]'); "
                             "use 'torch'")
        self.kernel = kernel
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        assert isinstance(getattr(norm, "weight", None), nn.Parameter) and eps is not None, (
            f"lean_norm replaces HF RMSNorms (a weight and variance_epsilon); {type(norm).__name__} is not "
            "one. Set lean_norm: false for this model")
        self.weight = norm.weight
        self.variance_epsilon = float(eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, kernel={self.kernel}"

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel == "triton" and x.is_cuda:
            # (x, weight, eps, offset, casting: "llama" fp32 rms, cast, then * weight; "gemma" all in fp32 with
            # offset + weight, then cast; dx not written into dy)
            casting = "gemma" if self.offset or self.fp32_weight else "llama"
            return _triton_function().apply(x, self.weight, self.variance_epsilon, self.offset, casting, False)
        if not torch.is_grad_enabled() or not (x.requires_grad or self.weight.requires_grad):
            return rms_norm_forward(x, self.weight, self.variance_epsilon, self.offset, self.fp32_weight)[0]
        return _LeanRMSNormFunction.apply(x, self.weight, self.variance_epsilon, self.offset, self.fp32_weight)


def is_rms_norm(module: nn.Module) -> bool:
    """An HF RMSNorm by class name (Qwen3RMSNorm, LlamaRMSNorm, ...), not one of this package's lean norms (this
    module's, or a family's own: Qwen3.5's LeanGatedRMSNorm, swapped in before this runs)."""
    return type(module).__name__.endswith("RMSNorm") and not type(module).__module__.startswith(_PACKAGE)


def use_lean_norms(model: nn.Module, kernel: str = "torch", offset: float = 0.0, fp32_weight: bool = False) -> int:
    """Replace every HF RMSNorm in `model` by a LeanRMSNorm (running `kernel`, scaling by offset + weight: the
    family's norm_offset) in place; returns how many. A family's other norms (Qwen3.5's gated one) are its own
    torch side's to swap (families/qwen3_5/lean_gated_norm.py)."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if is_rms_norm(child)]
    for parent, name, child in targets:
        setattr(parent, name, LeanRMSNorm(child, kernel, offset, fp32_weight))
    return len(targets)
