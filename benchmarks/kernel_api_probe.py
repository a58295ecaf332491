"""Probe PyTorch's explicit-LSE attention ops on the GPU: forward returning (out, lse) and a backward that
takes them, called per KV-head group. Checks them against SDPA's autograd (forward and grads) and times
them at long lengths. Writes one JSON. attention/grouped.py wraps these ops; the probe calls its wrappers.

    python benchmarks/kernel_api_probe.py --out probe.json [--lengths 4096,131072]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ulysses_trainer.attention.grouped import BACKENDS as GROUPED  # noqa: E402

OPS = torch.ops.aten
BACKENDS = {name: GROUPED[name] for name in ("cudnn", "flash")}  # the library's explicit-LSE wrappers


def make(s, hq=32, hkv=8, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # physical [b, s, h, d] as our kernels receive it, viewed [b, h, s, d]
    q = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k = torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    v = torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    dout = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    return q, k, v, dout


def explicit_grouped(backend, q, k, v, dout, scale):
    """Forward over all heads (k, v expanded per group view), backward one KV group at a time."""
    hq, hkv = q.shape[1], k.shape[1]
    r = hq // hkv
    ke, ve = (t.repeat_interleave(r, dim=1) for t in (k, v))  # [b, hkv, s, d] -> [b, hq, s, d]
    out, lse, aux = backend.fwd(q, ke, ve, scale)
    del ke, ve
    dq = torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for j in range(hkv):
        sl = slice(j * r, (j + 1) * r)
        kg = k[:, j:j + 1].repeat(1, r, 1, 1)  # [b, 1, s, d] -> [b, r, s, d]
        vg = v[:, j:j + 1].repeat(1, r, 1, 1)
        a, b_, c = backend.bwd(dout[:, sl], q[:, sl], kg, vg, out[:, sl], lse[:, sl], aux, scale)
        dq[:, sl] = a
        dk[:, j] = b_.sum(1)
        dv[:, j] = c.sum(1)
    return out, dq, dk, dv


def check(name, s, scale):
    backend = BACKENDS[name]
    q, k, v, dout = make(s)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION if name == "cudnn"
                                        else torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(4, 1), vr.repeat_interleave(4, 1),
                                             is_causal=True, scale=scale)
    ref.backward(dout)
    out, dq, dk, dv = explicit_grouped(backend, q, k, v, dout, scale)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    return {"out": rel(out, ref), "dq": rel(dq, qr.grad), "dk": rel(dk, kr.grad), "dv": rel(dv, vr.grad),
            "lse_shape": list(backend.fwd(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), scale)[1].shape)}


def timed(fn, reps=2):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def speed(name, s, scale):
    backend = BACKENDS[name]
    q, k, v, dout = make(s)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    backend = (torch.nn.attention.SDPBackend.CUDNN_ATTENTION if name == "cudnn"
               else torch.nn.attention.SDPBackend.FLASH_ATTENTION)

    def sdpa_fb():
        with torch.nn.attention.sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qr, kr.repeat_interleave(4, 1), vr.repeat_interleave(4, 1),
                                               is_causal=True, scale=scale)
        o.backward(dout)
        qr.grad = kr.grad = vr.grad = None

    def expl_fb():
        explicit_grouped(backend, q, k, v, dout, scale)

    flops = 4 * s * s * 128 * 32 / 2 * 3.5  # causal fwd + bwd (2.5x fwd)
    torch.cuda.reset_peak_memory_stats()
    t1 = timed(sdpa_fb)
    p1 = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    t2 = timed(expl_fb)
    p2 = torch.cuda.max_memory_allocated() / 2**30
    return {"sdpa_autograd_s": t1, "explicit_grouped_s": t2, "sdpa_tflops": flops / t1 / 1e12,
            "explicit_tflops": flops / t2 / 1e12, "sdpa_peak_gib": p1, "explicit_peak_gib": p2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="131072")
    args = ap.parse_args()
    res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "schemas": {n: str(getattr(OPS, n).default._schema) for n in (
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
               "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")}}
    scale = 128 ** -0.5
    for name in BACKENDS:
        try:
            res[f"{name}_check_4096"] = check(name, 4096, scale)
        except Exception as e:  # noqa: BLE001 - the probe reports what fails
            res[f"{name}_check_4096"] = {"error": repr(e)[:600]}
        print(name, res[f"{name}_check_4096"], flush=True)
    for s in (int(x) for x in args.lengths.split(",")):
        for name in BACKENDS:
            try:
                res[f"{name}_speed_{s}"] = speed(name, s, scale)
            except Exception as e:  # noqa: BLE001
                res[f"{name}_speed_{s}"] = {"error": repr(e)[:600]}
            print(name, s, res[f"{name}_speed_{s}"], flush=True)
            torch.cuda.empty_cache()
    json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
