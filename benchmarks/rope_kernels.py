"""RoPE per rank: the fused Triton kernel (ulysses_trainer/levers/rope.py) against transformers' rotate_half path,
and Liger-Kernel's liger_rotary_pos_emb where it is installed, on one GPU.

    python benchmarks/rope_kernels.py --out DIR [--tokens 131072,262144,524288,1048576] [--models qwen3-4b,qwen3-8b]

For each model's head shape (its query and KV heads and head_dim, from the presets) and each tokens-per-rank count:
q [1, T, hq, d] and k [1, T, hkv, d] in bf16, viewed [1, h, T, d] as HF's attention hands them over, cos and sin
[1, T, d]. Median forward and backward seconds over --iters after one untimed call, the effective bandwidth
(forward: q and k read and written once, 4 bytes a pair of elements; backward the same for their gradients), and
whether the Triton kernel's output and gradients equal HF's bitwise. Writes DIR/rope_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _time(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, fn, q, k, cos, sin, iters: int) -> dict:
    """Forward and backward seconds of fn(q, k, cos, sin) -> (q', k')."""
    g = [torch.randn_like(t) for t in (q, k)]
    out = {}

    def fwd():
        with torch.no_grad():
            fn(q, k, cos, sin)

    out["fwd_s"] = _time(fwd, iters)
    qg, kg = (t.detach().requires_grad_() for t in (q, k))
    state = {}

    def prep():
        state["y"] = fn(qg, kg, cos, sin)

    def bwd():
        torch.autograd.backward(state["y"], g)
        qg.grad = kg.grad = None

    times = []
    for _ in range(iters + 1):
        prep()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        bwd()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["bwd_s"] = statistics.median(times[1:])
    moved = 2 * (q.numel() + k.numel()) * q.element_size()  # read and write q and k once
    out["fwd_GBps"] = moved / out["fwd_s"] / 1e9
    out["bwd_GBps"] = moved / out["bwd_s"] / 1e9
    print(f"  {name}: fwd {out['fwd_s'] * 1e3:.2f} ms, bwd {out['bwd_s'] * 1e3:.2f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a directory")
    ap.add_argument("--tokens", default="131072,262144,524288,1048576")
    ap.add_argument("--models", default="qwen3-4b,qwen3-8b")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.levers.rope import TritonRope

    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        liger_rotary_pos_emb = None
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "rope_kernels.json")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "liger": liger_rotary_pos_emb is not None, "points": []}
    for model in args.models.split(","):
        c = preset_config(model)
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        for T in (int(t) for t in args.tokens.split(",")):
            print(f"{model}: {T} tokens, {hq}/{hkv} heads of {d}", flush=True)
            q = torch.randn(1, T, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            k = torch.randn(1, T, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            inv = 1.0 / (c.rope_parameters.get("rope_theta", 1e6) ** (torch.arange(0, d, 2, device="cuda") / d))
            emb = torch.arange(T, device="cuda").float()[:, None] * inv[None]
            emb = torch.cat([emb, emb], -1)[None]
            cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
            point = {"model": model, "tokens": T, "heads": [hq, hkv, d]}
            point["rotate_half"] = measure("rotate_half", apply_rotary_pos_emb, q, k, cos, sin, args.iters)
            point["triton"] = measure("triton", TritonRope.apply, q, k, cos, sin, args.iters)
            with torch.no_grad():
                same = all(torch.equal(a, b) for a, b in zip(TritonRope.apply(q, k, cos, sin),
                                                             apply_rotary_pos_emb(q, k, cos, sin)))
            point["triton_bitwise_equal_forward"] = same
            if liger_rotary_pos_emb is not None:  # Liger takes contiguous [b, h, s, d]
                qc, kc = q.contiguous(), k.contiguous()
                point["liger_contiguous_inputs"] = measure("liger", liger_rotary_pos_emb, qc, kc, cos, sin,
                                                           args.iters)
                del qc, kc
            for key in ("fwd_s", "bwd_s"):
                point[f"speedup_{key}"] = point["rotate_half"][key] / point["triton"][key]
            result["points"].append(point)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            del q, k, cos, sin, emb
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
