"""The lean RMSNorm's two kernels alone (levers/lean_norm.py): torch ops vs Liger-Kernel's fused Triton
RMSNorm, forward and backward, at the shapes of a long-context Qwen3 layer, on one GPU.

    python benchmarks/norm_kernels.py --out norm_kernels_h200.json

Shapes: the hidden-size norms (input and post-attention: [tokens, hidden]) and the per-head q/k norms
([tokens x heads, 128]) of Qwen3-4B at 262,144 tokens and of Qwen3-8B at 131,072 tokens per GPU. Times are
medians of `--iters` runs after one untimed call (Triton compiles); backward = forward+backward minus
forward with grad. Also the agreement of the two kernels (bf16; torch's forward is bitwise HF's) and the
memory each adds on top of its input. plan/rates.py holds the seconds per element.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.attention_kernels import _time  # noqa: E402 - median of iters runs after an untimed one
from ulysses_trainer.levers.lean_norm import LeanRMSNorm  # noqa: E402

# (label, rows, width): what one layer norms, per pass
SHAPES = (("qwen3-4b 262144 hidden", 262144, 2560), ("qwen3-4b 262144 q heads", 262144 * 32, 128),
          ("qwen3-8b 131072 hidden", 131072, 4096), ("qwen3-8b 131072 q heads", 131072 * 32, 128))


def _run(norm: LeanRMSNorm, x: torch.Tensor, dy: torch.Tensor):
    xg = x.detach().requires_grad_(True)
    y = norm(xg)
    y.backward(dy)
    return y.detach(), xg.grad, norm.weight.grad


def _times(norm: LeanRMSNorm, x: torch.Tensor, dy: torch.Tensor, iters: int) -> tuple[float, float, float]:
    """(forward without grad, forward with grad, forward + backward) seconds."""
    with torch.no_grad():
        fwd = _time(lambda: norm(x), iters)
    xg = x.detach().requires_grad_(True)
    fwd_grad = _time(lambda: norm(xg), iters)

    def step():
        norm.weight.grad = None
        _run(norm, x, dy)
    return fwd, fwd_grad, _time(step, iters)


def measure(rows: int, width: int, iters: int) -> list[dict]:
    torch.manual_seed(0)
    base = Qwen3RMSNorm(width, eps=1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        base.weight.copy_(1 + 0.1 * torch.randn(width, device="cuda"))
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    out, results = {}, []
    for kernel in ("torch", "triton"):
        norm = LeanRMSNorm(base, kernel)
        fwd, fwd_grad, total = _times(norm, x, dy, iters)
        norm.weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out[kernel] = _run(norm, x, dy)
        extra = (torch.cuda.max_memory_allocated() - before) / 2**30
        n = rows * width
        results.append({"kernel": kernel, "rows": rows, "width": width, "fwd_s": fwd, "fwd_grad_s": fwd_grad,
                        "bwd_s": total - fwd_grad, "fwd_ns_per_element": fwd / n * 1e9,
                        "bwd_ns_per_element": (total - fwd_grad) / n * 1e9, "peak_extra_gib": extra,
                        "bytes_per_element_in": x.element_size()})
    (y0, dx0, dw0), (y1, dx1, dw1) = out["torch"], out["triton"]
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    agree = {"out_max_abs_diff": (y1.float() - y0.float()).abs().max().item(),
             "out_rel": rel(y1, y0), "grad_x_rel": rel(dx1, dx0), "grad_w_rel": rel(dw1, dw0)}
    for r in results:
        r["triton_vs_torch"] = agree
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default="norm_kernels_h200.json")
    args = ap.parse_args()
    points = []
    for label, rows, width in SHAPES:
        for p in measure(rows, width, args.iters):
            p["shape"] = label
            points.append(p)
            print(f"{label:26s} {p['kernel']:6s} fwd {p['fwd_s'] * 1e3:7.2f} ms  bwd {p['bwd_s'] * 1e3:7.2f} ms  "
                  f"{p['fwd_ns_per_element'] * 1e3:6.2f} / {p['bwd_ns_per_element'] * 1e3:6.2f} ps per element  "
                  f"+{p['peak_extra_gib']:.2f} GiB  {p['triton_vs_torch']}", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "points": points}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
