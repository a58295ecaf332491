"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm) and a sparse MoE block in every layer.

The block (transformers' Qwen3MoeSparseMoeBlock): a router (Linear H -> E, softmax, top_k, renormalised
when norm_topk_prob) and E experts, each a gated SiLU MLP of width moe_intermediate_size, held fused
as gate_up_proj [E, 2I, H] and down_proj [E, H, I]. Presets from the published Qwen/Qwen3-30B-A3B and
Qwen/Qwen3-235B-A22B configs: vocab 151,936, head_dim 128, rope_theta 1e6, max_position_embeddings
40,960, rms_norm_eps 1e-6, every layer sparse, top-8 of 128 experts, norm_topk_prob true,
router_aux_loss_coef 0.001, untied embeddings (tests/test_families.py checks the parameter counts
against the published ~30.5B / ~3.3B and ~235B / ~22B).
"""

from __future__ import annotations

from typing import Any

from ..base import FP32, AllReduce, Family, LayerDims, MlpBlock, MlpRun
from ..qwen3 import common_kwargs

# name: (hidden, moe_intermediate, dense intermediate, layers, q heads, kv heads, experts, top_k, head_dim, tied)
_DIMS: dict[str, tuple[int, int, int, int, int, int, int, int, int, bool]] = {
    # CPU preset: real vocabulary; 8 q / 2 kv heads (sp=4 replicates KV); 8 experts, top-2
    "tiny-moe": (64, 32, 128, 2, 8, 2, 8, 2, 16, True),
    "qwen3-30b-a3b": (2048, 768, 6144, 48, 32, 4, 128, 8, 128, False),
    "qwen3-235b-a22b": (4096, 1536, 12288, 94, 64, 4, 128, 8, 128, False),
}
ROUTER_AUX_LOSS_COEF = 0.001


def experts_rate(pts: tuple[tuple[int, float], ...], tiles: int) -> tuple[float, bool]:
    """(active TFLOP/s of the sparse block at `tiles`, extrapolated?) from one implementation's measured (tiles,
    TFLOP/s) points: the seconds per FLOP interpolated linearly in the tile count between measured counts (a tiled
    block's time grows about linearly with its tiles), held at the last measured count beyond it."""
    if tiles >= pts[-1][0]:
        return pts[-1][1], tiles != pts[-1][0]
    for (k0, r0), (k1, r1) in zip(pts, pts[1:]):
        if k0 <= tiles <= k1:
            w = (tiles - k0) / (k1 - k0)
            return 1.0 / ((1 - w) / r0 + w / r1), False
    return pts[0][1], True


def experts_calls(run: MlpRun) -> float:
    """One layer's sparse block in one micro-step, in measured block calls (forward + backward at the step's tile
    count). Untiled, a call is 6 FLOPs per active parameter and row and each further forward adds 2 of them;
    tiled, a call is 8 (its forward runs without a graph, its backward recomputes each tile) and a checkpoint's
    recompute skips the experts (parallel/sharding.mlp_output_unused), while checkpoint_every's rebuilds run them."""
    fp = run.forward_passes
    if run.levers.tiled_mlp == 1:
        return (2.0 * fp + 4.0) / 6.0
    return (2.0 * (fp - (1.0 if run.levers.gradient_checkpointing else 0.0)) + 6.0) / 8.0


class SparseMoeMlp(MlpBlock):
    """transformers' Qwen3MoeSparseMoeBlock: a router (Linear H -> E) and E gated experts held fused; the trainer
    runs it as levers/sparse_moe.SparseMoE (router on all rows, experts by tiles, router statistics for the
    load-balancing loss, summed over the SP group)."""

    lora_refusal = " (its experts are fused 3-D weights and its router is not a Linear)"  # no Linear to adapt

    def dims(self, config: Any) -> dict[str, int]:
        return {"intermediate": config.moe_intermediate_size, "experts": config.num_experts,
                "top_k": config.num_experts_per_tok}

    def check_config(self, config: Any) -> str | None:
        step = getattr(config, "decoder_sparse_step", 1)
        dense = list(getattr(config, "mlp_only_layers", None) or [])
        if step != 1 or dense:
            return (f"every layer must be sparse (decoder_sparse_step 1, no mlp_only_layers), got "
                    f"decoder_sparse_step={step}, mlp_only_layers={dense}")
        return None

    def training_config(self, config: Any, model_init_kwargs: dict[str, Any]) -> None:
        if "output_router_logits" not in model_init_kwargs:
            # the load-balancing loss is on unless model_init_kwargs turns it off (checkpoints often save false)
            config.output_router_logits = True

    def params(self, d: LayerDims) -> list[tuple[str, int]]:
        """The router's weight, then the experts' fused gate_up [E, 2I, H] and down [E, H, I] (one module holds
        both)."""
        h, i = d.hidden, d.intermediate
        return [("router", d.experts * h), ("experts_gate_up", d.experts * 2 * i * h),
                ("experts_down", d.experts * h * i)]

    def trace_groups(self, d: LayerDims) -> tuple[list[str], list[str]]:
        """The router runs once on all the rows (forward, recompute, backward); the experts once per tile."""
        names = [n for n, _ in self.params(d)]
        return names[:1], names[1:]

    def active_numel(self, d: LayerDims) -> int:
        """The router and top_k of the experts."""
        return d.experts * d.hidden + d.top_k * 3 * d.hidden * d.intermediate

    def row_width(self, d: LayerDims) -> int:
        """A token runs top_k experts of one expert's width each."""
        return d.intermediate * d.top_k

    def saved(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """levers/sparse_moe.py: the router's logits [t, E] and two fp32 softmaxes of them (the router's, for its
        top-k weights; the statistics', for the probability sums), the routing weights and chosen experts [t, k];
        untiled, the experts' permuted token buffer (top_k x t rows of H) and each routed row's intermediates
        (gate_up 2I, act I, product I); tiled, the experts keep only the block input, counted with the
        post-attention norm's output."""
        t, e, h, i, k, n = run.tokens, run.act_bytes, d.hidden, d.intermediate, d.top_k, d.experts
        terms = {"router logits + 2 fp32 softmaxes, routing weights and experts":
                 t * n * (e + 2 * FP32) + t * k * (e + 8)}
        if run.experts_implementation == "batched_mm":
            # transformers' batched_mm gathers each row's gate_up weights [rows, 2I, H] (per top-k slot): on the
            # H200, one Qwen3-30B-A3B block at 131,072 rows asked for 768 GiB = 131,072 x 1536 x 2048 x 2 B
            r = -(-t // run.levers.tiled_mlp)
            terms["experts (batched_mm): gathered gate_up weights of one tile's rows"] = r * 2 * i * h * e
        if run.levers.tiled_mlp == 1:
            terms["experts: permuted token buffer (top_k x t rows)"] = k * t * h * e
            terms["experts: intermediates of the top_k x t routed rows (gate_up, act, product)"] = 4 * k * t * i * e
        return terms

    def backward_extra(self, d: LayerDims, run: MlpRun) -> dict[str, int]:
        """Per routed row (top_k per token) as a dense MLP per token, plus the permuted buffer's grad."""
        t, e, h, i, k = run.tokens, run.act_bytes, d.hidden, d.intermediate, d.top_k
        if run.levers.tiled_mlp == 1:
            return {"experts backward: grads of product, act, up (top_k x t rows)": 2 * k * t * i * e,
                    "experts backward: permuted buffer grad and input grad": (k + 1) * t * h * e}
        r = -(-t // run.levers.tiled_mlp)
        return {"tiled experts: input grad [t, H]": t * h * e,
                f"tiled experts: one tile of {r} tokens (top_k x rows: buffer, intermediates, grads)":
                    6 * k * r * i * e + 3 * k * r * h * e}

    def weight_grad_numel(self, d: LayerDims, run: MlpRun) -> int:
        """All experts' weights: one experts module holds gate_up and down, so their grads accumulate in full."""
        return 3 * d.hidden * d.intermediate * max(1, d.experts)

    def experts_flops(self, d: LayerDims, run: MlpRun, layers: int) -> float:
        """The experts, one micro-step on one rank: 2 FLOPs per active expert parameter (top_k of them per token)
        and token per forward, 4 per backward."""
        per_layer = d.top_k * 3 * d.hidden * d.intermediate
        return layers * per_layer * run.tokens * (2.0 * run.forward_passes + 4.0)

    def time_parts(self, d: LayerDims, run: MlpRun, layers: int, vocab: int,
                   rates: Any) -> tuple[float, dict[str, float], list[str]]:
        """The sparse blocks at the block's measured rate by tile count (moe/moe_experts_h200.json; experts_calls
        of it per layer) and the once-per-step part (embedding, final norm, chunked lm_head + loss) at the cost
        the 1- and 8-layer profiles measure: the lm_head's 6 V H t FLOPs at LOSS_MATMUL_TFLOPS plus
        LOSS_S_PER_LOGIT per logit. Both come out of the dense rate, which then covers the attention
        projections and the router."""
        t = run.tokens
        lm_head = 6.0 * vocab * d.hidden * t
        taken = self.experts_flops(d, run, layers) + lm_head
        notes = []
        impl = run.experts_implementation
        table, own = rates.EXPERTS_TFLOPS, self._own_block(d, rates, impl)
        if own is not None:  # this block's shape measured whole: its other matmuls (a shared expert) are inside
            table = {impl: own}
            taken += layers * (self.active_numel(d) - SparseMoeMlp.active_numel(self, d)) * t * (
                2.0 * run.forward_passes + run.backward_flops)
            source = dict(rates.BLOCK_SOURCES)[self._key(d)]
            notes.append(f"the sparse block timed at its own shape's measured rate ({source}, on an {rates.name})")
        elif impl not in table:
            notes.append(f"experts_implementation {impl} not timed: eager's rate used")
            impl = "eager"
        rate, extra = experts_rate(table[impl], run.levers.tiled_mlp)
        if extra:
            notes.append(f"experts rate measured at 1-{table[impl][-1][0]} tiles, held at {run.levers.tiled_mlp}")
        if t != rates.EXPERTS_MEASURED_ROWS:
            notes.append(f"experts rate measured at {rates.EXPERTS_MEASURED_ROWS:,} rows per rank, used at {t:,}")
        call = 6.0 * t * d.top_k * 3 * d.hidden * d.intermediate
        experts_s = layers * experts_calls(run) * call / (rate * 1e12)
        logits = t * vocab
        loss_s = logits * (6.0 * d.hidden / (rates.LOSS_MATMUL_TFLOPS * 1e12) + rates.LOSS_S_PER_LOGIT)
        return taken, {f"experts ({run.experts_implementation})": experts_s, "lm_head and loss": loss_s}, notes

    @staticmethod
    def _key(d: LayerDims) -> tuple[int, int, int, int, int]:
        return (d.experts, d.top_k, d.hidden, d.intermediate, getattr(d, "shared_expert", 0) or 0)

    def _own_block(self, d: LayerDims, rates: Any, impl: str) -> tuple[tuple[int, float], ...] | None:
        """The (tiles, TFLOP/s) points of a block of exactly this shape measured whole on the card, if any."""
        return dict(getattr(rates, "BLOCK_TFLOPS", ())).get(self._key(d), {}).get(impl)

    def all_reduces(self, d: LayerDims, world_size: int, sp_size: int, gpus_per_node: int,
                    grad_accum: int) -> list[AllReduce]:
        """The load-balancing statistics over the SP group (levers/sparse_moe.py), per micro-step: the expert
        counts with the row count (fp32 [E + 1]), the probability sums [E] and their grads in backward; and once
        per step, the logged aux loss over the world (parallel/loss.global_aux_loss)."""
        if world_size == 1:
            return []
        logged = AllReduce("all-reduce: aux loss (logged)", "world", world_size, 8, 1, world_size > gpus_per_node)
        if sp_size == 1:
            return [logged]
        cross, e = sp_size > gpus_per_node, d.experts
        return [logged,
                AllReduce("all-reduce: router counts and rows (SP)", "sp", sp_size, 4 * (e + 1), grad_accum, cross),
                AllReduce("all-reduce: router probability sums and their grads (SP)", "sp", sp_size, 4 * e,
                          2 * grad_accum, cross)]


def _preset(name: str) -> dict[str, Any]:
    hidden, moe_i, inter, layers, heads, kv, experts, top_k, d, tied = _DIMS[name]
    return dict(hidden_size=hidden, moe_intermediate_size=moe_i, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=d, num_experts=experts,
                num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                output_router_logits=True, router_aux_loss_coef=ROUTER_AUX_LOSS_COEF, tie_word_embeddings=tied,
                **common_kwargs(layers))


QWEN3_MOE = Family(model_type="qwen3_moe", config_class="Qwen3MoeConfig", causal_lm_class="Qwen3MoeForCausalLM",
                   mlp=SparseMoeMlp(), qk_norm=True, fused_rope=True, presets={n: _preset(n) for n in _DIMS},
                   modules=f"{__name__}.modules")
