"""Memory terms of one decoder layer recomputed and backpropagated (the planner's layer_backward phase).

What autograd keeps after a Qwen3 layer's (re)computed forward, what its MLP and attention backward add
on top, and the ZeRO-3 / tied-embedding terms alive during it. Notation as in plan/memory.py.
"""

from __future__ import annotations

from .inputs import ModelShape, Settings, kv_repeat, layer_param_numels, local_tokens

FP32 = 4
# the kernels attention/grouped.py runs group by group (flash_attention_4's group term is cuDNN's, not
# measured: its copies of the group's q, out, d(out) slices stand where cuDNN's repeated k, v are)
GROUPED_KERNELS = ("sdpa", "flash_attention_4", "standin_memory_only")

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
    """Tensors autograd keeps after a Qwen3 decoder layer's (re)computed forward, by what keeps them."""
    t, e, h = local_tokens(s), s.act_bytes, shape.hidden
    q, kp = shape.q_width, shape.kv_width * kv_repeat(shape, s.sp)
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
        "o_proj input": t * q * e if s.sp > 1 else 0,
        # post_attention_layernorm: fp32 upcast + normalized + its output (the MLP input)
        ("post-attention norm (input, output)" if lean else "post-attention norm (fp32 upcast, normalized, output)"):
            rmsnorm_saved_bytes(t, h, e, lean) + t * h * e,
        # untiled MLP: act_fn keeps gate(x), the product keeps act(gate(x)) and up(x), down_proj keeps
        # the product: 4 [t, I] tensors (not 3: SiLU's backward needs its input, the product both
        # factors); tiled: only the input, counted with the norm output above
        "MLP intermediates (gate, act, up, product)": 4 * t * shape.intermediate * e if s.tiled_mlp == 1 else 0,
    }
    return saved


def mlp_backward_extra(shape: ModelShape, s: Settings) -> dict[str, int]:
    """Beyond the saved tensors, during the MLP's backward. Untiled: the grads of the product and of
    act/up coexist with the saved four (2 more [t, I]), and the gate/up input grads ([t, H] each).
    Tiled: the full input grad plus one tile's forward + backward (6 [r, I] and 2 [r, H], r = t/tiles)."""
    t, e, h, i = local_tokens(s), s.act_bytes, shape.hidden, shape.intermediate
    if s.tiled_mlp == 1:
        return {"MLP backward: grads of product, act, up": 2 * t * i * e,
                "MLP backward: input grads (gate, up)": 2 * t * h * e}
    r = -(-t // s.tiled_mlp)
    return {"tiled MLP: input grad [t, H]": t * h * e,
            f"tiled MLP: one tile of {r} rows (intermediates + grads)": 6 * r * i * e + 2 * r * h * e}


def attention_backward_extra(shape: ModelShape, s: Settings) -> dict[str, int]:
    """Beyond the saved tensors, during attention's backward: the output grad, the all-to-all send and
    receive buffers (sp > 1), dq, dk, dv, the fp32 dq accumulator and the fp32 softmax row sums of a
    flash-style kernel, and the residual-stream grad."""
    t, e, h = local_tokens(s), s.act_bytes, shape.hidden
    q, kp = shape.q_width, shape.kv_width * kv_repeat(shape, s.sp)
    terms = {
        "attention backward: d(out) + all-to-all buffers": t * q * e * (3 if s.sp > 1 else 1),
        "attention backward: dq, dk, dv": t * (q + 2 * kp) * e,
        "residual-stream grad": t * h * e,
    }
    groups = attention_groups(shape, s.sp)
    if not (s.grouped_attention and s.attention in GROUPED_KERNELS and groups > 1):
        terms["attention backward: fp32 dq accumulator + row sums"] = t * q * FP32 + t * shape.heads * FP32
        return terms
    # one KV-head group at a time (attention/grouped.py): the accumulator and row sums of its query heads,
    # its KV head repeated for them (k, v) and the kernel's three grads of the group's width
    gq = q // groups
    terms["attention backward, one KV group: fp32 dq accumulator, row sums, repeated k, v, grads"] = (
        t * gq * FP32 + t * (shape.heads // groups) * FP32 + 5 * t * gq * e)
    return terms


def attention_groups(shape: ModelShape, sp: int) -> int:
    """KV-head groups each rank's attention runs one at a time: its KV heads after replication."""
    return max(1, shape.kv_heads * kv_repeat(shape, sp) // sp)


def layer_flow_bytes(shape: ModelShape, s: Settings) -> dict[str, int]:
    """Alive through the whole layer backward: the incoming output grad, the recomputed layer output
    (held by the checkpoint function until its backward returns) and the input grad being filled."""
    t, e, h = local_tokens(s), s.act_bytes, shape.hidden
    return {"layer output grad (incoming)": t * h * e, "recomputed layer output": t * h * e,
            "layer input grad": t * h * e}


def layer_working_set(shape: ModelShape, s: Settings) -> tuple[int, str, dict[str, int]]:
    """The one-layer working set during backward recompute: (bytes, sub-phase, breakdown).

    Two sub-phases compete: during the MLP backward everything saved by the layer is alive; during the
    attention backward the MLP's and post-norm's saved tensors are gone but attention's grads appear.
    """
    saved = layer_forward_saved(shape, s)
    flow = layer_flow_bytes(shape, s)
    mlp = {**flow, **saved, **mlp_backward_extra(shape, s)}
    attn_saved = {k: v for k, v in saved.items() if not k.startswith(("post-attention", "MLP"))}
    attn = {**flow, **attn_saved, **attention_backward_extra(shape, s)}
    if not s.gradient_checkpointing:  # the saved tensors are counted under activations already
        mlp = {k: v for k, v in mlp.items() if k not in saved}
        attn = {k: v for k, v in attn.items() if k not in saved}
    best = max((("MLP backward", mlp), ("attention backward", attn)), key=lambda kv: sum(kv[1].values()))
    return sum(best[1].values()), best[0], best[1]


def unattributed_bytes(shape: ModelShape, s: Settings) -> int:
    """Measured but not attributed to a tensor above: at the peak of a Qwen3 layer's attention backward
    the H200 allocator history shows one more fp32 [t, H] (allocated by an RMSNorm upcast) and one more
    [t, H] in the training dtype than the saved-tensor accounting gives. The same 6 bytes x t x H close
    the gap for both the plain-HF-based ALST baseline and ours with HF norms (see plan/calibration.json).
    With lean norms (no upcast) none is left: the 256K H200 runs with lean norms measured 1.6% below the
    estimate without it (benchmarks/results/*_grouped.json)."""
    if s.lean_norm:
        return 0
    t, h = local_tokens(s), shape.hidden
    return t * h * FP32 + t * h * s.act_bytes


def kept_attention_bytes_per_layer(shape: ModelShape, s: Settings) -> int:
    """One layer's kept attention output (training dtype) and fp32 log-sum-exp: all heads' worth of t tokens
    (under SP: all tokens x heads/sp, the same bytes)."""
    t = local_tokens(s)
    return t * shape.q_width * s.act_bytes + t * shape.heads * FP32


def tied_embedding_grad_bytes(shape: ModelShape, s: Settings) -> int:
    """With tied embeddings the lm_head / embedding weight is used twice, so autograd holds the loss's
    full [V, H] weight grad until the embedding's backward, at the very end of the backward pass."""
    if not shape.tied_embeddings:
        return 0
    return shape.vocab * shape.hidden * s.act_bytes


def layer_gathered_params_bytes(shape: ModelShape, s: Settings) -> int:
    """ZeRO-3 during a layer's backward: the layer's parameters gathered in full, the prefetch bucket
    for the next, and full-size weight grads before reduce-scatter (tiled MLP accumulates its three
    weight grads over the tiles; otherwise one weight grad at a time)."""
    if s.zero_stage == 0:
        return 0
    e = s.act_bytes
    layer = sum(layer_param_numels(shape))
    pre = s.zero3.prefetch_bucket_size
    prefetch = int(0.9 * shape.hidden**2) if pre is None else pre
    hi = shape.hidden * shape.intermediate
    grads = 3 * hi if s.tiled_mlp > 1 else hi
    return (layer + min(prefetch, layer) + grads) * e
