"""Where one forward + backward of ours spends its time: torch.profiler over one step (after a warm-up
step), kernel time summed into buckets, written as JSON: what to look at when a step is slower than its
attention kernels predict.

    python benchmarks/profile_step.py --model qwen3-4b --length 131072 --keep-attention-outputs true \
        --offload true --out profile.json

Buckets (by kernel name): attention forward / backward (cuDNN, flash, the CPU flash kernel), matmul (GEMMs),
copies (memcpy, host transfers), reductions and elementwise (the rest). On CPU the same code runs with CPU
op times, which is what tests/test_benchmark_smoke.py checks; the numbers that matter come from a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from benchmarks.long_context import _init_dist, _plan_ours, _policy  # noqa: E402
from benchmarks.systems import SYSTEMS  # noqa: E402
from ulysses_trainer.families.presets import preset_config  # noqa: E402
from ulysses_trainer.levers import rope  # noqa: E402
from ulysses_trainer.model.load import build_model  # noqa: E402

BUCKETS = (  # first match wins; names lower-cased
    ("attention backward", ("bprop", "flash_bwd", "attention_backward", "attention_for_cpu_backward",
                            "attentionbackward", "fmha_bwd")),
    ("attention forward", ("fprop", "flash_fwd", "cudnn_attention", "flash_attention", "fmha",
                           "attentionforward")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::bmm", "aten::addmm")),
    ("copies", ("memcpy", "memset", "aten::copy_")),
    ("reductions", ("reduce", "aten::sum", "norm", "softmax", "logsumexp")),
)


def bucket(name: str) -> str:
    low = name.lower()
    for label, keys in BUCKETS:
        if any(k in low for k in keys):
            return label
    return "elementwise and other"


def summarize(events, device: str, top_n: int = 25) -> dict:
    """Time per bucket, seconds, and the top names by time: on a GPU the kernels and copies themselves
    (an op's own entry would count its kernels twice), on CPU the ops' self time."""
    per: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in events:
        if device == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = (e.time_range.end - e.time_range.start) / 1e6
        else:
            t = e.self_cpu_time_total / 1e6
        if t > 0:
            by_name[e.name] = by_name.get(e.name, 0.0) + t
    for name, t in by_name.items():
        per[bucket(name)] = per.get(bucket(name), 0.0) + t
    top = sorted(((t, k) for k, t in by_name.items()), reverse=True)
    return {"seconds_by_bucket": dict(sorted(per.items(), key=lambda kv: -kv[1])),
            "total_s": sum(per.values()), "top": [{"name": k[:120], "s": t} for t, k in top[:top_n]]}


def union(spans) -> list[tuple[float, float]]:
    """Overlapping (start, end) intervals merged: disjoint and sorted."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(spans) -> float:
    return sum(e - s for s, e in spans)


def busy_seconds(events) -> float:
    """Seconds in which at least one kernel or copy ran on the GPU (the union of their intervals): the
    step's wall time minus this is time the GPU sat idle (waiting on the host, a sync, a launch)."""
    spans = [(e.time_range.start, e.time_range.end) for e in events
             if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return length(union(spans)) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--offload", default="auto")
    ap.add_argument("--keep-attention-outputs", default="false")
    ap.add_argument("--kernel", default="sdpa", help="attention kernel: sdpa / flash_attention_4")
    ap.add_argument("--tiled-mlp", default="auto", help="false / true / auto / a tile count")
    ap.add_argument("--norm-kernel", default="auto", help="the lean RMSNorms' kernel: auto / triton / torch")
    ap.add_argument("--rope", default="auto", choices=("auto", "torch"),
                    help="torch: HF's rotate_half ops in place of the Triton RoPE kernel (how the H200's dense "
                         "rate was profiled, before that kernel existed)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: the preset's); per-layer time scales to the full model")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    offload = _policy(args.offload)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = preset_config(args.model)
    full_layers = config.num_hidden_layers
    if args.layers:
        config.num_hidden_layers = args.layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:args.layers]
    _init_dist()
    with torch.device(device):
        model = build_model(config, dtype, seed=0)
    keep = _policy(args.keep_attention_outputs)
    if args.rope == "torch":  # apply_rope reads the module's rope_kernel_for at each call
        rope.rope_kernel_for = lambda q: "torch"
    net = SYSTEMS["ours"](model, args.kernel, args.length, offload, under_zero3=False, keep_attention_outputs=keep,
                          tiled_mlp=_policy(args.tiled_mlp), norm_kernel=args.norm_kernel)
    if cuda:
        _plan_ours(net, config, args.length, args.kernel, model=args.model, offload=offload, keep=keep)
    L = args.length
    ids = torch.randint(0, config.vocab_size, (1, L), generator=torch.Generator().manual_seed(L)).to(device)
    pos = torch.arange(L, device=device)[None]

    def step():
        net(ids, pos).backward()
        net.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up: cuDNN plans, allocator
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        step()
    wall = time.perf_counter() - t0
    result = {"model": args.model, "length": L, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "offload": args.offload, "keep_attention_outputs": keep,
              "kernel": net.sp_model.attention.kernel, "tiled_mlp": args.tiled_mlp,
              "norm_kernel": args.norm_kernel, "rope": args.rope,
              "layers": config.num_hidden_layers, "full_model_layers": full_layers,
              "wall_s_profiled": wall, "device_busy_s": busy_seconds(prof.events()) if cuda else None,
              **summarize(prof.events(), "cuda" if cuda else "cpu")}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("length", "layers", "kernel", "tiled_mlp", "offload", "wall_s_profiled",
                                             "device_busy_s", "seconds_by_bucket", "top")}), flush=True)


if __name__ == "__main__":
    main()
