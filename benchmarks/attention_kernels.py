"""Attention kernels alone: causal bf16 GQA forward and backward at long lengths, on one GPU.

    python benchmarks/attention_kernels.py --lengths 32768,65536,131072,262144 --out kernels.json

Cases: `sdpa_default` (what ulysses_trainer's SDPA path calls: enable_gqa, PyTorch picks the
backend), SDPA forced to cuDNN / flash backends (KV expanded where the backend needs it), and
flash-attn-4 when importable. TFLOP/s use causal FLOPs (half of full attention); backward counts
2.5x forward, as flash-attention's benchmarks do. Times are medians of `--iters` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _time(fn, iters):
    ts = []
    for _ in range(iters + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts[1:])  # the first call compiles / autotunes


def _measure(fn, q, k, v, iters):
    t_f = _time(lambda: fn(q, k, v), iters)
    out = fn(q, k, v)
    dout = torch.randn_like(out)
    t_b = _time(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), iters)
    return t_f, t_b


def _sdpa(backend, expand):
    def run(q, k, v):
        if expand:
            k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        gqa = qt.shape[1] != kt.shape[1]
        if backend is None:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa).transpose(1, 2)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa).transpose(1, 2)
    return run


def _fa4(q, k, v):
    from flash_attn.cute.interface import flash_attn_func

    out = flash_attn_func(q, k, v, causal=True)
    return out[0] if isinstance(out, tuple) else out


def _ours(backend_name):
    from ulysses_trainer.attention.grouped import BACKENDS, grouped_attention

    def run(q, k, v):  # what a training step runs: one KV group at a time, explicit LSE (attention/grouped.py)
        return grouped_attention(q, k, v, q.shape[-1] ** -0.5, BACKENDS[backend_name])
    return run


def cases():
    c = {"ours_grouped_cudnn": _ours("cudnn"),
         "sdpa_default": _sdpa(None, False), "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, False),
         "sdpa_cudnn_expanded_kv": _sdpa(SDPBackend.CUDNN_ATTENTION, True),
         "sdpa_flash_expanded_kv": _sdpa(SDPBackend.FLASH_ATTENTION, True)}
    try:
        import flash_attn.cute.interface  # noqa: F401

        c["flash_attention_4"] = _fa4
        c["ours_grouped_fa4"] = _ours("fa4")
    except ImportError:
        pass
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768,65536,131072,262144")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--kernels", default=None, help="comma-separated subset of the cases (default: all)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "heads": a.heads, "kv_heads": a.kv_heads,
           "head_dim": a.head_dim, "points": []}
    for L in (int(x) for x in a.lengths.split(",")):
        fwd_flops = 4 * L * L * a.heads * a.head_dim / 2
        for name, fn in cases().items():
            if a.kernels and name not in a.kernels.split(","):
                continue
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(1, L, a.heads, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(1, L, a.kv_heads, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn_like(k)
            q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
            point = {"kernel": name, "seq_len": L}
            try:
                t_f, t_b = _measure(fn, q, k, v, a.iters)
                point.update(fwd_s=t_f, bwd_s=t_b, fwd_tflops=fwd_flops / t_f / 1e12,
                             fwd_bwd_tflops=3.5 * fwd_flops / (t_f + t_b) / 1e12)
            except Exception as exc:  # noqa: BLE001 - record which backends have no kernel here
                point.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            print(json.dumps(point), flush=True)
            res["points"].append(point)
            del q, k, v
            torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
