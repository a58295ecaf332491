"""Predicted seconds of one optimizer step: attention kernels, the rest of the layers, the optimizer.

Torch-free, like the memory model. Calibrated on one H200 (Qwen3-4B, 131K-256K tokens) from
benchmarks/results/:
- attention: each kernel's measured TFLOP/s by length (attention_kernels_h200*.json at 32K-256K, and at 1M with
  one rank's 4 query heads over 1 KV head on random data, data_dependence_h200.json: FA4 656/609 TFLOP/s forward/
  backward there against 663/617 at 256K), interpolated in log(length) and held constant outside the measured
  lengths (the prediction then says it extrapolates);
  a forward costs 2 L^2 h d FLOPs (causal), a backward 2.5 times that; packed rows cost their documents'
  sum(l_i^2) instead of L^2 (Settings.attention_fraction, at the rate of the row's length L). A checkpointed
  layer runs the kernel's forward twice (once more per layer rebuilt under checkpoint_every), unless it keeps its
  attention output for the recompute (attention/stash.py);
- everything else in the layers and the loss (matmuls, norms, rope, elementwise): dense FLOPs (2 per
  parameter and token per forward, 4 per backward, the lm_head's 6 in the chunked loss) at one effective
  rate, fitted to the three warm full-model runs that keep every attention output
  (long_context_ours_fwdbwd_qwen3-4b_*_kept_*_warm.json: measured minus their kernels' time);
- the RMSNorms (lean norms only): per normed element, forward and backward, by kernel (torch ops or the
  fused Triton kernel; benchmarks/results/norm_kernels_h200.json); the torch kernel's share is taken out
  of the dense term above, whose runs used it;
- RoPE (a family whose attention takes levers/rope's kernel): per rotated element of q and k, forward and
  backward, by kernel (rope/rope_kernels_h200_to_512k.json); rotate_half's share is taken out of the dense term,
  whose runs used it, and the Triton kernel's added;
- activation offload: not charged. The copies run on a side stream under the layers' compute (8-layer
  256K profiles: 43.3 s with offload, 44.1 s without);
- the optimizer step: fused Adam on the GPU is memory-bound and near free; DeepSpeed's CPU Adam with
  ZeRO-Offload (fp32 master, m, v on the host, gradients copied down, weights up) measured 7.1 s for
  Qwen3-4B on the H200 host (a 163 s train step against 155.9 s forward+backward with the same
  settings): 1.77 ns per parameter on one host, scaled by the parameters each host updates.
- a family's MLP block may time parts at their own measured rates (MlpBlock.time_parts, families/):
  Qwen3-MoE's sparse blocks at the block's measured rate by tile count (moe/moe_experts_h200.json, see
  qwen3_moe.experts_calls for what a tiled, checkpointed step runs of it) and its once-per-step part (embedding,
  final norm, chunked loss) at the cost the 1- and 8-layer profiles measure (profile_262144_l{1,8}_*), both taken
  out of the dense rate, which then covers the attention projections and the router;
The model predicts a warm step: the first step also compiles and autotunes kernels (~10 s measured).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..families import MlpRun
from .attention_time import attention_seconds, head_dim_scale, sinks_measured, windowed_seconds
from .card_rates import H200, Rates, rates_for
from .inputs import ModelShape, Settings, layer_forward_passes, mlp_run

# Below this the fixed costs of a step that the model leaves out (kernel launches, Python, DeepSpeed's
# per-parameter bookkeeping) dominate: a tiny model's 0.003 s prediction measures 0.1 s
MODELLED_FROM_S = 1.0
# a node's CPU cores per GPU where the plan is not told (the lent 8-GPU machines: 128 cores)
CORES_PER_GPU_ASSUMED = 16


def format_seconds(x: float) -> str:
    """Seconds as printed by the plan: one decimal from 1 s, two significant digits below (never 0.0)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by part, and what the prediction extrapolates."""

    total_s: float
    parts: dict[str, float] = field(default_factory=dict)
    extrapolated: tuple[str, ...] = ()


def dense_flops(shape: ModelShape, run: MlpRun) -> float:
    """Everything but the attention kernel, one micro-step on one rank: 2 FLOPs per parameter and token per
    forward, 4 per backward (2 with LoRA's frozen weights); the lm_head in the chunked loss: forward + its grads,
    6 per parameter (4 frozen)."""
    t = run.tokens
    per_layer = shape.active_layer_numel  # a sparse MLP: the router and top_k experts per token
    layers = shape.layers * per_layer * t * (2.0 * run.forward_passes + run.backward_flops)
    return layers + (2.0 + run.backward_flops) * shape.vocab * shape.hidden * t


def norm_seconds(shape: ModelShape, run: MlpRun, kernel: str, r: Rates = H200) -> float:
    """The lean RMSNorms of one micro-step on one rank with `kernel`: per layer its norms ([t, hidden]: Qwen3's
    input and post-attention norms, Family.layer_order) and the q/k norms ([t x heads, head_dim], before the all-to-all:
    local tokens, all heads), run forward_passes times forward and once backward; the final norm once."""
    t = run.tokens
    (h_f, h_b), (q_f, q_b) = r.NORM_S_PER_ELEMENT[kernel]["hidden"], r.NORM_S_PER_ELEMENT[kernel]["head"]
    hidden = len(shape.family.layer_norms()) * t * shape.hidden  # Qwen3: input and post-attention
    heads = t * (shape.heads + shape.kv_heads) * shape.head_dim
    passes = run.forward_passes
    per_layer = hidden * (passes * h_f + h_b) + heads * (passes * q_f + q_b)
    return shape.layers * per_layer + t * shape.hidden * (h_f + h_b)


def rope_seconds(shape: ModelShape, run: MlpRun, kernel: str, layers: int, r: Rates = H200) -> float:
    """RoPE on q and k in `layers` attention layers of one micro-step on one rank with `kernel` (torch: HF's
    rotate_half ops; triton: levers/rope's one pass): [t x (heads + kv_heads), head_dim] before the all-to-all
    (local tokens, all heads), forward_passes times forward (the recompute rotates again) and once backward."""
    f, b = r.ROPE_S_PER_ELEMENT[kernel]
    elements = run.tokens * (shape.heads + shape.kv_heads) * shape.head_dim
    return layers * elements * (run.forward_passes * f + b)


def communication(shape: ModelShape, s: Settings, compute_s: float, accumulation: int = 1) -> dict:
    """plan/comm_model.py's estimate for the job these settings describe (measured NCCL points if present)."""
    from .collectives import Job
    from .comm_model import DEFAULT_COMM_FILE, Overlap, estimate, load_bandwidth

    job = Job.of(s, accumulation)
    # the stall term corrects the rehearsal's compute; these rates come from real runs already
    return estimate(shape, job, load_bandwidth(DEFAULT_COMM_FILE), compute_s, Overlap(a2a_stall_s_per_gb=0.0))


def step_time(shape: ModelShape, s: Settings, num_params: int, *, accumulation: int = 1,
              gpu_name: str | None = None, gpu_memory_gb: float | None = None,
              host_cores: int | None = None) -> StepTime:
    """Seconds of one optimizer step (accumulation micro-steps, one optimizer update) at the measured rates of
    the card `gpu_name` names (plan/card_rates.rates_for)."""
    notes: list[str] = []
    r, card_notes = rates_for(gpu_name, gpu_memory_gb)
    run = mlp_run(shape, s)  # tokens per rank and forwards per layer, what the terms below read
    fwd, bwd, extra = attention_seconds(shape, s, r)
    sinks = sinks_measured(shape, s.attn_implementation, r)
    if sinks:
        pts = r.SINK_RATES[s.attn_implementation]
        notes.append(f"attention with sinks timed at {s.attn_implementation}'s measured sink-attention rates "
                     f"({r.SINK_CARD}, {pts[0][0]:,}-{pts[-1][0]:,} tokens" +
                     (f", held constant at {s.padded_length:,}" if extra else "") +
                     "; 8 q / 1 kv heads of 64, the sink's column widening them to 72)")
    elif s.attn_implementation in r.KERNEL_RATES:
        pts = r.KERNEL_RATES[s.attn_implementation]
        if extra:
            notes.append(f"{s.attn_implementation} kernel rate measured at {pts[0][0]:,}-{pts[-1][0]:,} tokens, "
                         f"held constant at {s.padded_length:,}")
        if s.attn_implementation == "flash_attention_2":
            notes.append("flash_attention_2 not measured: torch's flash kernel's rate used")
        if (shape.heads // s.sp_size, shape.kv_heads, shape.head_dim) != r.MEASURED_HEAD_SHAPE and s.sp_size == 1:
            notes.append(f"kernel rates measured with {r.MEASURED_HEAD_SHAPE[0]} heads of {r.MEASURED_HEAD_SHAPE[2]}")
    if shape.head_dim != r.MEASURED_HEAD_SHAPE[2] and s.attn_implementation in r.KERNEL_RATES and not sinks:
        scale = head_dim_scale(s.attn_implementation, shape.head_dim, s.padded_length, r)
        notes.append(f"attention at head_dim {shape.head_dim}: the head-dim-{r.MEASURED_HEAD_SHAPE[2]} rates x "
                     f"{scale:.2f}, the measured fwd+bwd ratio ({r.HD256_SOURCE})" if scale != 1.0 else
                     f"attention kernel rates measured at head_dim {r.MEASURED_HEAD_SHAPE[2]}, used at "
                     f"{shape.head_dim} (not measured there)")
    kept = s.levers.keep_attention_outputs if s.levers.gradient_checkpointing else 0
    # a family's mixer layers (Qwen3.5's Gated DeltaNet) run no attention kernel, and keep no attention output
    mixed = set(shape.mixer_layers)
    attending = [i for i in range(shape.layers) if i not in mixed]
    windowed = set(shape.windowed_layers) if 0 < shape.sliding_window < s.padded_length else set()
    windowed = windowed & set(attending)
    full = [i for i in attending if i not in windowed]
    # each layer's own count: under checkpoint_every a block's top is not rebuilt (plan/inputs.layer_forward_passes)
    forwards = sum(layer_forward_passes(shape, s, i) for i in full) - sum(1 for i in full if i < kept)
    backwards = len(full)
    window_fwd = window_bwd = 0.0
    if windowed and s.attn_implementation in r.KERNEL_RATES:  # the block path, whatever kernel the plan names
        w_f, w_b, measured = windowed_seconds(shape, s, r)
        window_fwd = sum(layer_forward_passes(shape, s, i) for i in windowed) * w_f
        window_bwd = len(windowed) * w_b
        rate = (f"at its measured rate ({r.SINK_CARD}, gpt-oss's rank shape)" if measured else
                f"at the planned kernel's rate (the block path measured at window {r.WINDOW_BLOCK_TFLOPS[0]} only: "
                f"an optimistic guess)")
        notes.append(f"{len(windowed)} of {shape.layers} layers attend in a {shape.sliding_window:,}-token sliding "
                     f"window: timed as the block path runs them (each window of queries against 2 x window keys) "
                     f"{rate}; their memory planned as full causal attention (over-estimated)")
    dense = dense_flops(shape, run)
    parts = {"attention forward": (forwards * fwd + window_fwd) * accumulation,
             "attention backward": (backwards * bwd + window_bwd) * accumulation,
             "matmuls and the rest": dense / (r.DENSE_TFLOPS * 1e12) * accumulation}
    mixer, mixer_taken = shape.family.mixer, 0.0
    if mixer is not None and mixed:
        seconds, mixer_notes, layer_taken = mixer.seconds(shape.dims, mlp_run(shape, s, mixed), r)
        # measured whole (its projections and elementwise work inside), or its kernels alone
        parts[f"{mixer.kind} {'mixers (measured whole)' if layer_taken else 'kernels'}"] = \
            len(mixed) * seconds * accumulation
        notes.extend(mixer_notes)
        mixer_taken = len(mixed) * layer_taken  # projections the mixer's measured seconds include
    # the lean norms by kernel: the torch kernel's share is inside the dense rate, which was fitted with it
    norms = {k: norm_seconds(shape, run, k, r) for k in ("torch", s.norm_kernel)} if s.lean_norm else {}
    # the family's MLP block may time parts at their own measured rates in place of the dense rate
    taken, measured, block_notes = shape.family.mlp.time_parts(shape.dims, run, shape.layers, shape.vocab, r)
    # what the dense part holds can run no faster than its matmuls at the measured matmul rate (the floor's)
    matmuls_alone = (dense - taken - mixer_taken) / (r.LOSS_MATMUL_TFLOPS * 1e12) * accumulation
    if mixer_taken:
        parts["matmuls and the rest"] -= mixer_taken / (r.DENSE_TFLOPS * 1e12) * accumulation
    if measured:
        parts["matmuls and the rest"] -= taken / (r.DENSE_TFLOPS * 1e12) * accumulation
        notes.extend(block_notes)
        parts.update({name: seconds * accumulation for name, seconds in measured.items()})
    if s.lean_norm:  # the dense rate was fitted with the torch kernel's norms inside it
        parts["matmuls and the rest"] -= norms["torch"] * accumulation
        parts[f"RMSNorms ({s.norm_kernel})"] = norms[s.norm_kernel] * accumulation
    if shape.family.fused_rope:  # the dense rate was fitted with HF's rotate_half inside it: swap in the kernel's
        rope_run = mlp_run(shape, s, attending)
        half, fused = (rope_seconds(shape, rope_run, k, len(attending), r) for k in ("torch", "triton"))
        parts["matmuls and the rest"] -= half * accumulation
        parts["RoPE (triton)"] = fused * accumulation
    if parts["matmuls and the rest"] < matmuls_alone:  # a narrow model (hidden 2048): more norm than matmul time
        notes.append("the dense rate's estimate of everything but attention and what was measured apart (experts, "
                     "norms, RoPE) falls under its matmuls at the measured matmul rate: that part is counted as "
                     "those matmuls, its elementwise work not (not calibrated for this shape)")
        parts["matmuls and the rest"] = matmuls_alone
    if s.world_size > 1:  # the collectives' model (the rehearsal's): what of them the compute does not hide
        comm = communication(shape, s, sum(parts.values()), accumulation)
        parts["communication"] = comm["comm_s_estimate"]
        notes.append(f"more than one GPU: communication modelled ({comm['bandwidth_source'].split(':')[0]} "
                     f"bandwidth; measured at sp=2)")
    shard = num_params / s.world_size
    if s.optimizer == "none":
        pass
    elif s.levers.optimizer_offload:
        # each rank updates its shard on its share of the node's cores, at the card host's rate for that many
        cores = host_cores or CORES_PER_GPU_ASSUMED * s.ranks_per_node
        per_rank = max(cores / s.ranks_per_node, 1.0)
        parts["optimizer (CPU Adam, ZeRO-Offload)"] = shard * r.cpu_adam_s_per_param(per_rank)
        if host_cores is None:
            notes.append(f"CPU Adam: {CORES_PER_GPU_ASSUMED} host cores per GPU assumed, each rank on its share "
                         f"(--host_cores: the node's)")
    else:
        parts["optimizer (GPU Adam)"] = shard * r.GPU_ADAM_BYTES_PER_PARAM / r.GPU_BANDWIDTH
    notes.extend(card_notes)
    total = sum(parts.values())
    if total < MODELLED_FROM_S:
        notes.append(f"a step under {MODELLED_FROM_S:g} s: fixed per-step costs (kernel launches, Python) are not "
                     f"modelled, the prediction is a lower bound")
    return StepTime(total_s=total, parts=parts, extrapolated=tuple(notes))


def step_floor(shape: ModelShape, s: Settings, parts: dict[str, float], accumulation: int = 1,
               r: Rates = H200) -> dict[str, float]:
    """The step's floor (docs/benchmarks.md's): the attention kernels as the step runs them (from `parts`,
    step_time's) and a mixer's kernels alone (Qwen3.5's DeltaNet rule and conv), plus every matmul at the measured
    matmul rate (LOSS_MATMUL_TFLOPS): the layers' weights (sparse: the active ones) forward per pass and backward (no
    weight grads under LoRA), the lm_head's 6 FLOPs a weight in the chunked loss (4 frozen). What the predicted
    step adds over it is the elementwise work, the norms, the loss's softmax, the optimizer and the exposed
    communication."""
    run = mlp_run(shape, s)
    head = shape.vocab * shape.hidden
    flops = ((2.0 * run.forward_passes + run.backward_flops) * (shape.matmul_params - head)
             + (2.0 + run.backward_flops) * head) * run.tokens
    kernels = {k: v for k, v in parts.items() if k.startswith("attention ")}
    mixer = shape.family.mixer
    if mixer is not None and shape.mixer_layers:  # its kernels alone, whether or not the step timed it whole
        mixed = set(shape.mixer_layers)
        seconds, _ = mixer.kernel_seconds(shape.dims, mlp_run(shape, s, mixed), r)
        kernels[f"{mixer.kind} kernels"] = len(mixed) * seconds * accumulation
    out = {**{f"{k} s": v for k, v in kernels.items()},
           "matmuls s": flops / (r.LOSS_MATMUL_TFLOPS * 1e12) * accumulation, "matmul tflops": r.LOSS_MATMUL_TFLOPS}
    out["floor s"] = sum(kernels.values()) + out["matmuls s"]
    return out
