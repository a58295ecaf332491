"""Do the kernels run at the same speed on any data? Attention and a dense matmul on random, small and zero inputs.

    python benchmarks/data_dependence.py --out data_dependence_h200.json [--kernels ours_grouped_fa4,...]

Why: a rehearsal on torch's bare fake process group runs its kernels on whatever the collectives' buffers held
(zeros or stale memory, in gathered weights and all-to-all outputs), and an H200 runs faster on zeros (fewer bits
switching: less power, higher clocks). This measures by how much, for what the 1M reference run's rank runs:
causal bf16 attention of 4 query heads over 1 KV head (sp = 8 of Qwen3-8B's 32/8) at 1,048,576 tokens, forward
and backward, through the trainer's own path (attention/grouped.py; FA4 and cuDNN), and the largest matmul of a
layer (131,072 tokens x 4096 -> 12288, MLP up/gate). Data: `random` (standard normal), `small` (normal x
--small-scale), `zeros`; the backward's incoming gradient is of the same kind. It also times a device-to-device
copy, the rate at which the rehearsal's collectives fill their outputs (parallel/local_fill.py).
TFLOP/s count causal attention as half of full attention, backward as 2.5 x forward (attention_kernels.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention_kernels import _ours, _time  # noqa: E402 - the same timing as the kernel table

DATA = ("random", "small", "zeros")


def _tensor(kind: str, shape, scale: float, gen: torch.Generator) -> torch.Tensor:
    if kind == "zeros":
        return torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
    t = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    return t * scale if kind == "small" else t


def attention_point(kernel: str, kind: str, a) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    L, h, hk, d = a.length, a.heads, a.kv_heads, a.head_dim
    q, k, v = (_tensor(kind, (1, L, n, d), a.small_scale, g).requires_grad_() for n in (h, hk, hk))
    fn = _ours(kernel.removeprefix("ours_grouped_"))
    t_f = _time(lambda: fn(q, k, v), a.iters)
    out = fn(q, k, v)
    dout = _tensor(kind, out.shape, a.small_scale, g)  # the incoming gradient: of the same kind as the inputs
    t_b = _time(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), a.iters)
    fwd_flops = 2.0 * L * L * h * d  # causal: half of 4 L^2 h d
    return {"kernel": kernel, "data": kind, "seq_len": L, "heads": h, "kv_heads": hk, "head_dim": d,
            "fwd_s": t_f, "bwd_s": t_b, "fwd_bwd_s": t_f + t_b, "fwd_tflops": fwd_flops / t_f / 1e12,
            "bwd_tflops": 2.5 * fwd_flops / t_b / 1e12, "fwd_bwd_tflops": 3.5 * fwd_flops / (t_f + t_b) / 1e12}


def matmul_point(kind: str, a) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = a.matmul
    x, w = _tensor(kind, (m, k), a.small_scale, g), _tensor(kind, (k, n), a.small_scale, g)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    s = _time(lambda: torch.matmul(x, w, out=out), a.iters * 10)
    return {"kernel": "matmul_bf16", "data": kind, "m": m, "k": k, "n": n, "s": s, "tflops": 2.0 * m * k * n / s / 1e12}


def copy_point(a) -> dict:
    src = torch.randn(a.copy_bytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    s = _time(lambda: dst.copy_(src), a.iters * 10)
    return {"kernel": "copy_d2d", "data": "random", "bytes": a.copy_bytes, "s": s,
            "gb_per_s": a.copy_bytes / s / 1e9}  # bytes written per second (as many read)


def summary(points: list[dict]) -> list[dict]:
    """Per kernel: how much faster zeros and small values run than random data."""
    rows = []
    for kernel in dict.fromkeys(p["kernel"] for p in points if p["kernel"] != "copy_d2d"):
        by = {p["data"]: p for p in points if p["kernel"] == kernel}
        key = "fwd_bwd_s" if "fwd_bwd_s" in by.get("random", {}) else "s"
        if "random" not in by:
            continue
        row = {"kernel": kernel, "random_s": by["random"][key]}
        for kind in ("small", "zeros"):
            if kind in by:
                row[f"{kind}_s"] = by[kind][key]
                row[f"{kind}_faster_by"] = by["random"][key] / by[kind][key] - 1.0
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="ours_grouped_fa4,ours_grouped_cudnn,matmul_bf16",
                    help="comma-separated: ours_grouped_fa4, ours_grouped_cudnn, matmul_bf16")
    ap.add_argument("--data", default=",".join(DATA))
    ap.add_argument("--length", type=int, default=1048576)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--matmul", type=lambda s: tuple(int(x) for x in s.split("x")), default=(131072, 4096, 12288),
                    help="MxKxN (default 131072x4096x12288)")
    ap.add_argument("--small-scale", type=float, default=1e-3)
    ap.add_argument("--copy-bytes", type=int, default=2**30)
    ap.add_argument("--iters", type=int, default=2, help="timed runs per point after one untimed (median)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "small_scale": a.small_scale, "iters": a.iters, "points": []}
    kinds = a.data.split(",")
    for kernel in a.kernels.split(","):
        for kind in kinds:
            point = matmul_point(kind, a) if kernel == "matmul_bf16" else attention_point(kernel, kind, a)
            print(json.dumps(point), flush=True)
            res["points"].append(point)
            torch.cuda.empty_cache()
    res["points"].append(copy_point(a))
    print(json.dumps(res["points"][-1]), flush=True)
    res["summary"] = summary(res["points"])
    print(json.dumps(res["summary"], indent=1), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
