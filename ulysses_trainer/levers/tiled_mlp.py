"""Sequence-tiled gated MLP: down(act(gate(x)) * up(x)) one tile of rows at a time.

Untiled, a gated MLP holds four [rows, intermediate] tensors (gate, up, act, product), 3.8x as
wide as the hidden size for Qwen3 and four of them: at long sequence lengths they dominate a
layer's memory. Tiled, forward runs the tiles under no_grad and keeps only x; backward recomputes
one tile at a time and backpropagates through it, so those tensors exist for one tile at a time.
Each row is computed by the same ops as untiled, so results match the untiled MLP. Rows that are pads (the shard
in scope: parallel/sharding.ShardContext.real_spans) are left out of the tiles: their output is 0 and they get no
gradient (nothing downstream of a pad is trained or read by a real token).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from ..parallel.sharding import Spans, mlp_output_unused, shard_in_scope

# `spans`: the (start, end) row ranges of [N, H] that are not pads (sharding.Spans); None: every row


def _take(t: Tensor, spans: Spans | None) -> Tensor:
    """The rows of t in spans: [N, H] -> [n_real, H] (a view for one span, a copy for several)."""
    if spans is None:
        return t
    if len(spans) == 1:
        return t[spans[0][0]:spans[0][1]]
    return torch.cat([t[a:e] for a, e in spans]) if spans else t[:0]


def _put(dst: Tensor, src: Tensor, spans: Spans | None) -> None:
    """dst[spans] = src, the inverse of _take (dst [N, H], src [n_real, H])."""
    s = 0
    for a, e in spans or ():
        dst[a:e] = src[s:s + e - a]
        s += e - a


def _real_rows_of(dst: Tensor, spans: Spans | None) -> tuple[Tensor, bool]:
    """Where the real rows' results go: a view of dst (None or one span), else a new tensor put back after."""
    if spans is None or len(spans) <= 1:
        return _take(dst, spans), False
    return dst.new_empty((sum(e - a for a, e in spans), *dst.shape[1:])), True


def _set_grad_ready(params: list[nn.Parameter], ready: bool) -> None:
    # DeepSpeed ZeRO reads this attribute in its gradient hook: while False it leaves the partial
    # gradient on param.grad (to accumulate over tiles) instead of reducing it. Harmless elsewhere.
    for p in params:
        p.ds_grad_is_ready = ready


class _TiledMLPFunction(torch.autograd.Function):
    """Saves only x; backward recomputes and backpropagates one tile at a time."""

    @staticmethod
    def forward(ctx, x2d: Tensor, mlp: TiledMLP, spans: Spans | None = None) -> Tensor:
        ctx.mlp, ctx.spans = mlp, spans
        ctx.save_for_backward(x2d)
        if mlp_output_unused():  # a checkpoint's recompute: backward recomputes the tiles anyway
            return x2d.new_zeros((x2d.shape[0], mlp.down_proj.out_features))  # [N, H]
        if spans is not None:  # pads: output 0, the tiles run over the real rows only
            full = x2d.new_zeros((x2d.shape[0], mlp.down_proj.out_features))  # [N, H]
            into, copied = _real_rows_of(full, spans)
            _TiledMLPFunction._tiles(_take(x2d, spans), mlp, into)
            if copied:
                _put(full, into, spans)
            return full
        return _TiledMLPFunction._tiles(x2d, mlp, None)

    @staticmethod
    def _tiles(x2d: Tensor, mlp: TiledMLP, out: Tensor | None) -> Tensor:
        s = 0
        # Collective invariant: every rank runs exactly num_tiles tiles, empty ones included
        # (tensor_split always returns num_tiles pieces; torch.chunk may return fewer). Under ZeRO-3
        # each child forward all-gathers its parameters, so a rank that skipped a tile would leave
        # the other ranks waiting in that all-gather forever.
        for x_tile in torch.tensor_split(x2d, mlp.num_tiles):  # num_tiles x [rows_i, H]
            y = mlp.tile_forward(x_tile)  # grad mode is off inside an autograd.Function forward
            if out is None:
                out = y.new_empty((x2d.shape[0], y.shape[-1]))  # [N, H]
            out[s:s + y.shape[0]] = y
            s += y.shape[0]
            del y
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (x_all,) = ctx.saved_tensors
        mlp: TiledMLP = ctx.mlp
        spans = ctx.spans
        x_needs_grad = ctx.needs_input_grad[0]
        grad_all = torch.zeros_like(x_all) if x_needs_grad else None  # the pads' grad stays 0
        x2d = _take(x_all, spans)  # [N, H] -> [n_real, H]
        grad_out = _take(grad_out.reshape(x_all.shape[0], -1), spans)  # [N, H] -> [n_real, H]
        grad_x, copied = _real_rows_of(grad_all, spans) if grad_all is not None else (None, False)
        if copied:
            grad_x.zero_()
        params = [p for p in mlp.parameters() if p.requires_grad]
        n = mlp.num_tiles
        try:
            # Same collective invariant as forward: num_tiles recomputes on every rank, empty or not.
            s = 0
            for i, x_piece in enumerate(torch.tensor_split(x2d, n)):  # n x [rows_i, H]
                e = s + x_piece.shape[0]
                # Report the parameters' gradients ready to ZeRO only once the last tile has added to them.
                _set_grad_ready(params, i == n - 1)
                x_tile = x_piece.detach().requires_grad_(x_needs_grad)
                with torch.enable_grad():
                    y = mlp.tile_forward(x_tile)
                torch.autograd.backward(y, grad_out[s:e])
                if grad_x is not None and x_tile.grad is not None:  # an empty tile may have no grad
                    grad_x[s:e] = x_tile.grad
                del y, x_tile
                s = e
        finally:
            _set_grad_ready(params, True)
        if copied:
            _put(grad_all, grad_x, spans)
        return grad_all, None, None


class TiledBlock:
    """What a tiled MLP block (TiledMLP, levers/sparse_moe.SparseMoE) has beside its forward: `num_tiles`. Inside
    a checkpoint's recompute that says so (parallel/sharding.mlp_output_unused), its forward skips the tiles and
    returns zeros with the same backward: the recompute needs the graph, not the value, which feeds only the
    residual add, whose backward does not read it; the block's backward recomputes each tile from the saved
    input anyway. That saves one MLP forward per layer and step."""

    num_tiles: int

    def extra_repr(self) -> str:
        return f"num_tiles={self.num_tiles}"


class TiledMLP(TiledBlock, nn.Module):
    """Drop-in for an HF gated MLP (Qwen3MLP, LlamaMLP) that tiles along the rows.

    It adopts the MLP's gate_proj, up_proj, down_proj and act_fn as its own children under the same
    names, so `layer.mlp = TiledMLP(layer.mlp, n)` leaves state_dict keys unchanged.
    """

    # the MLP's children (and activation) it adopts under the same names; a subclass for another gated MLP layout
    # names its own and defines tile_forward (families/phi3/modules.TiledFusedMLP: gate_up_proj)
    PARTS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj", "act_fn")

    def __init__(self, mlp: nn.Module, num_tiles: int):
        super().__init__()
        missing = [a for a in self.PARTS if not hasattr(mlp, a)]
        if missing:
            raise ConfigError(f"tiled_mlp needs a gated MLP with {', '.join(self.PARTS)}; "
                              f"{type(mlp).__name__} lacks {missing}. Set tiled_mlp: false for this model")
        if isinstance(num_tiles, bool) or not isinstance(num_tiles, int) or num_tiles < 1:
            raise ConfigError(f"tiled_mlp tiles must be an int >= 1, got {num_tiles!r}; "
                              "use tiled_mlp: true, false, auto or a positive int")
        for name in self.PARTS:
            setattr(self, name, getattr(mlp, name))
        self.num_tiles = num_tiles

    def tile_forward(self, x: Tensor) -> Tensor:
        """The untiled gated MLP on some rows."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])  # [b, s, H] -> [b*s, H]: an MLP is row-wise, tiles may span rows of b
        weights_need_grad = any(p.requires_grad for p in self.parameters())
        if torch.is_grad_enabled() and not x2d.requires_grad and weights_need_grad:
            # The Function's backward is what produces the weight gradients; it runs only if the
            # output requires grad, so give x a (discarded) gradient when only the weights need one.
            x2d = x2d.detach().requires_grad_(True)
        # transformers' layer calls its MLP with the hidden states alone: the pads come from the shard in scope,
        # which the model's call and the layer recompute enter (none, or another shape: every row runs)
        shard = shard_in_scope()
        out = _TiledMLPFunction.apply(x2d, self, shard.real_spans(x2d.shape[0]) if shard is not None else None)
        return out.view(*shape[:-1], out.shape[-1])  # [b*s, H] -> [b, s, H]
