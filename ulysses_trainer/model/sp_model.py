"""What parallelize returns: an HF causal LM under Ulysses SP, called on each rank's shard of every row."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..levers.recompute import LayerRecompute
from ..levers.sparse_moe import RouterStats
from ..levers.tiled_mlp import TiledMLP
from ..parallel.shard_check import check_shard
from ..parallel.state import ParallelState
from ..parallel.ulysses import UlyssesAttention
from .undo import ModelSnapshot


class SequenceParallelCausalLM(nn.Module):
    """An HF causal LM under Ulysses SP. forward(shard inputs, labels) -> fp32 sum of token NLLs on this rank;
    forward(shard inputs) without labels -> a CausalLMOutputWithPast of this rank's tokens (HF's shape).

    The caller divides the loss sum by the number of valid tokens in the whole optimizer step (all ranks, all
    micro-steps): `ulysses_trainer.step_token_count` (parallel/loss.py). `unparallelize` gives the stock model back.
    """

    _undone = False  # set by unparallelize: the wrapper no longer runs

    def __init__(self, causal_lm: nn.Module, state: ParallelState, attention: UlyssesAttention,
                 checkpointer: LayerRecompute | None, tiles: int = 1, router_stats: RouterStats | None = None,
                 aux_loss_coef: float = 0.0):
        super().__init__()
        self.causal_lm = causal_lm
        self.state = state
        self.attention = attention
        self.checkpointer = checkpointer
        self.tiles = tiles
        # a sparse model's load-balancing loss (levers/sparse_moe.py): None without one; after each forward,
        # `aux_loss` holds it (over the whole sequence, the same on every SP rank) for the trainer to add
        # aux_loss_coef times (parallel/loss.aux_for_backward)
        self.router_stats = router_stats
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss: torch.Tensor | None = None
        self._tiled = [m for m in causal_lm.modules() if isinstance(m, TiledMLP)]  # they leave pads out
        self.snapshot: ModelSnapshot | None = None  # the model as it was before parallelize (unparallelize)

    @property
    def config(self):
        return self.causal_lm.config

    def mark_pads(self, shape: tuple[int, ...], real_rows: int | tuple[int, ...] | None) -> None:
        """Tell the tiled MLPs which rows of the next batch [b, s] are pads (left out of their tiles): kept until
        the next batch, for the checkpoint's recompute and the backward."""
        b, s = shape
        rows = tuple(real_rows) if isinstance(real_rows, (tuple, list)) else (real_rows,) * b
        spans = None
        if real_rows is not None and min(rows) < s:
            spans = tuple((i * s, i * s + n) for i, n in enumerate(rows) if n > 0)  # over [b*s] rows
        for m in self._tiled:
            m.real_spans = (b * s, spans)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None, real_rows: int | tuple[int, ...] | None = None,
                seq_len: int | None = None, logits: bool = True, buckets: torch.Tensor | None = None,
                num_buckets: int = 0, pad_spans: tuple[tuple[int, int], ...] = ()
                ) -> torch.Tensor | CausalLMOutputWithPast:
        """This rank's shard [b, L/sp] of each row. With `labels` (shifted before slicing, as shard_batch gives
        them): the fp32 sum of this rank's token NLLs. Without: HF's CausalLMOutputWithPast of this rank's tokens,
        `logits` [b, L/sp, vocab] (fp32 as HF gives them), or with logits=False `hidden_states` = (the final
        hidden states [b, L/sp, hidden],) and no logits. `position_ids`: default each row one document, this
        rank's global positions (sp_rank * L/sp + 0 .. L/sp-1). `seq_len`: the padded row length L
        (Shard.model_inputs gives it); checked against L/sp x sp here, or, left out, by a small collective over
        the SP group (shard_check.check_shard). `real_rows`: leading positions of each row that are not pads,
        one count for all rows or one per row (parallel/sharding.Shard); the router statistics leave pads out. With
        `buckets` (labels' shape, each token's bucket in [0, num_buckets)) it returns evaluation's [num_buckets, 3]
        sums on this rank instead: NLL, argmax hits, tokens (levers/chunked_loss.chunked_bucket_sums). `pad_spans`:
        the pads over the flattened full batch, which attention leaves out (parallel/sharding.Shard.pad_spans)."""
        if self._undone:
            raise RuntimeError("this model was unparallelized: call the stock model unparallelize returned")
        default = position_ids is None
        if default:  # one document per row: this shard's global positions
            b, s = input_ids.shape
            start = self.state.sp_rank * s
            position_ids = torch.arange(start, start + s, device=input_ids.device).expand(b, s)
        check_shard(self.state, input_ids, position_ids, cu_seqlens, seq_len, default)
        self.mark_pads(input_ids.shape, real_rows)
        stats = self.router_stats
        if stats is not None:
            b, s = input_ids.shape
            mask = None
            rows = tuple(real_rows) if isinstance(real_rows, (tuple, list)) else (real_rows,) * b
            if real_rows is not None and min(rows) < s:  # decided on the host: no device sync for rows without pads
                counts = torch.tensor(rows, device=input_ids.device)[:, None]
                mask = (torch.arange(s, device=input_ids.device)[None, :] < counts).float().reshape(-1)  # [b*s]
            stats.begin(mask)
        out = self.causal_lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                   sp_cu_seqlens=cu_seqlens, sp_max_seqlen=max_seqlen, sp_pad_spans=pad_spans)
        hidden = out.last_hidden_state
        if stats is not None:
            group = self.state.sp_group if self.state.sp_size > 1 else None
            hidden, self.aux_loss = stats.aux_loss(hidden, group)
        if buckets is not None:
            return self.causal_lm.lm_head(hidden, labels=labels, buckets=buckets, num_buckets=num_buckets)
        if labels is not None:
            return self.causal_lm.lm_head(hidden, labels=labels)
        if not logits:
            return CausalLMOutputWithPast(hidden_states=(hidden,))
        return CausalLMOutputWithPast(logits=self.causal_lm.lm_head(hidden).float())
