"""flash-attn-4's options at one KV head per rank: is there a faster way to run the reference run's attention?

    python benchmarks/fa4_options.py --out fa4_options_h200.json [--length 1048576] [--iters 1]

What the 1M reference run's rank runs in every layer: causal bf16 attention of 4 query heads over 1 KV head
(sp = 8 of Qwen3-8B's 32 / 8 heads), head_dim 128, forward and backward, on random normal data (never zeros:
kernels run faster on zeros). The trainer calls flash-attn-4's explicit-LSE forward and backward
(attention/grouped.py `_fa4_fwd` / `_fa4_bwd`). Variants, each through the same two entry points so only the
option differs:
- `library`: the library's defaults (forward pack_gqa auto, backward pack_gqa False), what every other row
  is compared with (the tile rows of fa4_tiles_h200.json call this row `trainer`: it was the trainer's call then);
- `trainer`: the trainer's own calls (on Hopper at head_dim 128 its tiles, grouped.py FA4_SM90_FWD / _BWD);
- `fwd_pack_gqa_true` / `fwd_pack_gqa_false`: the forward with GQA packing forced on / off;
- `bwd_pack_gqa_true`: the backward with the 4 query heads packed over their KV head;
- `expanded_kv`: K and V copied to 4 heads (plain multi-head attention), dK / dV summed back over the group
  (what a kernel without GQA support would run; the copies and the sum are timed with it).
- `fwd_tile_*` / `fwd_smem_pv` / `fwd_no_wg_overlap`: the forward's tile shape and pipeline flags (its own
  arguments); `bwd_*`: the Hopper backward's tile table with one or two fields changed (m/n block, pipeline
  stages, swapped operands, warp-group layout), for that call only. A tile variant times only the half it
  changes; the other half is the library row's.
A variant the library refuses is recorded with its error. TFLOP/s count causal attention as half of full
attention and the backward as 2.5 x the forward, as attention_kernels.py does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention_kernels import _time  # noqa: E402 - the same timing as the kernel table

# forward tiles go through the entry point's own arguments (tile_mn, mma_pv_is_rs, intra_wg_overlap)
FWD_TILES = {
    "fwd_tile_128x96": {"tile_mn": (128, 96)},
    "fwd_tile_128x160": {"tile_mn": (128, 160)},
    "fwd_tile_128x176": {"tile_mn": (128, 176)},
    "fwd_tile_192x128_smem_pv": {"tile_mn": (192, 128), "mma_pv_is_rs": False},
    "fwd_smem_pv": {"mma_pv_is_rs": False},
    "fwd_no_wg_overlap": {"intra_wg_overlap": False},
}
# on Hopper the backward takes its tiles from the library's table (_tile_size_bwd_sm90), not from its
# arguments: these variants replace fields of the table's answer for the duration of the call only
BWD_TILES = {
    "bwd_m80_dq_swap": {"m_block_size": 80, "dQ_swapAB": True},  # the table's non-causal choice
    "bwd_m96_dq_swap": {"m_block_size": 96, "dQ_swapAB": True},
    "bwd_n96": {"n_block_size": 96},
    "bwd_pds_1_stage": {"num_stages_PdS": 1},
    "bwd_q_1_stage": {"num_stages_Q": 1},
    "bwd_dq_single_wg": {"dQ_single_wg": True},
    "bwd_sdp_no_swap": {"SdP_swapAB": False, "AtomLayoutMSdP": 1},
    "bwd_ndkv_1": {"AtomLayoutNdKV": 1},
}
# the best forward tile with the best backward table
BOTH = {"fwd192_smem_pv_bwd_m80": ("fwd_tile_192x128_smem_pv", "bwd_m80_dq_swap")}


def _variant(name: str):
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    from ulysses_trainer.attention.grouped import _fa4_bwd, _fa4_fwd, _sm90_bwd_tiles

    if name == "trainer":  # the trainer's own calls, with its tiles (attention/grouped.py)
        return (lambda q, k, v, scale: _fa4_fwd(q, k, v, scale)[:2],
                lambda g, q, k, v, out, lse, scale: _fa4_bwd(g, q, k, v, out, lse, (), scale))

    fwd_name, bwd_name = BOTH.get(name, (name, name))
    fwd_kw = {"fwd_pack_gqa_true": {"pack_gqa": True}, "fwd_pack_gqa_false": {"pack_gqa": False},
              **FWD_TILES}.get(fwd_name, {})
    bwd_kw = {"bwd_pack_gqa_true": {"pack_gqa": True}}.get(bwd_name, {})
    bwd_fields = BWD_TILES.get(bwd_name)
    expand = name == "expanded_kv"

    def fwd(q, k, v, scale):
        if expand:  # [b, s, 1, d] -> [b, s, r, d], a copy
            k, v = (t.expand(-1, -1, q.shape[2], -1).contiguous() for t in (k, v))
        out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True, **fwd_kw)[:2]
        return out, lse

    def bwd(g, q, k, v, out, lse, scale):
        if expand:
            k, v = (t.expand(-1, -1, q.shape[2], -1).contiguous() for t in (k, v))
        # the trainer's own scoped table override (head_dim 128, this shape's), with this variant's fields
        with _sm90_bwd_tiles(bwd_fields) if bwd_fields else contextlib.nullcontext():
            dq, dk, dv = _flash_attn_bwd(q, k, v, out, g, lse.contiguous(), softmax_scale=scale, causal=True,
                                         **bwd_kw)[:3]
        if expand:  # [b, s, r, d] -> [b, s, 1, d]: the group's gradients summed onto its KV head
            dk, dv = dk.sum(2, keepdim=True), dv.sum(2, keepdim=True)
        return dq, dk, dv

    return fwd, bwd


VARIANTS = ("library", "trainer", "fwd_pack_gqa_true", "fwd_pack_gqa_false", "bwd_pack_gqa_true", "expanded_kv",
            *FWD_TILES, *BWD_TILES, *BOTH)


def point(name: str, a, ref: dict | None, ref_row: dict | None) -> tuple[dict, dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    L, h, d = a.length, a.heads, 128
    q = torch.randn((1, L, h, d), device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn((1, L, 1, d), device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn((1, L, h, d), device="cuda", dtype=torch.bfloat16, generator=g)
    scale = d ** -0.5
    fwd, bwd = _variant(name)
    # a tile variant changes one half: the other half is the library's call, timed once in its row
    same_fwd, same_bwd = ref_row is not None and name in BWD_TILES, ref_row is not None and name in FWD_TILES
    t_f = ref_row["fwd_s"] if same_fwd else _time(lambda: fwd(q, k, v, scale), a.iters)
    out, lse = fwd(q, k, v, scale)
    t_b = ref_row["bwd_s"] if same_bwd else _time(lambda: bwd(dout, q, k, v, out, lse, scale), a.iters)
    row = {"variant": name, "seq_len": L, "heads": h, "kv_heads": 1, "head_dim": d, "data": "random",
           "fwd_s": t_f, "bwd_s": t_b, "fwd_bwd_s": t_f + t_b,
           "timed": "backward" if same_fwd else "forward" if same_bwd else "both"}
    flops = 2.0 * L * L * h * d  # causal forward: half of 4 L^2 h d
    row["fwd_bwd_tflops"] = 3.5 * flops / (t_f + t_b) / 1e12
    dq, dk, dv = bwd(dout, q, k, v, out, lse, scale)
    outputs = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if ref is not None:  # the same inputs and incoming gradient as the library's call: equal to bf16 rounding
        row["max_abs_diff_vs_library"] = {n: float((x.float() - ref[n].float()).abs().max())
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
    rows, ref, ref_row = [], None, None
    for name in a.variants.split(","):
        try:
            row, outputs = point(name, a, ref, ref_row)
        except Exception as e:  # a variant the library refuses: recorded, the others still run
            first = (str(e).strip().splitlines() or [""])[0][:300]  # an assertion may carry no message
            row, outputs = {"variant": name, "error": f"{type(e).__name__}: {first}"}, None
        if name == "library":  # the reference every other row is compared with
            ref, ref_row = outputs, row
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
