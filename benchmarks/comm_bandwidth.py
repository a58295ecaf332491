"""Bus bandwidth of the collectives a training step runs, measured on this machine's GPUs.

    deepspeed --num_gpus 2 benchmarks/comm_bandwidth.py --out comm_bandwidth.json

all_to_all (Ulysses), all_gather and reduce_scatter (ZeRO-3), all_reduce, bf16, at per-rank input sizes
from 1 MiB to 1 GiB. busbw follows nccl-tests: algbw x (n-1)/n for all-to-all, all-gather and
reduce-scatter, x 2(n-1)/n for all-reduce, where algbw = per-rank input bytes / time (output bytes
for all-gather). The rehearsal's communication model reads this file. On CPU (gloo) it runs at small
sizes as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _time(fn, sync, iters: int) -> float:
    fn()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-mib", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--local_rank", type=int, default=None)
    args = ap.parse_args()
    from ulysses_trainer.parallel.init import init_distributed

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    init_distributed("nccl" if cuda else "gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    points = []
    mib = 1
    while mib <= args.max_mib:
        numel = mib * 2**20 // dtype.itemsize // n * n
        x = torch.randn(numel, device=dev).to(dtype)
        nbytes = numel * dtype.itemsize
        out_a2a = torch.empty_like(x)
        gathered = torch.empty(numel * n, device=dev, dtype=dtype)
        scattered = torch.empty(numel // n, device=dev, dtype=dtype)
        ops = {
            "all_to_all": (lambda o=out_a2a, i=x: dist.all_to_all_single(o, i), nbytes, (n - 1) / n),
            "all_gather": (lambda o=gathered, i=x: dist.all_gather_into_tensor(o, i), nbytes * n, (n - 1) / n),
            "reduce_scatter": (lambda o=scattered, i=x: dist.reduce_scatter_tensor(o, i), nbytes, (n - 1) / n),
            "all_reduce": (lambda i=x: dist.all_reduce(i), nbytes, 2 * (n - 1) / n),
        }
        for op, (fn, alg_bytes, factor) in ops.items():
            t = _time(fn, sync, args.iters)
            points.append({"op": op, "bytes": nbytes, "seconds": t, "algbw_gbps": alg_bytes / t / 1e9,
                           "busbw_gbps": alg_bytes / t / 1e9 * factor})
        mib *= 4
    if rank == 0:
        result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "world_size": n,
                  "backend": dist.get_backend(), "torch": torch.__version__, "dtype": str(dtype), "points": points}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        for p in points:
            print(f"{p['op']:>15} {p['bytes'] / 2**20:8.0f} MiB {p['seconds'] * 1e3:9.3f} ms "
                  f"busbw {p['busbw_gbps']:7.1f} GB/s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
