"""gpt-oss's attention on one GPU at its per-rank shape: bf16, the sinks, forward and backward.

    python benchmarks/sink_attention.py --out sink_attention.json [--lengths 131072,1048576]

gpt-oss-20b at sp=8: 8 query heads and 1 KV head of 64 a rank (its 64 / 8, KV replicated past 8), the whole
sequence. Cases per length: the sliding layers' path (attention/kernels.sink_attention with window 128: the query
blocks batched, attention/windowed.py) and, at the shortest length, the per-block loop it replaced (one SDPA call
per 128 queries) as a check of equal outputs and gradients and of the time; the full layers' path through each
installed kernel (the sink as a key of its own, widened to head_dim 72). Times are medians of `--iters` runs after
one untimed call; the full layers' TFLOP/s count causal FLOPs at head_dim 64, backward 2.5x forward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.attention_kernels import _time  # noqa: E402 — median of iters runs after one untimed call

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 8, 1, 64, 128


def _loop_windowed(qa, ka, va, scale: float, window: int, n: int) -> torch.Tensor:
    """The per-block path the batched one replaced: one SDPA call per `window` queries (its mask reaches the sink)."""
    outs = []
    for a in range(0, n, window):
        e, lo = min(a + window, n), max(0, a - window + 1)
        qi = torch.arange(a, e, device=qa.device)[:, None]
        ki = torch.arange(lo, e, device=qa.device)[None, :]
        mask = torch.cat([torch.ones_like(qi, dtype=torch.bool), (ki <= qi) & (ki > qi - window)], dim=1)
        kk, vv = (torch.cat([t[:1], t[lo + 1:e + 1]]) for t in (ka, va))
        out = F.scaled_dot_product_attention(qa[None, a + 1:e + 1].transpose(1, 2), kk[None].transpose(1, 2),
                                             vv[None].transpose(1, 2), attn_mask=mask, scale=scale,
                                             enable_gqa=qa.shape[1] != ka.shape[1])
        outs.append(out.transpose(1, 2)[0])
    return torch.cat(outs)


def _fwd_bwd(fn, inputs):
    out = fn()
    grads = torch.autograd.grad(out.float().square().sum(), inputs)
    return out, grads


def _rows_at(n: int, iters: int, check: bool) -> list[dict]:
    from ulysses_trainer.attention.kernels import KERNEL_FUNCTIONS, _sink_document, available_kernels, sink_attention

    dev, scale = torch.device("cuda"), HEAD_DIM ** -0.5
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, n, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(1, n, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    sinks = torch.randn(HEADS, device=dev, generator=g).requires_grad_()
    inputs = (q, k, v, sinks)

    def run(kernel: str, window: int | None):
        return lambda: sink_attention(q, k, v, sinks, scale=scale, attend=KERNEL_FUNCTIONS[kernel], window=window)

    def looped():
        qa, ka, va = _sink_document(q[0], k[0], v[0], sinks, scale)
        return _loop_windowed(qa, ka, va, scale, WINDOW, n)[..., :HEAD_DIM][None]

    batched, rows = run("sdpa", WINDOW), []
    torch.cuda.reset_peak_memory_stats()
    rows.append({"tokens": n, "case": "sliding, blocks batched", "window": WINDOW, "fwd_s": _time(batched, iters),
                 "fwd_bwd_s": _time(lambda: _fwd_bwd(batched, inputs), iters),
                 "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
    print(rows[-1], flush=True)
    if check:
        got, want = _fwd_bwd(batched, inputs), _fwd_bwd(looped, inputs)
        rel = [float((a.float() - b.float()).norm() / b.float().norm())
               for a, b in zip((got[0], *got[1]), (want[0], *want[1]))]
        rows.append({"tokens": n, "case": "sliding, one SDPA call per block (replaced)", "window": WINDOW,
                     "fwd_s": _time(looped, 1), "fwd_bwd_s": _time(lambda: _fwd_bwd(looped, inputs), 1),
                     "batched_vs_loop_rel_err_out_dq_dk_dv_dsinks": rel})
        print(rows[-1], flush=True)
    flops = 4 * n * n / 2 * HEAD_DIM * HEADS  # causal forward at head_dim 64
    for kernel in [k for k in available_kernels() if k in ("sdpa", "flash_attention_4")]:
        full = run(kernel, None)
        try:
            t_f = _time(full, iters)
            t_fb = _time(lambda f=full: _fwd_bwd(f, inputs), iters)
        except Exception as e:  # noqa: BLE001 — a kernel that refuses the widened head is a result
            rows.append({"tokens": n, "case": f"full, {kernel}", "error": f"{type(e).__name__}: {e}"[:400]})
        else:
            rows.append({"tokens": n, "case": f"full, {kernel}", "fwd_s": t_f, "fwd_bwd_s": t_fb,
                         "tflops_fwd_bwd": flops * 3.5 / t_fb / 1e12})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="131072,1048576")
    ap.add_argument("--iters", type=int, default=2)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = [r for n in lengths for r in _rows_at(n, args.iters, check=n == min(lengths))]
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
