"""How many times ZeRO-3 all-gathers each parameter in one micro-step, from the order modules use them.

DeepSpeed records the order in which modules fetch their parameters during the first step (the trace)
and from then on, after a module has run, releases each of its parameters unless the parameter is used
again within `stage3_max_reuse_distance` elements of parameters fetched in between (partitioned_param_
coordinator.__params_to_release: it walks the trace forward from the next module, adding each module's
parameter count, and stops once the sum reaches the distance). A released parameter is gathered again
at its next use; the trace ends with the micro-step, so the last use always releases. Parameters at or
below stage3_param_persistence_threshold stay gathered and are never fetched.

The module order is the family's (families/), here that of a Qwen3 decoder under this trainer
(reentrant checkpointing: backward
re-runs each layer's forward just before that layer's backward; checkpoint_every=k first rebuilds
the block's lower layers from its kept input, levers/recompute.py):
  forward:  embed, per layer [input_norm, q, q_norm, k, k_norm, v, o, post_attention_norm, gate, up,
            down], final norm, lm_head (the loss head; a tied one is the embedding)
  backward: lm_head, final norm, per layer from the top [rebuilds, recompute forward, backward in
            reverse module order], embed
A Qwen3.5 Gated DeltaNet layer (families/qwen3_5/ulysses_deltanet.py) uses in_proj_qkv, in_proj_b, in_proj_a, conv1d,
A_log, dt_bias, in_proj_z, the gated norm, out_proj in place of q .. o (ModelShape.layer_orders: each layer
its own kind's order).
A tiled MLP (levers/tiled_mlp.py, T tiles) runs gate, up, down T times in forward, not at all in the
recompute, and T times forward-then-backward in its backward: at long lengths those T x 3 MLP uses
lie between a layer's recompute and its attention's backward, so with an 8B model and 12 tiles q, k,
v, o are gathered a third time there. A sparse MLP (levers/sparse_moe.py) runs its router once on all the
rows (forward, recompute, backward) and the experts module (gate_up and down) once per tile.
Steady state (the trace exists from the second step on; the memory the prefetcher then holds, up to
stage3_max_live_parameters, is plan/layer_terms.layer_gathered_params_bytes). Not modelled here:
stage3_max_live_parameters forcing earlier releases (the default config's 1e9 does not bind below
~5B-parameter layers), and the
prefetcher's own hold on parameters whose reuse it skipped: on the tiny model with the default config
the gathered bytes that `rehearse --count_collectives` counts equal this model's (tests/test_rehearse.py),
but with a reuse distance shrunk to 30,000 elements DeepSpeed 0.19.8 kept more than this walk predicts
(19.6 MB gathered against 29.4 MB modelled), so check a new setting with --count_collectives.
"""

from __future__ import annotations

from collections import Counter

from .inputs import ModelShape

Param = tuple[int, str]  # (layer index or -1, tensor name)


def forward_order(shape: ModelShape) -> list[str]:
    """A layer's tensors in the order its modules use them (ModelShape.forward_order)."""
    return list(shape.forward_order)


def module_trace(shape: ModelShape, gradient_checkpointing: bool = True, checkpoint_every: int = 1,
                 tiled_mlp: int = 1) -> list[Param]:
    """The parameters in the order modules fetch them in one micro-step (one module uses one tensor here)."""
    mlp = list(shape.mlp_tiled)  # the family's MlpBlock.trace_groups: used once a tile
    # each layer's input_norm .. post_attention_norm (its attention's or its mixer's), a sparse MLP's router
    # (a norm after the MLP, Gemma 3's, is listed with them: norms are persistent, their place gathers nothing)
    attns = [[n for n in order if n not in mlp] for order in shape.layer_orders]
    tiled = tiled_mlp > 1  # levers/tiled_mlp.py: forward runs the tiles; backward re-runs each before its backward
    at = lambda i, names: [(i, n) for n in names]  # noqa: E731
    forward = lambda i: at(i, attns[i] + mlp * tiled_mlp)  # noqa: E731
    # a checkpoint's recompute skips a tiled MLP's forward (sharding.mlp_output_unused) where the family allows: its
    # backward recomputes
    skip = tiled and shape.family.recompute_skips_mlp()
    recompute = lambda i: at(i, attns[i] + ([] if skip else mlp * tiled_mlp))  # noqa: E731
    backward = lambda i: at(i, (mlp + mlp[::-1]) * tiled_mlp if tiled else mlp[::-1]) + at(i, attns[i][::-1])  # noqa: E731
    head: Param = (-1, "embed") if shape.tied_embeddings else (-1, "lm_head")
    trace: list[Param] = [(-1, "embed")]
    for i in range(shape.layers):
        trace += forward(i)
    trace += [(-1, "final_norm"), head, head, (-1, "final_norm")]  # the loss head's forward, then its backward
    k = checkpoint_every if gradient_checkpointing else 1
    for top in range(shape.layers - 1, -1, -1):
        if top % k == k - 1 or top == shape.layers - 1:  # a block's top layer rebuilds the layers below it
            for i in range(top - top % k, top):
                trace += forward(i)
        if gradient_checkpointing:
            trace += recompute(top)
        trace += backward(top)
    return trace + [(-1, "embed")]


def gathers_per_micro_step(shape: ModelShape, gradient_checkpointing: bool = True, checkpoint_every: int = 1,
                           persistence_threshold: int | None = None, max_reuse_distance: int = 1_000_000_000,
                           tiled_mlp: int = 1) -> Counter:
    """Tensor name -> all-gathers per micro-step, summed over layers ("q": every layer's q_proj)."""
    thr = shape.auto_persistence_threshold if persistence_threshold is None else persistence_threshold
    size = shape.numels
    trace = module_trace(shape, gradient_checkpointing, checkpoint_every, tiled_mlp)
    prefix = [0]
    for _, name in trace:
        prefix.append(prefix[-1] + size[name])
    last: dict[Param, int] = {}
    gathers: Counter = Counter()
    for pos, p in enumerate(trace):
        if size[p[1]] <= thr:
            continue  # persistent
        prev = last.get(p)
        # released after the previous use unless the elements fetched in between stay under the distance
        if prev is None or prefix[pos] - prefix[prev + 1] >= max_reuse_distance:
            gathers[p[1]] += 1
        last[p] = pos
    return gathers
