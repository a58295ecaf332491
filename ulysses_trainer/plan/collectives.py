"""The collectives of one training step, counted from the code; plan/comm_model.py times them on a network.

Torch-free: tests check the counts by hand.

What one optimizer step of the trainer communicates (W = world size, sp = sequence-parallel degree;
t = tokens per rank per micro-step; e = bytes per element of the training dtype):

Ulysses all-to-alls, on the sp group (parallel/ulysses.py), per decoder layer and micro-step:
  q, k, v go sequence -> heads before the kernel (3 ops) and the output heads -> sequence after it
  (1 op): 4 in the forward, 4 in the checkpoint's recompute (a kept attention output skips only the
  kernel there: q, k, v are still needed for its backward and the output still feeds o_proj), 4 in
  backward (the autograd reverse of each), and 4 more in each layer rebuilt with checkpoint_every > 1.
  A Qwen3.5 Gated DeltaNet layer (families/qwen3_5/ulysses_deltanet.py) issues 2 per pass: its projected q, k, v,
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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..vocabulary.lever_settings import EVERY_LAYER, Levers
from .inputs import ModelShape, Settings
from .zero3_trace import gathers_per_micro_step


@dataclass(frozen=True)
class Job:
    """One training job's layout, as the trainer runs it, and its levers: the plan's lever record itself
    (checkpointing, thinning and tiles are what the counts read of it)."""

    world_size: int
    sp_size: int
    local_tokens: int  # tokens per rank per micro-step (micro batch x padded length / sp)
    grad_accum: int = 1
    bytes_per_el: int = 2
    gpus_per_node: int = 8
    param_persistence_threshold: int | None = None  # elements; None: 10 * hidden (the "auto" fill)
    reduce_bucket_size: int | None = None  # elements; None: hidden**2
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance, elements
    levers: Levers = EVERY_LAYER  # concrete (a plan's, Settings.levers): no auto left

    def __post_init__(self) -> None:
        lv = self.levers
        if not lv.decided:
            raise ValueError(f"a job's levers are a plan's, every one decided, got {lv}")

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
                   bytes_per_el=s.act_bytes, gpus_per_node=gpus_per_node or s.ranks_per_node,
                   param_persistence_threshold=z.param_persistence_threshold, reduce_bucket_size=z.reduce_bucket_size,
                   max_reuse_distance=z.max_reuse_distance, levers=s.levers)


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
    forwards = 1 + (1 if job.levers.gradient_checkpointing else 0)  # forward, recompute
    mixed = set(shape.mixer_layers)
    rebuilt_ids = rebuilt_layer_ids(shape.layers, job.levers.checkpoint_every)
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
    lv = job.levers
    gathers = gathers_per_micro_step(shape, lv.gradient_checkpointing, lv.checkpoint_every, thr,
                                     job.max_reuse_distance, lv.tiled_mlp)
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
