"""What parallelize returns: an HF causal LM under Ulysses SP, called on each rank's shard of every row."""

from __future__ import annotations

import torch
from torch import nn

from ..levers.recompute import LayerRecompute
from ..levers.sparse_moe import RouterStats
from ..parallel.shard_check import check_shard
from ..parallel.sharding import Shard, ShardContext, shard_scope
from ..parallel.state import ParallelState
from ..parallel.ulysses import UlyssesAttention
from ..vocabulary.model_setup import ModelSetup
from .undo import ModelSnapshot


class SequenceParallelCausalLM(nn.Module):
    """An HF causal LM under Ulysses SP. forward(input_ids, labels, context) -> the fp32 sum of this rank's token
    NLLs; `eval_sums` (evaluation's per-bucket sums), `logits` and `final_hidden` are methods of their own.

    Every call takes this rank's shard [b, L/sp] of each row and its `ShardContext` (parallel/sharding.py:
    shard_batch builds both). The caller divides the loss sum by the number of valid tokens in the whole optimizer
    step (all ranks, all micro-steps): `ulysses_trainer.step_token_count` (parallel/loss.py). `unparallelize`
    gives the stock model back.
    """

    _undone = False  # set by unparallelize: the wrapper no longer runs

    def __init__(self, causal_lm: nn.Module, state: ParallelState, attention: UlyssesAttention,
                 checkpointer: LayerRecompute | None, setup: ModelSetup, router_stats: RouterStats | None = None,
                 aux_loss_coef: float = 0.0):
        super().__init__()
        self.causal_lm = causal_lm
        self.state = state
        self.attention = attention
        self.checkpointer = checkpointer
        self.setup = setup  # what parallelize installed (its MLP tiles are fixed from then on: apply checks a setup)
        # a sparse model's load-balancing loss (levers/sparse_moe.py): None without one; after each forward,
        # `aux_loss` holds it (over the whole sequence, the same on every SP rank) for the trainer to add
        # aux_loss_coef times (parallel/loss.aux_for_backward)
        self.router_stats = router_stats
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss: torch.Tensor | None = None
        self.snapshot: ModelSnapshot | None = None  # the model as it was before parallelize (unparallelize)

    @property
    def config(self):
        return self.causal_lm.config

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, context: ShardContext) -> torch.Tensor:
        """The fp32 sum of this rank's token NLLs: `labels` shifted before slicing, as shard_batch gives them
        (`model(**shard.model_inputs())`)."""
        return self.causal_lm.lm_head(self._final_hidden(input_ids, context), labels=labels)

    def eval_sums(self, shard: Shard, buckets: torch.Tensor, num_buckets: int) -> torch.Tensor:
        """Evaluation's [num_buckets, 3] sums on this rank: NLL, argmax hits, tokens, each token in its bucket
        (`buckets`: the labels' shape, values in [0, num_buckets); levers/chunked_loss.chunked_bucket_sums)."""
        hidden = self._final_hidden(shard.input_ids, shard.context)
        return self.causal_lm.lm_head(hidden, labels=shard.labels, buckets=buckets, num_buckets=num_buckets)

    def logits(self, input_ids: torch.Tensor, context: ShardContext | None = None) -> torch.Tensor:
        """This rank's logits [b, L/sp, vocab] in fp32 (large at long lengths: `final_hidden` is 1/vocab x
        hidden of it). `context` None: one document per row (ShardContext.for_rows)."""
        return self.causal_lm.lm_head(self.final_hidden(input_ids, context)).float()

    def final_hidden(self, input_ids: torch.Tensor, context: ShardContext | None = None) -> torch.Tensor:
        """This rank's final hidden states [b, L/sp, hidden] (the final norm applied). `context` None: one document
        per row, this rank's global positions (ShardContext.for_rows), checked by a collective over the SP group."""
        if context is None:
            return self._final_hidden(input_ids, ShardContext.for_rows(input_ids, self.state.sp_rank),
                                      default_positions=True)
        return self._final_hidden(input_ids, context)

    def _final_hidden(self, input_ids: torch.Tensor, context: ShardContext,
                      default_positions: bool = False) -> torch.Tensor:
        """The decoder on this rank's shard: [b, L/sp] -> [b, L/sp, hidden]."""
        if self._undone:
            raise RuntimeError("this model was unparallelized: call the stock model unparallelize returned")
        check_shard(self.state, input_ids, context, default_positions)
        stats = self.router_stats
        if stats is not None:
            stats.begin()  # the router statistics of this forward (its layers leave the scope's pads out)
        with shard_scope(context):  # for the blocks that transformers' layers call with the hidden states alone
            # transformers' layers hand their keyword arguments on to attention: the one way into it
            out = self.causal_lm.model(input_ids=input_ids, position_ids=context.position_ids, use_cache=False,
                                       sp_context=context)
        hidden = out.last_hidden_state
        if stats is not None:
            group = self.state.sp_group if self.state.sp_size > 1 else None
            hidden, self.aux_loss = stats.aux_loss(hidden, group)
        return hidden
