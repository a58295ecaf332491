"""NCCL bus bandwidth of the four collectives the trainer uses, for `ulysses-trainer rehearse --comm`.

    deepspeed --num_gpus 2 benchmarks/comm_bandwidth.py --out benchmarks/results/comm_bandwidth_h200_x2.json
    torchrun --nproc_per_node 2 benchmarks/comm_bandwidth.py --out ...
    torchrun --nproc_per_node 2 benchmarks/comm_bandwidth.py --backend gloo --sizes 4096,65536 --out ...  (CPU smoke)

For each op and per-rank input size (default 1 MiB .. 1 GiB, powers of 4), bf16 tensors on the GPU: a few
warm-up calls, then the median of timed calls, each closed by a device synchronize and a barrier-free
wall clock on rank 0 (every rank runs the same calls, so rank 0's time is the collective's). Bus bandwidth
follows nccl-tests (and plan/comm_model.py, which reads it back): wire bytes / seconds, with the wire
bytes of a per-rank input of S bytes over n ranks being
    all_to_all: S (n-1)/n     all_gather: S (n-1)     reduce_scatter: S (n-1)/n     all_reduce: 2 S (n-1)/n
Output: {"device", "world_size", "backend", "dtype", "points": [{"op", "bytes", "seconds", "busbw_gbps"}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_trainer.plan.comm_model import OPS, wire_bytes  # noqa: E402

DEFAULT_SIZES = [2**20 * 4**i for i in range(6)]  # 1 MiB, 4 MiB, ..., 1 GiB per rank


def _call(op: str, x: torch.Tensor, out: torch.Tensor) -> None:
    if op == "all_to_all":
        dist.all_to_all_single(out, x)  # [n*c] -> [n*c]: chunk r goes to rank r
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, x)  # [c] per rank -> [n*c]
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, x)  # [n*c] per rank -> [c]
    else:
        dist.all_reduce(x)


def _buffers(op: str, nbytes: int, n: int, dtype: torch.dtype, device: torch.device):
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    numel -= numel % n  # all-to-all and reduce-scatter split the input into n equal chunks
    x = torch.ones(numel, dtype=dtype, device=device)
    out = {"all_to_all": lambda: torch.empty_like(x),
           "all_gather": lambda: torch.empty(numel * n, dtype=dtype, device=device),
           "reduce_scatter": lambda: torch.empty(numel // n, dtype=dtype, device=device),
           "all_reduce": lambda: x}[op]()
    return x, out


def measure(op: str, nbytes: int, warmup: int, iters: int, dtype: torch.dtype, device: torch.device) -> dict:
    n = dist.get_world_size()
    x, out = _buffers(op, nbytes, n, dtype, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        _call(op, x, out)
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _call(op, x, out)
        sync()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median: the collective ends there
    real_bytes = x.numel() * x.element_size()
    seconds = float(t.item())
    return {"op": op, "bytes": real_bytes, "seconds": seconds,
            "busbw_gbps": wire_bytes(op, real_bytes, n) / seconds / 1e9}


def _init(backend: str) -> torch.device:
    if "RANK" not in os.environ:
        raise SystemExit("error: run under a launcher: deepspeed --num_gpus 2 benchmarks/comm_bandwidth.py ... "
                         "or torchrun --nproc_per_node 2 benchmarks/comm_bandwidth.py ...")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group(backend)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl" if torch.cuda.is_available() else "gloo")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="per-rank input bytes, comma-separated")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed's
    args = ap.parse_args(argv)
    # torch 2.13 renamed some collectives; the old names (which DeepSpeed also calls) still work everywhere
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    ops = args.ops.split(",")
    bad = [o for o in ops if o not in OPS]
    if bad:
        print(f"error: unknown ops {bad}; use some of {', '.join(OPS)}", file=sys.stderr)
        return 2
    device = _init(args.backend)
    dtype = getattr(torch, args.dtype)
    points = []
    for op in ops:
        for nbytes in (int(s) for s in args.sizes.split(",")):
            p = measure(op, nbytes, args.warmup, args.iters, dtype, device)
            points.append(p)
            if dist.get_rank() == 0:
                print(json.dumps(p), flush=True)
    if dist.get_rank() == 0:
        result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "world_size": dist.get_world_size(), "backend": args.backend, "dtype": args.dtype,
                  "torch": torch.__version__,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.backend == "nccl" else None,
                  "points": points}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
