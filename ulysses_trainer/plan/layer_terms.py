"""Memory terms of one decoder layer recomputed and backpropagated (the planner's layer_backward phase).

What autograd keeps after a Qwen3 layer's (re)computed forward, what its MLP and attention backward add
on top, and the ZeRO-3 / tied-embedding terms alive during it. Notation as in plan/memory.py.
"""

from __future__ import annotations

from ..vocabulary.names import KEEPING_KERNELS, STANDIN_FA4, groups_one_at_a_time
from . import rates
from .inputs import ModelShape, Settings, kv_repeat, mlp_run

FP32 = 4
# the kernels attention/grouped.py runs group by group (flash_attention_4's group term is cuDNN's, not
# measured: its copies of the group's q, out, d(out) slices stand where cuDNN's repeated k, v are)
GROUPED_KERNELS = KEEPING_KERNELS

def rmsnorm_saved_bytes(tokens: int, width: int, e: int, lean: bool = False) -> int:
    """What autograd keeps for an RMSNorm on [tokens, width], not its output (the consumer keeps it) nor
    the fp32 scale per row (both keep that). HF: the fp32 upcast of its input (shared by pow and the
    rsqrt multiply; no copy when the input is fp32 already) and the normalized tensor cast back to the
    input dtype (kept by the weight multiply). Lean (levers/lean_norm.py): its input, nothing else;
    measured on CPU by tests/test_lean_norm.py."""
    if lean:
        return tokens * width * e
    upcast = tokens * width * FP32 if e < FP32 else 0
    return upcast + tokens * width * e


def layer_forward_saved(shape: ModelShape, s: Settings) -> dict[str, int]:
    """Tensors autograd keeps after a decoder layer's (re)computed forward, by what keeps them (the MLP's: the
    family's MlpBlock.saved)."""
    t, e, h = s.local_tokens, s.act_bytes, shape.hidden
    q, kp = shape.q_width, shape.kv_width * kv_repeat(shape, s.sp_size)
    lean = s.lean_norm
    saved = {
        # input_layernorm: HF fp32 upcast + normalized; lean: its input, the layer input, which the
        # checkpoint holds already (counted there); its output is kept once by q/k/v_proj
        ("input norm (output)" if lean else "input norm (fp32 upcast, normalized, output)"):
            (0 if lean else rmsnorm_saved_bytes(t, h, e)) + t * h * e,
        # q_norm / k_norm on the projections: HF fp32 upcast + normalized; lean: the projection outputs
        # (their outputs feed rope, which keeps only cos/sin)
        ("q_norm, k_norm (inputs)" if lean else "q_norm, k_norm (fp32 upcast, normalized)"):
            (rmsnorm_saved_bytes(t, q, e, lean) + rmsnorm_saved_bytes(t, shape.kv_width, e, lean))
            if shape.qk_norm else 0,
        # the kernel keeps q, k, v (rope applied; after the all-to-all: all tokens, heads/sp), its
        # output and an fp32 log-sum-exp per query head and token
        "attention q, k, v (after rope / all-to-all)": t * (q + 2 * kp) * e,
        "attention output + LSE (fp32)": t * q * e + t * shape.heads * FP32,
        # o_proj keeps its input: under sp > 1 the all-to-all's [t, Q] result (a new tensor); with sp = 1
        # it is the kernel's output itself (measured on the H200: no copy)
        "o_proj input": t * q * e if s.sp_size > 1 else 0,
        # post_attention_layernorm: fp32 upcast + normalized + its output (the MLP input)
        ("post-attention norm (input, output)" if lean else "post-attention norm (fp32 upcast, normalized, output)"):
            rmsnorm_saved_bytes(t, h, e, lean) + t * h * e,
    }
    extra = len(shape.family.layer_norms()) - 2
    if extra > 0:  # norms on the blocks' outputs (Gemma 3): each keeps its input, o_proj's or the MLP's output
        saved["post-attention: block-output norms (inputs)"] = extra * rmsnorm_saved_bytes(t, h, e, lean)
    saved.update(shape.family.mlp.saved(shape.dims, mlp_run(shape, s)))  # the family's MLP block
    return saved


def mlp_backward_extra(shape: ModelShape, s: Settings) -> dict[str, int]:
    """Beyond the saved tensors, during the MLP's backward: the family's block (MlpBlock.backward_extra; a
    gated MLP untiled: the grads of the product and of act/up and the gate/up input grads; tiled: the input
    grad plus one tile's forward and backward)."""
    return shape.family.mlp.backward_extra(shape.dims, mlp_run(shape, s))


def attention_groups(shape: ModelShape, sp_size: int) -> int:
    """KV-head groups each rank's attention runs one at a time: its KV heads after replication."""
    return max(1, shape.kv_heads * kv_repeat(shape, sp_size) // sp_size)


def top_layer_keeps_output(shape: ModelShape, s: Settings) -> bool:
    """Whether the top layer keeps its attention output: the kept layers are the lowest ones
    (plan/memory.py kept_attention_at), so only when every layer does."""
    return s.levers.keep_attention_outputs >= shape.layers


def attention_runs_grouped(shape: ModelShape, s: Settings, keeps_output: bool) -> bool:
    """Whether a layer's attention runs one KV-head group at a time (attention/grouped.py), as the kernels
    choose: flash_attention_4 (and its stand-in) always (dense rows); sdpa and the stand-in with more than
    one KV head per rank, or when the layer keeps its output for the recompute (grouped.runs_grouped: keeping needs the
    explicit-LSE path, even for one group); the baselines (grouped_attention off) and flash_attention_2
    never: one kernel on all heads (F.sdpa, flash_attn_func)."""
    if not (s.grouped_attention and s.attn_implementation in GROUPED_KERNELS):
        return False
    return s.attn_implementation in ("flash_attention_4", STANDIN_FA4) or \
        groups_one_at_a_time(attention_groups(shape, s.sp_size), keeps_output)


def sdpa_runs_gqa(shape: ModelShape, s: Settings) -> bool:
    """Whether ours calls F.sdpa with fewer KV heads than query heads on a rank (enable_gqa, attention/kernels.py),
    when a layer runs on all heads. The baselines (grouped_attention off) are calibrated as they ran."""
    return s.attn_implementation == "sdpa" and s.grouped_attention and \
        shape.heads > shape.kv_heads * kv_repeat(shape, s.sp_size)


def attention_backward_extra(shape: ModelShape, s: Settings, keeps_output: bool | None = None) -> dict[str, int]:
    """Beyond the saved tensors, when attention's backward kernel runs: its output grad, the residual-stream
    grad, and the grads and workspace of the path the layer takes (`keeps_output`: the layer keeps its
    attention output; default: as the top layer). Gone by then (H200 allocator history, sp=8 rehearsals of
    Qwen3-8B on both paths, benchmarks/results/rehearsal/memory_variants_8b_sp8.json): o_proj's input grad
    and the all-to-all's send buffer, which the all-to-all's backward frees once its result exists."""
    t, e, h = s.local_tokens, s.act_bytes, shape.hidden
    q, kp = shape.q_width, shape.kv_width * kv_repeat(shape, s.sp_size)
    if keeps_output is None:
        keeps_output = top_layer_keeps_output(shape, s)
    terms = {
        # the kernel's d(out) [L, Q/sp]: the all-to-all's result (sp > 1) or o_proj's input grad (sp = 1)
        "attention backward: d(out)": t * q * e,
        # all heads: the kernel's own dq, dk, dv; grouped: the full-size buffers the groups' grads fill
        "attention backward: dq, dk, dv": t * (q + 2 * kp) * e,
        # the grad of the attention block's output: the MLP's input grad + the layer output grad, summed
        "residual-stream grad": t * h * e,
    }
    if not attention_runs_grouped(shape, s, keeps_output):
        # one kernel on all heads (F.sdpa, the stand-in): a flash-style fp32 dq accumulator for every head and
        # fp32 row sums
        if not sdpa_runs_gqa(shape, s):
            terms["attention backward: fp32 dq accumulator + row sums"] = t * q * FP32 + t * shape.heads * FP32
            return terms
        # F.sdpa on k, v not repeated (enable_gqa): cuDNN's backward takes twice the accumulator in one fp32
        # workspace (H200, torch 2.11, cuDNN 9.19: Qwen3-8B at sp=8, 4 query heads per KV head; the stand-in
        # allocates the flash-style one, 2 [t, Q] x 2 B less)
        terms["attention backward: cuDNN GQA workspace (2 fp32 dq accumulators + row sums)"] = (
            2 * t * q * FP32 + t * shape.heads * FP32)
        return terms
    # one KV-head group at a time (attention/grouped.py), also with one group (a kept output): the fp32
    # accumulator and row sums of the group's query heads, its KV head repeated for them (k, v: 2 x [L, gq])
    # and the kernel's dq, dk, dv at that width (3 x [L, gq]: dk, dv before the sum over the copies)
    groups = attention_groups(shape, s.sp_size)
    gq = q // groups
    terms["attention backward, one KV group: fp32 dq accumulator, row sums, repeated k, v, grads"] = (
        t * gq * FP32 + t * (shape.heads // groups) * FP32 + 5 * t * gq * e)
    return terms


def layer_flow_bytes(shape: ModelShape, s: Settings) -> dict[str, int]:
    """Alive through the whole layer backward: the incoming output grad and the recomputed layer output
    (held by the checkpoint function until its backward returns). Not the layer's input grad: the input
    norm's backward and the residual add make it after attention's backward, when both sub-phases below
    are over (absent at both peaks in the H200 allocator history of the sp=8 rehearsals)."""
    t, e, h = s.local_tokens, s.act_bytes, shape.hidden
    return {"layer output grad (incoming)": t * h * e, "recomputed layer output": t * h * e}


def layer_working_set(shape: ModelShape, s: Settings,
                      keeps_output: bool | None = None) -> tuple[int, str, dict[str, int]]:
    """The one-layer working set during backward recompute: (bytes, sub-phase, breakdown). `keeps_output`:
    the layer keeps its attention output (which sets attention's path; default: as the top layer).

    Two sub-phases compete: during the MLP backward everything saved by the layer is alive; during the
    attention backward the MLP's, post-norm's and o_proj's saved tensors are gone (their backward ran first)
    but attention's grads appear.
    """
    saved = layer_forward_saved(shape, s)
    flow = layer_flow_bytes(shape, s)
    mlp = {**flow, **saved, **mlp_backward_extra(shape, s)}
    attn_saved = {k: v for k, v in saved.items() if not k.startswith(("post-attention", "MLP", "o_proj"))}
    attn = {**flow, **attn_saved, **attention_backward_extra(shape, s, keeps_output)}
    if not s.levers.gradient_checkpointing:  # the saved tensors are counted under activations already
        mlp = {k: v for k, v in mlp.items() if k not in saved}
        attn = {k: v for k, v in attn.items() if k not in saved}
    phases = [("MLP backward", mlp), ("attention backward", attn)]
    mixer = shape.family.mixer
    if mixer is not None and shape.mixer_layers:  # the other layer kind (Qwen3.5's Gated DeltaNet layers)
        run = mlp_run(shape, s)
        own = {k: v for k, v in saved.items() if not k.startswith(("q_norm", "attention", "o_proj"))}
        own.update(mixer.saved(shape.dims, run))
        mixer_mlp = {**flow, **own, **mlp_backward_extra(shape, s)}
        mixer_own = {**flow, **{k: v for k, v in own.items() if not k.startswith(("post-attention", "MLP"))},
                     **mixer.backward_extra(shape.dims, run, rates)}
        if not s.levers.gradient_checkpointing:
            mixer_mlp = {k: v for k, v in mixer_mlp.items() if k not in own}
            mixer_own = {k: v for k, v in mixer_own.items() if k not in own}
        phases += [(f"{mixer.kind} layer: MLP backward", mixer_mlp), (f"{mixer.kind} backward", mixer_own)]
    best = max(phases, key=lambda kv: sum(kv[1].values()))
    return sum(best[1].values()), best[0], best[1]


def unattributed_bytes(shape: ModelShape, s: Settings) -> int:
    """Measured but not attributed to a tensor above, with HF's norms: at the peak of a Qwen3 layer's
    attention backward the H200 allocator history showed one more fp32 [t, H] (allocated by an RMSNorm
    upcast) and one more [t, H] in the training dtype than the saved-tensor accounting gave then; that
    accounting also counted the layer's input grad, which does not exist yet at that peak (layer_flow_bytes),
    so a second [t, H] in the training dtype is unattributed as well. The same 8 bytes x t x H close the gap
    for both the plain-HF-based ALST baseline and ours with HF norms (see plan/calibration.json). With lean
    norms (no upcast) none is left: the lean-norm points (sp = 1, 2 and 8) are within -2.6% .. +1.2% without it."""
    if s.lean_norm:
        return 0
    t, h = s.local_tokens, shape.hidden
    return t * h * FP32 + 2 * t * h * s.act_bytes


def kept_attention_bytes_per_layer(shape: ModelShape, s: Settings) -> int:
    """One layer's kept attention output (training dtype) and fp32 log-sum-exp: all heads' worth of t tokens
    (under SP: all tokens x heads/sp, the same bytes)."""
    t = s.local_tokens
    return t * shape.q_width * s.act_bytes + t * shape.heads * FP32


def tied_embedding_grad_bytes(shape: ModelShape, s: Settings) -> int:
    """With tied embeddings the lm_head / embedding weight is used twice, so autograd holds the loss's
    full [V, H] weight grad until the embedding's backward, at the very end of the backward pass."""
    if not shape.tied_embeddings or s.trainable_numels is not None:  # LoRA: the embedding is frozen
        return 0
    return shape.vocab * shape.hidden * s.act_bytes


def layer_numel(shape: ModelShape, i: int) -> int:
    """Parameters of decoder layer i, of its own kind (Qwen3.5: a Gated DeltaNet or a full-attention layer)."""
    return sum(shape.numels[n] for n in shape.layer_orders[i])


def binding_layer(shape: ModelShape, j: int, phase: str) -> int:
    """The layer whose working set binds at the backward peak: layer j (plan/memory.backward_peak_layer) where
    its kind is the one the working set's sub-phase names (layer_working_set: a mixer layer's phases start with
    the mixer's kind), else the first layer of that kind the backward reaches from j down (the lowest one above
    j where none is below)."""
    mixer = shape.family.mixer
    mixed = set(shape.mixer_layers)
    if mixer is None or not mixed:
        return j
    wanted = phase.startswith(f"{mixer.kind} ")
    kind = [i for i in range(shape.layers) if (i in mixed) == wanted]
    below = [i for i in kind if i <= j]
    return max(below) if below else min(kind)


def layer_gathered_params_bytes(shape: ModelShape, s: Settings, layer: int | None = None) -> int:
    """ZeRO-3 during a layer's backward: the parameters gathered in full, and full-size weight grads before
    reduce-scatter (tiled MLP accumulates its three weight grads over the tiles; otherwise one weight grad
    at a time). Gathered: the layer's own (`layer`, default the top one: its own kind's parameters, Qwen3.5's
    DeltaNet and full-attention layers differ) and the prefetch bucket for the next the backward reaches (the
    layer below, of its own kind); from the second step on (the trace exists) the prefetcher keeps parameters
    gathered up to stage3_max_live_parameters (H200 allocator history of Qwen3-4B at sp=2: 1.88 GiB of gathered
    parameters at step 2's peak, none at step 1's, the whole difference between the two steps' peaks; 1e9
    elements in bf16 are 1.86 GiB)."""
    if s.zero_stage == 0:
        return 0
    e = s.act_bytes
    i = shape.layers - 1 if layer is None else layer
    own = layer_numel(shape, i)
    pre = s.zero3.prefetch_bucket_size
    prefetch = shape.auto_prefetch_bucket if pre is None else pre
    gathered = own + min(prefetch, layer_numel(shape, i - 1) if i > 0 else own)
    if s.zero3_trace:
        gathered = max(gathered, min(s.zero3.max_live_parameters, shape.num_params))
    grads = shape.family.mlp.weight_grad_numel(shape.dims, mlp_run(shape, s))  # the MLP block's full-size grads
    return (gathered + grads) * e
