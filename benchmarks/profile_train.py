"""Where one step of the real trainer spends its time across ranks: all-to-all, ZeRO-3 gathers and
reduce-scatters, attention, the rest, and how much of the communication hides behind compute.

    deepspeed --num_gpus 2 benchmarks/profile_train.py --out profile.json --config RECIPE [--name value ...]

The recipe and overrides are the trainer's own (launch/train.py). Step 1 runs untimed (kernel plans,
allocator), step 2 runs under torch.profiler on every rank; rank 0 writes its buckets. "exposed" is the
part of a communication bucket's kernel time during which no compute kernel ran on the GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.profile_step import bucket as compute_bucket  # noqa: E402
from benchmarks.profile_step import length, union  # noqa: E402

COMM = (  # NCCL kernel names (lower-cased), first match wins
    ("all-to-all", ("alltoall", "sendrecv")),
    ("all-gather", ("allgather",)),
    ("reduce-scatter", ("reducescatter",)),
    ("all-reduce", ("allreduce",)),
    ("other nccl", ("nccl",)),
)


def comm_bucket(name: str) -> str | None:
    low = name.lower()
    for label, keys in COMM:
        if any(k in low for k in keys):
            return label
    return None


def _minus(spans, cover) -> float:
    """Length of `spans` (disjoint, sorted) not covered by `cover` (disjoint, sorted)."""
    total, j = 0.0, 0
    for s, e in spans:
        cur = s
        while j < len(cover) and cover[j][1] <= cur:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < e:
            if cover[k][0] > cur:
                total += cover[k][0] - cur
            cur = max(cur, cover[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


def summarize(events) -> dict:
    comm: dict[str, list] = {}
    compute: list = []
    by_bucket: dict[str, float] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.end <= e.time_range.start:
            continue
        span = (e.time_range.start / 1e6, e.time_range.end / 1e6)
        label = comm_bucket(e.name)
        if label is None:
            compute.append(span)
            label = compute_bucket(e.name)
        else:
            comm.setdefault(label, []).append(span)
        by_bucket[label] = by_bucket.get(label, 0.0) + span[1] - span[0]
    compute_u = union(compute)
    comm_out = {}
    for label, spans in comm.items():
        u = union(spans)
        comm_out[label] = {"kernel_s": length(u), "exposed_s": _minus(u, compute_u)}
    all_comm = union([s for spans in comm.values() for s in spans])
    return {"seconds_by_bucket": dict(sorted(by_bucket.items(), key=lambda kv: -kv[1])),
            "compute_busy_s": length(compute_u), "comm": comm_out,
            "comm_busy_s": length(all_comm), "comm_exposed_s": _minus(all_comm, compute_u),
            "gpu_busy_s": length(union(compute + [s for spans in comm.values() for s in spans]))}


def main() -> None:
    argv = sys.argv[1:]
    if "--out" not in argv:
        raise SystemExit("usage: profile_train.py --out FILE [--config RECIPE] [--name value ...]")
    i = argv.index("--out")
    out, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    argv = [a for a in argv if not a.startswith("--local_rank")]
    from ulysses_trainer.cli.argv import load_config
    from ulysses_trainer.cli.train import _init_distributed
    from ulysses_trainer.train.prepare import prepare, world_size_from_env
    from ulysses_trainer.train.trainer import Trainer

    cfg = load_config(argv + ["--save_strategy", "no"])
    plan = prepare(cfg, world_size_from_env())
    _init_distributed()
    trainer = Trainer(plan)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for step in range(2):
        shards = trainer.micro_batches(step)
        sync()
        t0 = time.perf_counter()
        if step == 0:
            loss, norm, _ = trainer.train_step(shards)
        else:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=acts) as prof:
                loss, norm, _ = trainer.train_step(shards)
                sync()
        sync()
        times.append(time.perf_counter() - t0)
    if trainer.state.is_main:
        result = {"model": cfg.model_name_or_path, "max_length": cfg.max_length, "world_size": plan.world_size,
                  "sp_size": plan.sp_size, "kernel": plan.attn_implementation,
                  "device": torch.cuda.get_device_name() if cuda else "cpu",
                  "torch": torch.__version__, "step_s_unprofiled": times[0], "step_s_profiled": times[1],
                  "loss": loss, "grad_norm": norm,
                  "peak_gpu_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                  **summarize(prof.events())}
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps({k: v for k, v in result.items() if k != "seconds_by_bucket"}), flush=True)
        print(json.dumps(result["seconds_by_bucket"]), flush=True)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from ulysses_trainer.cli.console import use_console

    use_console()  # the package's messages as the commands show them
    main()
