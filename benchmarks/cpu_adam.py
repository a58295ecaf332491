"""DeepSpeed's CPU Adam alone (the optimizer ZeRO-Offload steps on the host): seconds per parameter on a given
number of the host's cores, the way one rank of an 8-GPU node steps its shard on its share of the node's cores.

    python benchmarks/cpu_adam.py --out cpu_adam_h100.json [--params 1e9] [--cores 16,8,4]

The parameters are fp32 flat tensors of the offload sub-group size (zero3_offload.json's 234,881,024, the last one
shorter) with fp32 gradients, as ZeRO-3 hands them to DeepSpeedCPUAdam.step (AdamW, fp32 states). Every thread of
the process is pinned to the first `cores` CPUs it may use (train/rehearsal.cores_share, what rehearse does); the
step is timed `--iters` times after one untimed step (the states are created lazily). The file records the host's
CPU model and core count beside the rates; a card's table (plan/card_rates.Rates.CPU_ADAM_BY_CORES) is rebuilt
from it by plan/rates.cpu_adam_rates_from_results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_trainer.train.rehearsal import cores_share  # noqa: E402 - every thread on a share of the cores

SUB_GROUP = 234_881_024  # ds_configs/zero3_offload.json's sub_group_size: one step call per group


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo), else platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def groups(total: int, size: int) -> list[int]:
    """The sub-group sizes that hold `total` parameters: full groups of `size`, then the rest."""
    return [size] * (total // size) + ([total % size] if total % size else [])


def time_steps(total: int, cores: int, iters: int) -> dict:
    """Median seconds of one CPU Adam step over `total` fp32 parameters on `cores` cores."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    params = []
    for n in groups(total, SUB_GROUP):
        p = torch.nn.Parameter(torch.empty(n).uniform_(-0.02, 0.02))  # [n] fp32: one flat sub-group partition
        p.grad = torch.empty(n).normal_(0, 1e-3)  # [n] fp32: its reduced gradient, already on the host
        params.append(p)
    opt = DeepSpeedCPUAdam([{"params": params}], lr=1e-5, weight_decay=0.0, adamw_mode=True)
    times = []
    with cores_share(cores):
        opt.step()  # m and v created here: not a step of the run
        for _ in range(iters):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"cores": cores, "params": total, "sub_groups": len(params), "step_s": times, "median_s": med,
            "s_per_param": med / total, "s_per_param_times_cores": med / total * cores}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where the JSON goes")
    ap.add_argument("--params", type=float, default=1e9, help="parameters stepped (one rank's shard)")
    ap.add_argument("--cores", default="16,8,4", help="comma-separated core counts, each timed")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args(argv)
    here = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = [c for c in (int(x) for x in args.cores.split(",")) if c <= here]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    rows = []
    for c in cores:
        row = time_steps(int(args.params), c, args.iters)
        print(f"{c:>3} cores: {row['median_s']:.3f} s for {row['params']:,} parameters, "
              f"{row['s_per_param'] * 1e9:.3f} ns a parameter", flush=True)
        rows.append(row)
    out = {"cpu": cpu_model(), "host_cores": here, "gpu": gpu, "torch": torch.__version__,
           "deepspeed": __import__("deepspeed").__version__, "sub_group_size": SUB_GROUP, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
