"""Ulysses attention, plugged into transformers' attention registry so HF models run unchanged.

Inside each attention layer: q, k, v arrive for my s/sp tokens and all heads; an all-to-all gives
me all s tokens for h/sp heads; the kernel runs; a second all-to-all brings my tokens back. A sliding-window layer
(Mistral, Qwen2's windowed layers) sees the whole sequence of its heads too, so its window applies exactly as in
one process (attention/kernels.windowed_attention).
sp <= KV heads: KV heads are sharded like query heads. sp > KV heads: each KV head is replicated
sp/kv times first, so rank r still holds the KV head its query heads read (r * kv // sp).
"""

from __future__ import annotations

import torch

from ..attention.kernels import KERNEL_FUNCTIONS, sink_attention, windowed_attention
from ..attention.stash import AttentionStash
from ..vocabulary.layout import check_heads, kv_repeat
from ..vocabulary.names import KEEPING_KERNELS
from .comm import heads_to_seq, seq_to_heads
from .integrations import register_attention
from .sharding import ShardContext
from .state import ParallelState


def _no_mask(*args, **kwargs) -> None:
    # the kernels build causality themselves from cu_seqlens; HF must not build an s/sp x s/sp mask
    return None


class UlyssesAttention:
    """The attention function registered under `self.name` (one per SP setup)."""

    def __init__(self, state: ParallelState, kernel: str, num_heads: int, num_kv_heads: int):
        """`kernel`: a planned kernel name (ModelSetup.attn_implementation), not `auto`."""
        check_heads(state.sp_size, num_heads, num_kv_heads)  # the layout is the state's: the model must split
        if kernel not in KERNEL_FUNCTIONS:
            raise ValueError(f"attention kernel {kernel!r} is not one of {', '.join(KERNEL_FUNCTIONS)}; the plan "
                             f"decides `auto` (ParallelizeConfig.resolve for a loop of your own)")
        self.state = state
        self.kernel = kernel
        self.attend = KERNEL_FUNCTIONS[self.kernel]
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.kv_repeat = kv_repeat(state.sp_size, num_kv_heads)
        # no "flash" in the name (transformers then looks for a hub kernel of that name) and no "sdpa" (it then
        # refuses a model without SDPA support: gpt-oss)
        kernel_tag = self.kernel.replace("flash_attention", "fa").replace("sdpa", "sdp")
        self.name = f"ulysses_sp{state.sp_size}_{kernel_tag}_{id(self):x}"
        self.stash: AttentionStash | None = None  # set by parallelize when attention outputs are kept

    def register(self, model: torch.nn.Module) -> str:
        """Into transformers' attention registry for as long as `model` (whose config will name it) lives."""
        return register_attention(self.name, self, _no_mask, owner=model)

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                 scaling: float | None = None, sliding_window: int | None = None,
                 sp_context: ShardContext | None = None, s_aux: torch.Tensor | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
        # sp_context: the shard's context, which SequenceParallelCausalLM always passes (transformers' layers hand
        # it on as a keyword argument); without it the forward bypassed the wrapper, which at sp > 1 would run the
        # all-to-alls on a whole sequence per rank (at sp=1 a plain forward is the stock one)
        if sp_context is None and self.state.sp_size > 1:
            raise RuntimeError(
                "this model's attention is Ulysses sequence parallelism (parallelize): it runs only through the "
                "SequenceParallelCausalLM parallelize returned, on each rank's L/sp shard of every row; for a plain "
                "forward of the whole sequence, ulysses_trainer.unparallelize(model) gives the stock model back")
        # no context: one rank, the whole sequence is its shard (one document per row, no pads)
        cu_seqlens, max_seqlen, pad_spans = (None, None, ()) if sp_context is None else \
            (sp_context.cu_seqlens, sp_context.max_seqlen, sp_context.pad_spans)
        assert attention_mask is None, "Ulysses attention builds causality from position_ids; pass no mask"
        assert not dropout, "attention dropout is not supported under Ulysses SP; set attention_dropout=0"
        sp_size, group = self.state.sp_size, self.state.sp_group
        # HF layout [b, h, s/sp, d] -> [b, s/sp, h, d]
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        if self.kv_repeat > 1:
            # [b, s/sp, kv, d] -> [b, s/sp, sp, d]: head i copied to i*rep .. i*rep+rep-1
            k = k.repeat_interleave(self.kv_repeat, dim=2)
            v = v.repeat_interleave(self.kv_repeat, dim=2)
        # [b, s/sp, h, d] -> [b, s, h/sp, d]
        q, k, v = (seq_to_heads(t, sp_size, group) for t in (q, k, v))
        if cu_seqlens is not None and cu_seqlens.device != q.device:
            cu_seqlens = cu_seqlens.to(q.device)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        if s_aux is not None:
            # attention sinks (gpt-oss), one per query head: this rank's heads are the r-th h/sp of them
            sinks = s_aux.reshape(sp_size, -1)[self.state.sp_rank if sp_size > 1 else 0]  # [h] -> [h/sp]
            out = sink_attention(q, k, v, sinks, scale=scale, attend=self.attend,
                                 window=None if sliding_window is None else int(sliding_window),
                                 cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, pad_spans=pad_spans)
            return heads_to_seq(out, sp_size, group), None  # [b, s, h/sp, d] -> [b, s/sp, h, d]
        if sliding_window is not None:
            # every rank holds the whole sequence of its heads: the window applies as in one process
            out = windowed_attention(q, k, v, scale=scale, window=int(sliding_window), cu_seqlens=cu_seqlens,
                                     max_seqlen=max_seqlen, pad_spans=pad_spans)
            return heads_to_seq(out, sp_size, group), None  # [b, s, h/sp, d] -> [b, s/sp, h, d]
        keep = {}
        layer = getattr(module, "layer_idx", None)
        if self.stash is not None and self.kernel in KEEPING_KERNELS and self.stash.wants(layer, module.training):
            keep = {"stash": self.stash, "layer": layer}  # the recompute reuses the kernel's outputs
        # pads (ShardContext.pad_spans): segments of their own that the kernel leaves out (parallel/sharding.py)
        out = self.attend(q, k, v, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, pad_spans=pad_spans,
                          **keep)
        # [b, s, h/sp, d] -> [b, s/sp, h, d]: what HF attention functions return
        return heads_to_seq(out, sp_size, group), None
