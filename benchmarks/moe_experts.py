"""One sparse MoE block (levers/sparse_moe.SparseMoE around transformers' Qwen3MoeSparseMoeBlock) alone,
forward + backward, by experts_implementation and tile count: seconds, active TFLOP/s and peak memory.

    python benchmarks/moe_experts.py --out moe_experts_h200.json               # Qwen3-30B-A3B's block, 131,072 rows
    python benchmarks/moe_experts.py --model qwen3.5-35b-a3b --out moe_experts_35b_h100.json  # its shared expert too
    python benchmarks/moe_experts.py --model tiny-moe --tokens 512 --device cpu --out smoke_moe_experts.json

Inputs are random (never zeros: kernels run faster on zeros), the router's weights too, so the routing
spreads rows over the experts as a trained router roughly does. Active FLOPs: 6 x rows x top_k x 3 x H x I
(forward 2, backward 4 per active expert parameter and row); a shared expert's (Qwen3.5-MoE) are counted apart
(shared_expert_flops), its time is in the block's. A tile count of 1 is the untiled block; an
implementation that runs out of memory is recorded with the error, not skipped. plan/rates.EXPERTS_TFLOPS
holds the H200 rates this measures; the memory model's sparse terms (families/qwen3_moe.SparseMoeMlp.saved) are
compared with the measured peak above the block's input by whoever updates them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_trainer.families.presets import preset_config  # noqa: E402
from ulysses_trainer.levers.sparse_moe import SparseMoE  # noqa: E402


def _time(fn, iters: int, device: torch.device) -> float:
    """Median seconds of iters calls after one untimed call (compilation, autotuning)."""
    ts = []
    for _ in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def _block_class(cfg):
    """transformers' sparse block of the preset's family: Qwen3-MoE's, or Qwen3.5-MoE's (with its shared expert)."""
    if cfg.model_type.startswith("qwen3_5_moe"):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

        return Qwen3_5MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return Qwen3MoeSparseMoeBlock


def measure(model: str, tokens: int, impl: str, tiles: int, iters: int, device: torch.device,
            dtype: torch.dtype) -> dict:
    cfg = preset_config(model)
    cfg._experts_implementation = impl  # read by transformers' experts dispatch (set_experts_implementation's field)
    torch.manual_seed(0)
    with torch.device(device):
        block = _block_class(cfg)(cfg).to(dtype)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
    # a config without norm_topk_prob (Qwen3.5-MoE) has a router that always renormalises
    moe = SparseMoE(block, tiles, None, cfg.num_experts_per_tok, getattr(cfg, "norm_topk_prob", True))
    x = torch.randn(1, tokens, cfg.hidden_size, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    flops = 6.0 * tokens * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0  # Qwen3.5-MoE: an MLP on every row, timed too
    row = {"model": model, "tokens": tokens, "experts_implementation": impl, "tiles": tiles,
           "dtype": str(dtype).removeprefix("torch."), "active_flops": flops,
           "shared_expert_flops": 6.0 * tokens * 3 * cfg.hidden_size * shared,
           # what transformers' experts dispatch reads at each call: proves the kernel timed is the one named
           "dispatched": getattr(getattr(block.experts, "config", cfg), "_experts_implementation", None)}

    def step():
        xg = x.detach().requires_grad_(True)
        moe(xg).backward(dy)
        for p in moe.parameters():
            p.grad = None

    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        s = _time(step, iters, device)
        row.update(fwd_bwd_s=s, active_tflops=flops / s / 1e12)
        if device.type == "cuda":
            row["peak_above_start_gb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    except torch.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--impls", default="eager,grouped_mm,batched_mm")
    ap.add_argument("--tiles", default="1,4,8", help="tile counts, comma-separated (1 = untiled)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for impl in args.impls.split(","):
        for tiles in (int(t) for t in args.tiles.split(",")):
            rows.append(measure(args.model, args.tokens, impl, tiles, args.iters, device, dtype))
            print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    import transformers

    with open(args.out, "w") as f:
        json.dump({"gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
