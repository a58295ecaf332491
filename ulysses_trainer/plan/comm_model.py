"""The time of one training step's collectives (plan/collectives.py counts them) on a given network.

Torch-free: `rehearse` adds this to the compute it measured on torch's fake process group (whose
collectives move no data).

Time of one op = latency + wire bytes / bus bandwidth, with the usual ring factors on the op's full
size (nccl-tests' busbw convention): all-gather (W-1) * shard, reduce-scatter and all-to-all
(W-1)/W * input, all-reduce 2(W-1)/W * input. Bus bandwidth comes from measured points
(benchmarks/comm_bandwidth.py; log-interpolated in the per-rank message size) or, without them,
from an assumed NVLink figure. A group wider than a node runs at the inter-node bandwidth per GPU.

Overlap (named, calibrated against a real profile): `a2a_hidden` is the fraction of the Ulysses
all-to-alls hidden behind compute (0: they sit on the critical path, as the code issues them
synchronously between the projections and the kernel); `zero3_hidden` is the fraction of the
measured compute that ZeRO-3's prefetched gathers and bucketed reduce-scatters can hide behind
(1: all of it; only what exceeds it is exposed). The small all-reduces are always exposed.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, field

from .collectives import Collective, Job, step_collectives
from .inputs import ModelShape

# Assumed when no measured file is given: NCCL bus bandwidth of large messages over H200 NVLink
# (nccl-tests reach ~350-450 GB/s on 8x H100/H200), one per-op latency, and 400 Gb/s IB per GPU.
# the NCCL points measured on 2 H200s (benchmarks/comm_bandwidth.py): package data, a copy of
# benchmarks/results/comm_bandwidth_h200_x2.json (a test ties the two), so an installed package plans the same
DEFAULT_COMM_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "comm_bandwidth_h200_x2.json")
DEFAULT_BUSBW_GBPS = 350.0
DEFAULT_LATENCY_S = 20e-6
DEFAULT_INTERNODE_GBPS = 50.0
OPS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")


# --------------------------------------------------------------------------------------------
# Bandwidth


def wire_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank moves for an op with `nbytes` of input per rank over n ranks (ring factors)."""
    if n <= 1:
        return 0.0
    return {"all_gather": nbytes * (n - 1), "reduce_scatter": nbytes * (n - 1) / n,
            "all_to_all": nbytes * (n - 1) / n, "all_reduce": 2 * nbytes * (n - 1) / n}[op]


@dataclass
class Bandwidth:
    """Bus bandwidth per op: measured points (per-rank input bytes -> busbw) or one assumed figure."""

    source: str
    points: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)  # op -> (bytes, busbw, s)
    default_busbw_gbps: float = DEFAULT_BUSBW_GBPS
    latency_s: float = DEFAULT_LATENCY_S
    internode_gbps: float = DEFAULT_INTERNODE_GBPS
    device: str | None = None
    measured_world_size: int | None = None

    def busbw_gbps(self, op: str, nbytes: int) -> float:
        pts = self.points.get(op)
        if not pts:
            return self.default_busbw_gbps
        sizes = [p[0] for p in pts]
        if nbytes <= sizes[0]:
            return pts[0][1]
        if nbytes >= sizes[-1]:
            return pts[-1][1]
        j = bisect.bisect_right(sizes, nbytes)
        (s0, b0, _), (s1, b1, _) = pts[j - 1], pts[j]
        f = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return b0 + f * (b1 - b0)

    def latency(self, op: str) -> float:
        """Per-op latency: the time of the smallest measured message when measured (which holds the
        latency already, so it is a floor, not added), else the assumed figure (added)."""
        pts = self.points.get(op)
        return pts[0][2] if pts else self.latency_s

    def seconds(self, c: Collective, gpus_per_node: int) -> float:
        """Time of one call of `c`."""
        n = c.group_size
        if n <= 1:
            return 0.0
        bw = self.busbw_gbps(c.op, c.bytes) * 1e9
        inter = self.internode_gbps * 1e9
        if c.crosses_nodes and c.op == "all_to_all":
            # each rank sends (G-1)/n of its input over NVLink and (n-G)/n over the network, at once
            g = min(gpus_per_node, n)
            t = max(c.bytes * (g - 1) / n / bw, c.bytes * (n - g) / n / inter)
        else:
            t = wire_bytes(c.op, c.bytes, n) / (min(bw, inter) if c.crosses_nodes else bw)
        if self.points.get(c.op):
            return max(self.latency(c.op), t)
        return self.latency(c.op) + t


def load_bandwidth(path: str | None, internode_gbps: float = DEFAULT_INTERNODE_GBPS) -> Bandwidth:
    """Measured points from `path` (benchmarks/comm_bandwidth.py's JSON); None or a missing file:
    the assumed NVLink figure (DEFAULT_BUSBW_GBPS for every op, DEFAULT_LATENCY_S per op)."""
    if path is None or not os.path.isfile(path):
        return Bandwidth(source=f"assumed: {DEFAULT_BUSBW_GBPS:g} GB/s bus bandwidth (H200 NVLink, large messages), "
                                f"{DEFAULT_LATENCY_S * 1e6:g} us per op", internode_gbps=internode_gbps)
    with open(path) as f:
        data = json.load(f)
    points: dict[str, list[tuple[int, float, float]]] = {}
    for p in data.get("points", []):
        if p.get("op") in OPS and p.get("busbw_gbps", 0) > 0:
            points.setdefault(p["op"], []).append((int(p["bytes"]), float(p["busbw_gbps"]), float(p["seconds"])))
    for op in points:
        points[op].sort()
    missing = [op for op in OPS if op not in points]
    # a file of this checkout or package is named from above the package (reads the same in either, anywhere)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(DEFAULT_COMM_FILE)))
    full = os.path.abspath(path)
    shown = os.path.relpath(full, repo) if full.startswith(repo + os.sep) else path
    source = f"measured: {shown} ({data.get('device')}, world {data.get('world_size')}, {data.get('backend')})"
    if missing:
        source += f"; assumed {DEFAULT_BUSBW_GBPS:g} GB/s for {', '.join(missing)}"
    return Bandwidth(source=source, points=points, internode_gbps=internode_gbps, device=data.get("device"),
                     measured_world_size=data.get("world_size"))


# --------------------------------------------------------------------------------------------
# Step estimate


# What a real multi-GPU step took beyond the rehearsal's measured compute and the collectives' wire time, per GB
# of all-to-all input per rank: the streams waiting at each all-to-all, NCCL's kernels sharing the SMs. Calibrated
# on the two real sp=2 runs on 2 H200s (benchmarks/results/sp2/) against their rehearsals with collective_fill
# local (benchmarks/results/rehearsal/rehearse_sp2_*.json): Qwen3-4B 131K 0.52 s over 145 GB (0.0036), Qwen3-8B
# 262K 1.83 s over 290 GB (0.0063); the mean (either alone predicts the other within 2%). (With the bare fake
# group the same difference was 0.0276 s/GB: mostly its kernels running faster on zero-filled buffers.) The
# planner's kernel rates come from single-GPU runs, so its step time leaves this out. Measured at sp=2 only:
# larger sp is extrapolated.
A2A_STALL_S_PER_GB = 0.0049


@dataclass(frozen=True)
class Overlap:
    a2a_hidden: float = 0.0  # fraction of the Ulysses all-to-all time hidden behind compute
    zero3_hidden: float = 1.0  # fraction of the measured compute that ZeRO-3's collectives hide behind
    a2a_stall_s_per_gb: float = A2A_STALL_S_PER_GB  # real-run stalls per GB of all-to-all input (above)


def estimate(shape: ModelShape, job: Job, bw: Bandwidth, compute_s: float | None,
             overlap: Overlap = Overlap()) -> dict:
    """The step's communication, op by op, and what of it adds to `compute_s` (None: compute time
    unknown, e.g. the memory-only stand-in; ZeRO-3 is then taken as hidden and flagged)."""
    rows, a2a, zero3, small = [], 0.0, 0.0, 0.0
    by_op: dict[str, dict[str, int]] = {}
    for c in step_collectives(shape, job):
        tot = by_op.setdefault(c.op, {"calls": 0, "bytes": 0})
        tot["calls"], tot["bytes"] = tot["calls"] + c.count, tot["bytes"] + c.total_bytes
        t = bw.seconds(c, job.gpus_per_node) * c.count
        rows.append({**asdict(c), "busbw_gbps": round(bw.busbw_gbps(c.op, c.bytes), 3), "seconds": t})
        if c.op == "all_to_all":
            a2a += t
        elif c.op == "all_reduce":
            small += t
        else:
            zero3 += t
    a2a_exposed = (1 - overlap.a2a_hidden) * a2a
    stall = overlap.a2a_stall_s_per_gb * by_op.get("all_to_all", {"bytes": 0})["bytes"] / 1e9
    zero3_exposed = None if compute_s is None else max(0.0, zero3 - overlap.zero3_hidden * compute_s)
    exposed = a2a_exposed + small + (zero3_exposed or 0.0) + stall
    return {"comm_s_estimate": exposed, "comm_s_total": a2a + zero3 + small, "a2a_stall_s": stall,
            "all_to_all_s": a2a, "all_to_all_exposed_s": a2a_exposed,
            "zero3_s": zero3, "zero3_exposed_s": zero3_exposed, "all_reduce_s": small,
            "zero3_hidden_assumed": compute_s is None,
            "overlap": asdict(overlap), "bandwidth_source": bw.source,
            "internode_gbps": bw.internode_gbps if job.world_size > job.gpus_per_node else None,
            "by_op": by_op, "ops": rows}
