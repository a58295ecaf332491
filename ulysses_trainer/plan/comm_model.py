"""The collectives of one training step, counted from the code, and their time on a given network.

Torch-free: `rehearse` adds this to the compute it measured on torch's fake process group (whose
collectives move no data), and tests check the counts by hand.

What one optimizer step of the trainer communicates (W = world size, sp = sequence-parallel degree;
t = tokens per rank per micro-step; e = bytes per element of the training dtype):

Ulysses all-to-alls, on the sp group (parallel/ulysses.py), per decoder layer and micro-step:
  q, k, v go sequence -> heads before the kernel (3 ops) and the output heads -> sequence after it
  (1 op): 4 in the forward, 4 in the checkpoint's recompute (a kept attention output skips only the
  kernel there: q, k, v are still needed for its backward and the output still feeds o_proj), 4 in
  backward (the autograd reverse of each), and 4 more in each layer rebuilt with checkpoint_every > 1.
  A Qwen3.5 Gated DeltaNet layer (parallel/ulysses_deltanet.py) issues 2 per pass: its projected q, k, v,
  b, a channels packed into one before the conv (t*(2*K*dk + V*dv + 2V)*e) and the rule's output back after
  it (t*V*dv*e); 2 in the recompute, 2 in backward, 2 more when rebuilt.
  Bytes per rank: q and the output t*nq*d*e; k and v t*nkv'*d*e, nkv' = nkv*max(1, sp/nkv) (KV heads
  are copied before the all-to-all when sp > nkv).
ZeRO-3 (DeepSpeed, no mpu: every rank is data-parallel, so its collectives span all W ranks):
  - all-gather of each non-persistent parameter (numel > stage3_param_persistence_threshold) where a
    module uses it, unless it is still held from its previous use: plan/zero3_trace.py walks the
    module order of one micro-step with DeepSpeed's release rule (stage3_max_reuse_distance). With the
    default config and an 8B model: every layer in forward, again for the recompute (kept through its
    backward), the embedding twice, an untied lm_head once, a tied one once more. Persistent tensors
    (the norms) are gathered once each after the optimizer step.
  - reduce-scatter of every gradient in the training dtype (DeepSpeed's communication_data_type
    default), in reduce_bucket_size buckets filled in backward order, every micro-step.
  `rehearse --count_collectives` counts what DeepSpeed really issues, to set beside these counts.
All-reduces of a few bytes per step: token count and loss (parallel/loss.py), the stop flag
(trainer), DeepSpeed's gradient norm.

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
from collections import Counter
from dataclasses import asdict, dataclass, field

from .inputs import ModelShape, Settings
from .zero3_trace import gathers_per_micro_step

# Assumed when no measured file is given: NCCL bus bandwidth of large messages over H200 NVLink
# (nccl-tests reach ~350-450 GB/s on 8x H100/H200), one per-op latency, and 400 Gb/s IB per GPU.
# the NCCL points measured on 2 H200s (benchmarks/comm_bandwidth.py): package data, a copy of
# benchmarks/results/comm_bandwidth_h200_x2.json (a test ties the two), so an installed package plans the same
DEFAULT_COMM_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "comm_bandwidth_h200_x2.json")
DEFAULT_BUSBW_GBPS = 350.0
DEFAULT_LATENCY_S = 20e-6
DEFAULT_INTERNODE_GBPS = 50.0
OPS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Job:
    """One training job's layout, as the trainer runs it."""

    world_size: int
    sp_size: int
    local_tokens: int  # tokens per rank per micro-step (micro batch x padded length / sp)
    grad_accum: int = 1
    bytes_per_el: int = 2
    gradient_checkpointing: bool = True
    checkpoint_every: int = 1
    gpus_per_node: int = 8
    param_persistence_threshold: int | None = None  # elements; None: 10 * hidden (the "auto" fill)
    reduce_bucket_size: int | None = None  # elements; None: hidden**2
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance, elements
    tiled_mlp: int = 1  # MLP tiles; 1 = untiled

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @classmethod
    def of(cls, s: Settings, accumulation: int = 1, gpus_per_node: int | None = None) -> Job:
        """The job a plan's settings describe (layout, tokens per rank, precision, levers and the ZeRO-3 sizes the
        run's JSON gives, plan/types.read_zero): the plan's step time and the rehearsal build their jobs here.
        gpus_per_node None: the settings' ranks per host."""
        z = s.zero3
        return cls(world_size=s.world_size, sp_size=s.sp_size, local_tokens=s.local_tokens, grad_accum=accumulation,
                   bytes_per_el=s.act_bytes, gradient_checkpointing=s.gradient_checkpointing,
                   checkpoint_every=s.checkpoint_every, gpus_per_node=gpus_per_node or s.ranks_per_node,
                   param_persistence_threshold=z.param_persistence_threshold, reduce_bucket_size=z.reduce_bucket_size,
                   max_reuse_distance=z.max_reuse_distance, tiled_mlp=s.tiled_mlp)


@dataclass(frozen=True)
class Collective:
    """`count` calls per optimizer step of `op`, each with `bytes` of input per rank, over `group_size` ranks."""

    name: str
    op: str
    group: str  # "sp" | "world"
    group_size: int
    bytes: int
    count: int
    crosses_nodes: bool = False

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count


def rebuilt_layers(layers: int, checkpoint_every: int) -> int:
    """Layers that keep no input and run one more forward in backward (levers/recompute.py)."""
    return layers - -(-layers // checkpoint_every)


def rebuilt_layer_ids(layers: int, checkpoint_every: int) -> list[int]:
    """Which layers those are: all but each block's top (a block's top rebuilds the layers below it from the
    block's kept input; plan/zero3_trace.module_trace)."""
    k = checkpoint_every
    return [i for i in range(layers) if i % k != k - 1 and i != layers - 1]


def ulysses_all_to_alls(shape: ModelShape, job: Job) -> list[Collective]:
    """The sp group's all-to-alls of one step (none at sp = 1): the attention layers' q, k, v and output, and a
    family's mixer layers' own (Qwen3.5's Gated DeltaNet: its projected channels before the conv, its output
    after the rule; TokenMixer.all_to_alls)."""
    sp_size = job.sp_size
    if sp_size == 1:
        return []
    kv_eff = shape.kv_heads * max(1, sp_size // shape.kv_heads)  # KV heads after replication
    q_bytes = job.local_tokens * shape.heads * shape.head_dim * job.bytes_per_el  # q and the output
    kv_bytes = job.local_tokens * kv_eff * shape.head_dim * job.bytes_per_el
    forwards = 1 + (1 if job.gradient_checkpointing else 0)  # forward, recompute
    mixed = set(shape.mixer_layers)
    rebuilt_ids = rebuilt_layer_ids(shape.layers, job.checkpoint_every)
    cross = sp_size > job.gpus_per_node
    out = []
    kinds = [(shape.layers - len(mixed), [i for i in rebuilt_ids if i not in mixed], None)]
    if mixed:
        kinds.append((len(mixed), [i for i in rebuilt_ids if i in mixed], shape.family.mixer))
    for n_layers, rebuilt_here, mixer in kinds:
        per_pass = n_layers * job.grad_accum
        rebuilt = len(rebuilt_here) * job.grad_accum
        for phase, layers in (("forward", per_pass * forwards + rebuilt), ("backward", per_pass)):
            if not layers:
                continue
            if mixer is None:
                out.append(Collective(f"ulysses {phase} q + attention output", "all_to_all", "sp", sp_size, q_bytes,
                                      2 * layers, cross))
                out.append(Collective(f"ulysses {phase} k + v", "all_to_all", "sp", sp_size, kv_bytes, 2 * layers,
                                      cross))
                continue
            for what, width in mixer.all_to_alls(shape.dims):
                out.append(Collective(f"ulysses {phase} {what}", "all_to_all", "sp", sp_size,
                                      job.local_tokens * width * job.bytes_per_el, layers, cross))
    return out


def zero3_collectives(shape: ModelShape, job: Job) -> list[Collective]:
    """ZeRO-3's all-gathers and reduce-scatters of one step, over all W ranks."""
    w, e = job.world_size, job.bytes_per_el
    if w == 1:
        return []
    thr = shape.auto_persistence_threshold if job.param_persistence_threshold is None \
        else job.param_persistence_threshold
    cross = w > job.gpus_per_node
    shard = lambda n: -(-n // w) * e  # noqa: E731 - per-rank input bytes of gathering an n-element tensor
    gathers = gathers_per_micro_step(shape, job.gradient_checkpointing, job.checkpoint_every, thr,
                                     job.max_reuse_distance, job.tiled_mlp)
    size = shape.numels
    out = []
    by_size: dict[int, list[str]] = {}  # one row per tensor size: q/o, k/v, gate/up/down, embedding
    for name in gathers:
        by_size.setdefault(size[name], []).append(name)
    for n, names in by_size.items():
        label = "/".join(names) if names[0] not in ("embed", "lm_head") else " + ".join(names)
        out.append(Collective(f"zero3 gather: {label}", "all_gather", "world", w, shard(n),
                              sum(gathers[m] for m in names) * job.grad_accum, cross))
    persistent = Counter(n for n in shape.param_numels if n <= thr)  # one call per tensor after the step
    for n, k in sorted(persistent.items()):
        out.append(Collective(f"zero3 gather: persistent {n}-element tensors after the step", "all_gather",
                              "world", w, shard(n), k, cross))
    for n, k in sorted(reduce_buckets(shape, job).items()):
        out.append(Collective(f"zero3 reduce-scatter: {n}-element gradient buckets", "reduce_scatter", "world",
                              w, n * e, k * job.grad_accum, cross))
    return out


def reduce_buckets(shape: ModelShape, job: Job) -> Counter:
    """Bucket size (elements) -> reduce-scatters per micro-step. Gradients arrive in backward order and
    fill a bucket of reduce_bucket_size elements; one that would overflow a non-empty bucket sends it
    first (stage3.__add_grad_to_ipg_bucket), so a gradient larger than the bucket goes alone."""
    order = ["final_norm"] + [n for i in range(shape.layers - 1, -1, -1) for n in reversed(shape.layer_orders[i])] \
        + ["embed"]
    if not shape.tied_embeddings:
        order.insert(0, "lm_head")
    size, limit = shape.numels, job.reduce_bucket_size or shape.auto_reduce_bucket
    buckets: Counter = Counter()
    held = 0
    for name in order:
        if held and held + size[name] > limit:
            buckets[held] += 1
            held = 0
        held += size[name]
    buckets[held] += 1
    return buckets


def small_all_reduces(job: Job) -> list[Collective]:
    """Token count and loss (parallel/loss.py) and the stop flag (trainer loop); DeepSpeed's gradient norm.
    (DeepSpeed's overflow flag is all-reduced with fp16 only.)"""
    if job.world_size == 1:
        return []
    cross, w = job.world_size > job.gpus_per_node, job.world_size
    return [Collective("all-reduce: token count, loss", "all_reduce", "world", w, 8, 2, cross),
            Collective("all-reduce: stop flag", "all_reduce", "world", w, 4, 1, cross),
            Collective("all-reduce: gradient norm (DeepSpeed)", "all_reduce", "world", w, 4, 1, cross)]


def block_all_reduces(shape: ModelShape, job: Job) -> list[Collective]:
    """The family's MLP block's own all-reduces (MlpBlock.all_reduces; Qwen3-MoE: the load-balancing statistics
    over the SP group and the logged aux loss)."""
    return [Collective(a.name, "all_reduce", a.group, a.group_size, a.bytes, a.count, a.crosses_nodes)
            for a in shape.family.mlp.all_reduces(shape.dims, job.world_size, job.sp_size, job.gpus_per_node,
                                                  job.grad_accum)]


def step_collectives(shape: ModelShape, job: Job) -> list[Collective]:
    return (ulysses_all_to_alls(shape, job) + zero3_collectives(shape, job) + small_all_reduces(job)
            + block_all_reduces(shape, job))


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
