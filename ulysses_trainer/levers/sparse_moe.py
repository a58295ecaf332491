"""The sparse MoE block by sequence tiles, and the router's load-balancing statistics, exact under SP.

`SparseMoE` replaces transformers' Qwen3MoeSparseMoeBlock (it adopts the block's `gate` router and fused
`experts` under the same names, so state_dict keys are unchanged). The router runs on all local rows at
once (its [rows, E] logits are small); the experts run tile by tile along the rows: forward under no_grad
keeping the input, the routing weights and the chosen experts; backward recomputes and backpropagates one
tile at a time, so the experts' [top_k x rows, I] intermediates exist for one tile only. Routing is per
token, so each row meets the same experts in the same order as untiled and the results match.

Load balancing (transformers' load_balancing_loss_func, as TRL trains Qwen3-MoE): over all layers and all
rows of the sequence, f_e = (top-k assignments to expert e) / rows and P_e = (sum of router probabilities
of e) / rows; aux = E x sum_e f_e P_e. Both are means over the WHOLE sequence, so under SP each rank's
sums are added over the SP group before the product (a per-rank aux loss is a different, wrong loss).
f is not differentiated (top-k counts); P is. A checkpointed layer's forward runs without a graph and is
recomputed during backward, after the loss exists, so the P sums cannot carry their graph into the loss.
Instead `RouterStats` collects the sums' values during the forward; `RouterStats.aux_loss` adds them
over the SP group (a differentiable all-reduce) and ties them to the last hidden state, so its backward
runs before any layer's; it leaves dJ/dP (one [E] vector, the same for every layer's P sum) for the
layers, whose (re)computed forward attaches it to the P sum it computes (`_GradOfSum`). That is the
gradient autograd would give through the all-reduce, computed where the graph exists.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from ..parallel.comm import all_reduce_sum_differentiable
from ..parallel.sharding import mlp_output_unused, shard_in_scope
from .tiled_mlp import TiledBlock


class RouterStats:
    """One model's router statistics for one forward: per-expert assignment counts and probability sums,
    summed over layers, and the gradient the loss sends back to the probability sums.

    Wiring (model/parallelize.py): every SparseMoE shares one RouterStats; the model's forward calls
    begin() before the decoder and aux_loss(...) after it. Which rows are pads the layers read from the shard in
    scope (parallel/sharding.shard_scope), as the tiled MLP does.
    """

    def __init__(self, num_experts: int, top_k: int):
        self.num_experts, self.top_k = num_experts, top_k
        self.recording = False
        self.counts: Tensor | None = None  # [E] top-k assignments, all layers
        self.prob_sums: Tensor | None = None  # [E] router probabilities, all layers (values)
        self.rows: Tensor | None = None  # real rows, all layers
        self.grad_prob_sums: Tensor | None = None  # dJ/d(prob_sums), set by the aux loss's backward

    def begin(self) -> None:
        """Start a forward: record what the layers route (their recomputes, later, do not record)."""
        self.recording = True
        self.counts = self.prob_sums = self.grad_prob_sums = self.rows = None

    def record(self, counts: Tensor, prob_sums: Tensor, rows: Tensor) -> None:
        """Add one layer's [E] counts and probability sums and its real rows (a 0-d tensor: no host sync)."""
        if not self.recording:
            return
        add = lambda a, b: b if a is None else a + b  # noqa: E731
        self.counts, self.prob_sums, self.rows = add(self.counts, counts), add(self.prob_sums, prob_sums), \
            add(self.rows, rows)

    def aux_loss(self, hidden: Tensor, group) -> tuple[Tensor, Tensor]:
        """(hidden, aux): the load-balancing loss over the whole sequence (sums over the SP `group`) and the last
        hidden state passed through, tied to it so that aux's backward runs before the layers'. A collective
        (unless `group` is None: one rank holds the whole sequence): every rank of the group calls it once per
        forward, whatever its rows."""
        self.recording = False
        assert self.counts is not None and self.prob_sums is not None and self.rows is not None, \
            "no SparseMoE layer ran in this forward"
        stats = torch.cat([self.counts.float(), self.rows.reshape(1).float()])  # [E + 1]
        def over_sequence(t: Tensor) -> Tensor:
            return t if group is None else all_reduce_sum_differentiable(t, group)

        stats = over_sequence(stats).detach()  # counts are not differentiated
        hidden, local_p = _Tie.apply(hidden, self.prob_sums.detach(), self)
        p = over_sequence(local_p)  # [E] sums over the sequence, differentiable
        rows = stats[-1].clamp(min=1.0)
        aux = self.num_experts * torch.sum((stats[:-1] / rows) * (p / rows))
        return hidden, aux


class _Tie(torch.autograd.Function):
    """Passes the last hidden state through and turns the recorded probability sums into a graph input; its
    backward (after the aux loss's and the loss head's) stores dJ/d(prob sums) for the layers."""

    @staticmethod
    def forward(ctx, hidden: Tensor, prob_sums: Tensor, stats: RouterStats):
        ctx.stats = stats
        return hidden.view_as(hidden), prob_sums.clone()

    @staticmethod
    def backward(ctx, grad_hidden: Tensor, grad_p: Tensor | None):
        ctx.stats.grad_prob_sums = None if grad_p is None else grad_p.detach()
        return grad_hidden, None, None


class _GradOfSum(torch.autograd.Function):
    """Identity on the block's output; its backward sends RouterStats.grad_prob_sums into the layer's
    probability sum (the layer's share of dJ/dP, which is the same vector for every layer)."""

    @staticmethod
    def forward(ctx, out: Tensor, prob_sum: Tensor, stats: RouterStats) -> Tensor:
        ctx.stats = stats
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        g = ctx.stats.grad_prob_sums
        return grad_out, g, None


def route(gate: nn.Module, x2d: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(logits [N, E], routing weights [N, k], chosen experts [N, k]) of transformers' router: a router module
    returning the three (transformers 5.x Qwen3MoeTopKRouter), or a plain Linear (softmax, top-k here)."""
    out = gate(x2d)
    if isinstance(out, tuple):
        logits, weights, idx = out
        if weights.shape[-1] != idx.shape[-1]:  # a router returning the scores of all experts [N, E]
            weights = weights.gather(-1, idx)  # [N, k]
        return logits, weights, idx
    probs = torch.softmax(out, dim=-1, dtype=torch.float)  # [N, E]
    weights, idx = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return out, weights.to(out.dtype), idx


class _TiledExperts(torch.autograd.Function):
    """Saves x, the routing weights and the chosen experts; backward recomputes one tile at a time."""

    @staticmethod
    def forward(ctx, x2d: Tensor, weights: Tensor, idx: Tensor, moe: SparseMoE) -> Tensor:
        ctx.moe = moe
        ctx.save_for_backward(x2d, weights, idx)
        if mlp_output_unused():  # a checkpoint's recompute: backward recomputes the tiles anyway
            return torch.zeros_like(x2d)  # [N, H]
        out = torch.empty_like(x2d)  # [N, H]
        # Collective invariant: every rank runs exactly num_tiles tiles, empty ones included (tensor_split
        # always returns num_tiles pieces). Under ZeRO-3 each experts call all-gathers the experts' weights:
        # a rank that skipped a tile would leave the others waiting in that all-gather forever. The experts
        # module runs whatever the routing (fused weights: no expert is a module of its own), so experts that
        # get no token on this rank change nothing that ZeRO-3 sees.
        s = 0
        for xt, wt, it in zip(*(torch.tensor_split(t, moe.num_tiles) for t in (x2d, weights, idx))):
            out[s:s + xt.shape[0]] = moe.experts(xt, it, wt)  # [rows_i, H]
            s += xt.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x2d, weights, idx = ctx.saved_tensors
        moe: SparseMoE = ctx.moe
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.zeros_like(x2d) if need_x else None
        grad_w = torch.zeros_like(weights) if need_w else None
        params = [p for p in moe.experts.parameters() if p.requires_grad]
        n, s = moe.num_tiles, 0
        try:
            # Same collective invariant as forward: num_tiles recomputes on every rank, empty or not.
            for i, (xp, wp, it) in enumerate(zip(*(torch.tensor_split(t, n) for t in (x2d, weights, idx)))):
                e = s + xp.shape[0]
                _set_grad_ready(params, i == n - 1)  # ZeRO reduces the experts' grads after the last tile only
                xt = xp.detach().requires_grad_(need_x)
                wt = wp.detach().requires_grad_(need_w)
                with torch.enable_grad():
                    y = moe.experts(xt, it, wt)  # [rows_i, H]
                if y.requires_grad:
                    torch.autograd.backward(y, grad_out[s:e])
                if grad_x is not None and xt.grad is not None:  # an empty tile may have no grad
                    grad_x[s:e] = xt.grad
                if grad_w is not None and wt.grad is not None:
                    grad_w[s:e] = wt.grad
                del y, xt, wt
                s = e
        finally:
            _set_grad_ready(params, True)
        return grad_x, grad_w, None, None


def _set_grad_ready(params: list[nn.Parameter], ready: bool) -> None:
    # DeepSpeed ZeRO reads this attribute in its gradient hook (see levers/tiled_mlp.py).
    for p in params:
        p.ds_grad_is_ready = ready


class SparseMoE(TiledBlock, nn.Module):
    """Drop-in for transformers' Qwen3MoeSparseMoeBlock: the router on all rows, the experts by `num_tiles`
    sequence tiles (1: one call, no recompute of its own), the router statistics into `stats`.

    Inside a recompute that skips the MLP (TiledBlock), the experts' forward returns zeros with the same backward (a
    checkpoint's recompute needs their graph, not their value). The router still runs: its weights and
    probability sums carry gradients."""

    def __init__(self, block: nn.Module, num_tiles: int, stats: RouterStats | None, top_k: int,
                 norm_topk_prob: bool):
        super().__init__()
        experts = getattr(block, "experts", None)
        # the router under the block's own name (gpt-oss: router; the others: gate), so state-dict keys stay
        self.router_name = "router" if hasattr(block, "router") and not hasattr(block, "gate") else "gate"
        if not (hasattr(block, self.router_name) and isinstance(getattr(experts, "gate_up_proj", None),
                                                                torch.Tensor)):
            raise ConfigError(f"the sparse MLP needs transformers' fused experts (experts.gate_up_proj [E, 2I, H], "
                              f"transformers >= 5); {type(block).__name__} has none: upgrade transformers")
        if isinstance(num_tiles, bool) or not isinstance(num_tiles, int) or num_tiles < 1:
            raise ConfigError(f"tiled_mlp tiles must be an int >= 1, got {num_tiles!r}")
        setattr(self, self.router_name, getattr(block, self.router_name))
        self.experts = experts
        # Qwen3.5-MoE's always-on shared expert (an MLP on every row) and its sigmoid gate: None without one
        self.shared_expert = getattr(block, "shared_expert", None)
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)
        self.num_tiles = num_tiles
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.stats = stats

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])  # [b, s, H] -> [N, H]: routing is per row
        shared = None if self.shared_expert is None else self.shared_expert(x2d)  # [N, H]
        router = getattr(self, self.router_name)
        logits, weights, idx = route(router, x2d, self.top_k, self.norm_topk_prob)  # [N, E], [N, k], [N, k]
        if self.num_tiles == 1 and not mlp_output_unused():
            out = self.experts(x2d, idx, weights)  # [N, H]
        else:
            if torch.is_grad_enabled() and not x2d.requires_grad and any(p.requires_grad for p in self.parameters()):
                x2d = x2d.detach().requires_grad_(True)  # the Function's backward makes the weight grads
            out = _TiledExperts.apply(x2d, weights, idx, self)
        if shared is not None:  # transformers' order: routed experts + sigmoid(gate(x)) * shared expert
            out = out + torch.sigmoid(self.shared_expert_gate(x2d)) * shared
        if self.stats is not None:
            out = self._statistics(out, logits, idx)
        return out.view(shape)  # [N, H] -> [b, s, H]

    def _statistics(self, out: Tensor, logits: Tensor, idx: Tensor) -> Tensor:
        st, shard = self.stats, shard_in_scope()
        mask = None if shard is None else shard.row_mask()  # [N] 1.0 real, 0.0 pad: pads route nothing
        if mask is not None and mask.shape[0] != logits.shape[0]:
            raise ValueError(f"row mask of {mask.shape[0]} rows for a layer of {logits.shape[0]}")
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [N, E]
        prob_sum = (probs if mask is None else probs * mask[:, None]).sum(dim=0)  # [E]
        with torch.no_grad():
            ones = torch.ones(idx.shape, dtype=torch.float, device=idx.device) if mask is None \
                else mask[:, None].expand(idx.shape).float()  # [N, k]
            counts = torch.zeros(st.num_experts, dtype=torch.float, device=idx.device)
            counts.scatter_add_(0, idx.reshape(-1), ones.reshape(-1))  # [E]
            rows = ones[:, 0].sum()  # real rows, a 0-d tensor
        st.record(counts, prob_sum.detach(), rows)
        if prob_sum.requires_grad:  # the (re)computed forward with a graph: where dJ/dP reaches the router
            out = _GradOfSum.apply(out, prob_sum, st)
        return out
