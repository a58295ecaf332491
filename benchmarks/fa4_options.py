"""flash-attn-4's options at one KV head per rank: is there a faster way to run the reference run's attention?

    python benchmarks/fa4_options.py --out fa4_options_h200.json [--length 1048576] [--iters 1]

What the 1M reference run's rank runs in every layer: causal bf16 attention of 4 query heads over 1 KV head
(sp = 8 of Qwen3-8B's 32 / 8 heads), head_dim 128, forward and backward, on random normal data (never zeros:
kernels run faster on zeros). The trainer calls flash-attn-4's explicit-LSE forward and backward
(attention/grouped.py `_fa4_fwd` / `_fa4_bwd`, the library's defaults). Variants, each through the same two
entry points so only the option differs:
- `trainer`: the defaults (forward pack_gqa auto, backward pack_gqa False);
- `fwd_pack_gqa_true` / `fwd_pack_gqa_false`: the forward with GQA packing forced on / off;
- `bwd_pack_gqa_true`: the backward with the 4 query heads packed over their KV head;
- `expanded_kv`: K and V copied to 4 heads (plain multi-head attention), dK / dV summed back over the group
  (what a kernel without GQA support would run; the copies and the sum are timed with it).
A variant the library refuses is recorded with its error. TFLOP/s count causal attention as half of full
attention and the backward as 2.5 x the forward, as attention_kernels.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_kernels import _time  # noqa: E402 - the same timing as the kernel table


def _variant(name: str):
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    fwd_kw = {"fwd_pack_gqa_true": {"pack_gqa": True}, "fwd_pack_gqa_false": {"pack_gqa": False}}.get(name, {})
    bwd_kw = {"bwd_pack_gqa_true": {"pack_gqa": True}}.get(name, {})
    expand = name == "expanded_kv"

    def fwd(q, k, v, scale):
        if expand:  # [b, s, 1, d] -> [b, s, r, d], a copy
            k, v = (t.expand(-1, -1, q.shape[2], -1).contiguous() for t in (k, v))
        out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True, **fwd_kw)[:2]
        return out, lse

    def bwd(g, q, k, v, out, lse, scale):
        if expand:
            k, v = (t.expand(-1, -1, q.shape[2], -1).contiguous() for t in (k, v))
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, g, lse.contiguous(), softmax_scale=scale, causal=True,
                                     **bwd_kw)[:3]
        if expand:  # [b, s, r, d] -> [b, s, 1, d]: the group's gradients summed onto its KV head
            dk, dv = dk.sum(2, keepdim=True), dv.sum(2, keepdim=True)
        return dq, dk, dv

    return fwd, bwd


VARIANTS = ("trainer", "fwd_pack_gqa_true", "fwd_pack_gqa_false", "bwd_pack_gqa_true", "expanded_kv")


def point(name: str, a, ref: dict | None) -> tuple[dict, dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    L, h, d = a.length, a.heads, 128
    q = torch.randn((1, L, h, d), device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn((1, L, 1, d), device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn((1, L, h, d), device="cuda", dtype=torch.bfloat16, generator=g)
    scale = d ** -0.5
    fwd, bwd = _variant(name)
    t_f = _time(lambda: fwd(q, k, v, scale), a.iters)
    out, lse = fwd(q, k, v, scale)
    t_b = _time(lambda: bwd(dout, q, k, v, out, lse, scale), a.iters)
    row = {"variant": name, "seq_len": L, "heads": h, "kv_heads": 1, "head_dim": d, "data": "random",
           "fwd_s": t_f, "bwd_s": t_b, "fwd_bwd_s": t_f + t_b}
    flops = 2.0 * L * L * h * d  # causal forward: half of 4 L^2 h d
    row["fwd_bwd_tflops"] = 3.5 * flops / (t_f + t_b) / 1e12
    dq, dk, dv = bwd(dout, q, k, v, out, lse, scale)
    outputs = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if ref is not None:  # the same inputs and incoming gradient as the trainer's call: equal to bf16 rounding
        row["max_abs_diff_vs_trainer"] = {n: float((x.float() - ref[n].float()).abs().max())
                                          for n, x in outputs.items()}
    return row, outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=1048576)
    ap.add_argument("--heads", type=int, default=4, help="query heads over the one KV head")
    ap.add_argument("--iters", type=int, default=1, help="timed calls after one warm-up (compile) call")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rows, ref = [], None
    for name in a.variants.split(","):
        try:
            row, outputs = point(name, a, ref)
        except Exception as e:  # a variant the library refuses: recorded, the others still run
            row, outputs = {"variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}, None
        if name == "trainer":
            ref = outputs
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
