"""Per-GPU and host memory of one training step, term by term, for a Qwen3-style model.

Every formula lives here or, for one decoder layer, in plan/layer_terms.py (the loss's in plan/loss_terms.py,
the host's in plan/host_terms.py): one named function per term, each saying what it counts. Sizes are bytes;
"GB" in user-facing names means GiB (2**30 bytes), as torch.cuda.max_memory_allocated is read.

Notation used in the docstrings: t = tokens per rank per micro-step (batch x padded length / sp),
H hidden, I intermediate, V vocabulary, nq / nkv query / KV heads, d head_dim, Q = nq*d, K = nkv*d,
K' = K x kv_repeat (KV heads are replicated when sp > nkv), e = bytes per activation element (2 bf16,
4 fp32), N parameters, W = world size (ZeRO-3 shards the model states over every rank).

The step's GPU peak is: the static model states, plus what stays alive across the step (checkpointed
layer inputs kept on the GPU, rope cos/sin), plus the largest of the transient phases:
  - layer backward: one decoder layer recomputed and backpropagated (its working set), with the
    checkpoints still held on the GPU and the layer's gathered parameters;
  - loss: the end of forward, the final norm's saved tensors and the loss's own buffers, with the
    lm_head weight gathered;
  - end of backward (first step without ZeRO only): every .grad created;
  - optimizer step: the fp32 gradient copy of one ZeRO sub-group (and, on the first step, Adam's m, v).
That sum is what torch.cuda.max_memory_allocated reports; allocator slack and the CUDA context come
on top when deciding what fits on a device.

Calibration (plan/calibration.json, `ulysses-trainer plan calibrate`): one-GPU Qwen3-4B runs on an
H200, 32K-1M tokens, within 5% (over, not under) for ulysses_trainer and 6% for the baselines. Terms that only sp > 1
exercises (the all-to-all buffers, the o_proj input copy) are checked against real sp=2 runs on two H200s and the
H200 allocator history of sp=8 rehearsals (torch's fake process group: each all-to-all buffer is freed as soon as
the code drops it); KV replication follows the code, unmeasured.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from ..vocabulary.names import GIB
from .host_terms import host_optimizer_bytes, host_pool_bytes
from .inputs import ModelShape, Settings, check_settings
from .layer_terms import (
    FP32,
    binding_layer,
    kept_attention_bytes_per_layer,
    layer_forward_saved,
    layer_gathered_params_bytes,
    layer_working_set,
    tied_embedding_grad_bytes,
    unattributed_bytes,
)
from .loss_terms import final_norm_bytes, lm_head_gathered_bytes, loss_bytes
from .memory_record import MemoryEstimate, Term
from .partitions import (
    _persistence_threshold,
    _shard_numel,
    _sub_group_numels,
    _trainable_shard_numel,
    trainable_numels,
)

# the memory model's worst measured under-prediction of a GPU peak: -3.1% (ALST at 393,216 tokens; the trainer's
# own points within -0.7%), from `ulysses-trainer plan calibrate` (docs/plan.md#calibration,
# tests/test_plan.py checks it stays the worst). A plan needing more than the GPU by more than this cannot fit.
UNDER_PREDICTION = 0.031

Phase = Literal["static", "resident", "layer_backward", "loss", "optimizer_step", "overhead"]
TRANSIENT_PHASES: tuple[str, ...] = ("layer_backward", "loss", "backward_end", "optimizer_step")


# --------------------------------------------------------------------------------------------
# Static model states (per GPU)


def weights_bytes(shape: ModelShape, s: Settings) -> int:
    """Model weights in the training dtype: this rank's ZeRO-3 shard (N/W elements), or all N unsharded."""
    return _shard_numel(shape, s) * s.act_bytes


def gradients_bytes(shape: ModelShape, s: Settings) -> int:
    """Reduced gradients in the training dtype: ZeRO-3's flat gradient partition (N/W), or full .grad
    tensors unsharded. Under optimizer offload the partition is on the host (see host terms)."""
    if s.levers.optimizer_offload or (s.zero_stage == 0 and s.first_step):
        return 0
    return _trainable_shard_numel(shape, s) * s.act_bytes


def gradients_created_in_backward_bytes(shape: ModelShape, s: Settings) -> int:
    """Unsharded, first step: every .grad appears during backward; at its end all N of them exist,
    plus the embedding's dense [V, H] grad being added to the tied / embedding weight's."""
    if s.zero_stage != 0 or not s.first_step:
        return 0
    return (sum(trainable_numels(shape, s)) + (shape.vocab * shape.hidden if s.trainable_numels is None else 0)) \
        * s.act_bytes


def master_weights_bytes(shape: ModelShape, s: Settings) -> int:
    """fp32 master copy of this rank's partition (4 N/W). None when the weights are fp32 already
    (DeepSpeed reuses them), when there is no optimizer, or when it is offloaded."""
    if s.optimizer == "none" or s.levers.optimizer_offload or not s.bf16:
        return 0
    return _trainable_shard_numel(shape, s) * FP32


def adam_states_bytes(shape: ModelShape, s: Settings) -> int:
    """Adam m and v, fp32, for this rank's partition (8 N/W); on the host when offloaded. Before the
    first optimizer step they do not exist yet (counted in the optimizer-step phase instead)."""
    if s.optimizer == "none" or s.levers.optimizer_offload or s.first_step:
        return 0
    return _trainable_shard_numel(shape, s) * 2 * FP32


def persistent_params_bytes(shape: ModelShape, s: Settings) -> int:
    """ZeRO-3 keeps parameters below param_persistence_threshold (norm weights) gathered on every rank."""
    if s.zero_stage == 0:
        return 0
    thr = _persistence_threshold(shape, s)
    return sum(n for n in shape.param_numels if n <= thr) * s.act_bytes


def reduce_bucket_bytes(shape: ModelShape, s: Settings) -> int:
    """ZeRO-3's contiguous gradient bucket (reduce_bucket_size elements, training dtype)."""
    if s.zero_stage == 0 or s.optimizer == "none":
        return 0
    n = s.zero3.reduce_bucket_size
    return (shape.auto_reduce_bucket if n is None else n) * s.act_bytes


# --------------------------------------------------------------------------------------------
# What stays alive across the step


def checkpoint_bytes_per_layer(shape: ModelShape, s: Settings) -> int:
    """One checkpointed layer input: [b, L/sp, H] in the training dtype (t x H x e)."""
    return s.local_tokens * shape.hidden * s.act_bytes


def gpu_checkpoints_at(shape: ModelShape, s: Settings, j: int) -> int:
    """Layer inputs on the GPU during layer j's backward (layers run N-1 .. 0).

    The saved layers are the block starts 0, c, 2c, ... (c = checkpoint_every; every layer when c = 1),
    the first `activation_offload` of them offloaded. Held: the resident saved inputs at or below j; the
    fetched copy of j's block start if it is offloaded; the rebuilt inputs of j's block from b+1 up to j
    (rebuilt all at once by the block's top layer, freed one by one); and, during a block start's
    backward, the prefetched input of the block start below it if that one is offloaded."""
    if not s.levers.gradient_checkpointing:
        return 0
    c, a, pre = s.levers.checkpoint_every, s.levers.activation_offload, int(s.prefetch_offloaded)
    saved_at_or_below = j // c + 1
    resident = max(0, saved_at_or_below - a)
    b = j - j % c
    fetched = 1 if b // c < a else 0
    prefetch = pre if j == b and b >= c and (b - c) // c < a else 0
    return resident + fetched + (j - b) + prefetch


def grads_so_far_bytes(shape: ModelShape, s: Settings, j: int) -> int:
    """Unsharded, first step: the .grad tensors created by the time layer j's backward ends (the
    layers j .. N-1, the final norm and an untied lm_head); 0 otherwise (ZeRO-3 preallocates its
    partition; later steps already hold every .grad, counted under gradients)."""
    if s.zero_stage != 0 or not s.first_step:
        return 0
    head = 0 if shape.tied_embeddings else shape.vocab * shape.hidden
    return ((shape.layers - j) * sum(n for _, n in shape.layer_params) + shape.hidden + head) * s.act_bytes


def kept_attention_at(shape: ModelShape, s: Settings, j: int) -> int:
    """Kept attention outputs held during layer j's backward: those of the kept layers below j (layer j's
    own became its attention's saved output, counted in the working set; those above are used up). Only
    attention layers keep one (not a family's mixer layers: Qwen3.5's Gated DeltaNet)."""
    return shape.attending_before[min(s.levers.keep_attention_outputs, j)]


def backward_peak_layer(shape: ModelShape, s: Settings) -> int:
    """The layer whose backward sees the most checkpoints, kept attention outputs, gradients and working set:
    the top one, unless offload empties the GPU of checkpoints and first-step gradients pile up towards the
    bottom, or (one KV group per rank) the highest layer keeping its attention output runs the larger
    group-by-group working set below a top layer that runs on all heads."""
    ck = checkpoint_bytes_per_layer(shape, s)
    kept = kept_attention_bytes_per_layer(shape, s)
    ws = {keeps: layer_working_set(shape, s, keeps)[0] for keeps in (False, True)}
    return max(range(shape.layers - 1, -1, -1),
               key=lambda j: gpu_checkpoints_at(shape, s, j) * ck + kept_attention_at(shape, s, j) * kept
               + grads_so_far_bytes(shape, s, j) + ws[j < s.levers.keep_attention_outputs])


def gpu_checkpoints_held(shape: ModelShape, s: Settings) -> int:
    """Layer inputs on the GPU at the backward peak (see backward_peak_layer)."""
    return gpu_checkpoints_at(shape, s, backward_peak_layer(shape, s))


def checkpoints_gpu_bytes(shape: ModelShape, s: Settings) -> int:
    """Checkpointed layer inputs held on the GPU at the backward peak."""
    return gpu_checkpoints_held(shape, s) * checkpoint_bytes_per_layer(shape, s)


def activations_no_checkpointing_bytes(shape: ModelShape, s: Settings) -> int:
    """Without checkpointing every layer keeps its forward-saved tensors (the layer's saved set x N)."""
    if s.levers.gradient_checkpointing:
        return 0
    saved = layer_forward_saved(shape, s)
    return shape.layers * sum(saved.values())


def rope_bytes(shape: ModelShape, s: Settings) -> int:
    """Rotary cos and sin for the local positions, [b, t, d] each in the training dtype, passed to
    every layer (and kept by each checkpoint for its recompute)."""
    return 2 * s.local_tokens * shape.head_dim * s.act_bytes


# --------------------------------------------------------------------------------------------
# The optimizer step


def optimizer_step_bytes(shape: ModelShape, s: Settings) -> int:
    """During the step, per sub-group: its fp32 gradient copy (4 x sub-group elements), plus, for a
    non-fused torch AdamW, a full-size fp32 temporary; on the first step also Adam's m, v, created
    there. Nothing on the GPU when offloaded."""
    if s.optimizer == "none" or s.levers.optimizer_offload:
        return 0
    largest = max(_sub_group_numels(shape, s)) if s.zero_stage == 3 else sum(trainable_numels(shape, s))
    grad = largest * FP32 if (s.bf16 or s.zero_stage == 0) else 0
    new_states = _trainable_shard_numel(shape, s) * 2 * FP32 if s.first_step else 0
    return grad + (0 if s.optimizer_fused else largest * FP32) + new_states


# --------------------------------------------------------------------------------------------
# The estimate


def estimate(shape: ModelShape, s: Settings) -> MemoryEstimate:
    """All terms for one rank, the phase that sets the peak, and the per-host total."""
    check_settings(shape, s)
    ck = checkpoint_bytes_per_layer(shape, s)
    peak_layer = backward_peak_layer(shape, s)
    ws, ws_phase, ws_detail = layer_working_set(shape, s, peak_layer < s.levers.keep_attention_outputs)
    held = gpu_checkpoints_at(shape, s, peak_layer)
    terms = [
        Term("weights", weights_bytes(shape, s), 0, "static"),
        Term("gradients", gradients_bytes(shape, s), 0, "static"),
        Term("fp32 master weights", master_weights_bytes(shape, s), 0, "static"),
        Term("Adam m, v", adam_states_bytes(shape, s), 0, "static"),
        Term("persistent small params", persistent_params_bytes(shape, s), 0, "static"),
        Term("gradient reduce bucket", reduce_bucket_bytes(shape, s), 0, "static"),
        Term(f"layer checkpoints ({held} on GPU, {s.levers.activation_offload} on host)"
         + (f", 1 in {s.levers.checkpoint_every} kept" if s.levers.checkpoint_every > 1 else ""),
             checkpoints_gpu_bytes(shape, s), host_pool_bytes(shape, s), "resident",
             {"per layer": ck}),
        Term("activations without checkpointing", activations_no_checkpointing_bytes(shape, s), 0, "resident"),
        Term(f"attention outputs kept for the recompute ({s.levers.keep_attention_outputs} layers)",
             kept_attention_at(shape, s, peak_layer) * kept_attention_bytes_per_layer(shape, s),
             0, "resident"),
        Term("rope cos/sin", rope_bytes(shape, s), 0, "resident"),
        Term("grads created so far (first step, no ZeRO)",
             grads_so_far_bytes(shape, s, peak_layer), 0, "layer_backward"),
        Term(f"layer working set ({ws_phase})", ws, 0, "layer_backward", ws_detail),
        Term("unattributed (measured, 8 bytes x t x H)", unattributed_bytes(shape, s), 0, "layer_backward"),
        Term("tied embedding grad held to the end", tied_embedding_grad_bytes(shape, s), 0, "layer_backward"),
        # the layer of the kind whose working set binds (a hybrid's DeltaNet or full-attention layer)
        Term("ZeRO-3 gathered layer params + grads",
             layer_gathered_params_bytes(shape, s, binding_layer(shape, peak_layer, ws_phase)), 0, "layer_backward"),
        Term("final norm", final_norm_bytes(shape, s), 0, "loss"),
        Term(f"loss ({'chunked, ' + str(s.loss_chunk_size) + ' rows' if s.loss_type == 'chunked_nll' else 'plain'})",
             loss_bytes(shape, s), 0, "loss"),
        Term("ZeRO-3 gathered lm_head", lm_head_gathered_bytes(shape, s), 0, "loss"),
        Term("grads created in backward (first step, no ZeRO)", gradients_created_in_backward_bytes(shape, s), 0,
             "backward_end"),
        Term("optimizer step fp32 grads" + (" + new Adam m, v" if s.first_step and s.optimizer != "none" else ""),
             optimizer_step_bytes(shape, s), 0, "optimizer_step"),
    ]
    static = sum(t.gpu for t in terms if t.phase == "static")
    resident = sum(t.gpu for t in terms if t.phase == "resident")
    phases = {p: sum(t.gpu for t in terms if t.phase == p) for p in TRANSIENT_PHASES}
    # checkpoints and activations are freed before the optimizer step
    at = {"layer_backward": static + resident + phases["layer_backward"],
          "loss": static + resident + phases["loss"],
          "backward_end": static + phases["backward_end"],
          "optimizer_step": static + phases["optimizer_step"]}
    peak_phase = max(at, key=at.get)
    peak = at[peak_phase]
    if peak_phase in ("optimizer_step", "backward_end"):  # activations are gone by then: not counted
        terms = [replace(t, phase="resident (freed before step)") if t.phase == "resident" else t for t in terms]
    slack = int(peak * s.allocator_slack)
    context = int(s.cuda_context_gb * GIB)
    terms.append(Term(f"allocator slack ({s.allocator_slack:.0%})", slack, 0, "overhead"))
    terms.append(Term("CUDA context, NCCL", context, 0, "overhead"))
    opt_host = host_optimizer_bytes(shape, s)
    terms.append(Term("optimizer states offloaded", 0, opt_host, "static"))
    base = int(s.host_baseline_gb * GIB)
    terms.append(Term("process baseline", 0, base, "overhead"))
    host_rank = sum(t.host for t in terms)
    return MemoryEstimate(shape=shape, settings=s, terms=tuple(terms), phases=phases, peak_phase=peak_phase,
                          gpu_peak=peak, gpu_required=peak + slack + context, host_per_rank=host_rank,
                          host_per_host=host_rank * s.ranks_per_node)
