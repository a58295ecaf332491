"""Batch -> this rank's shard: shift labels on the full sequence, pad to a multiple of sp, slice; and the shard's
context, what the model's layers read about it.

One packed batch travels as one `Shard`: its tokens (`input_ids`), its targets (`labels`) and its `ShardContext`
(positions, document boundaries, pads, this rank's slice), built once here by `shard_batch`. The model's calls take
the context explicitly (SequenceParallelCausalLM.forward / eval_sums / logits); its attention gets it through
transformers' layer keyword arguments as `sp_context`, and the blocks that transformers' layer calls with the hidden
states alone (the tiled MLP, the sparse block's router statistics, the row RoPE) read it from `shard_scope`, which
the model enters around its decoder and the layer recompute re-enters. Pure tensor code (no process group), so it
is tested without ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ..vocabulary.layout import padded_length

IGNORE_INDEX = -100  # a label that is not trained on (torch cross_entropy's default ignore_index)
# a row's pads are cut into segments of at most this many tokens in cu_seqlens: a varlen kernel (one call over
# every segment) then spends one tile per segment on them, not the last document's length times theirs; the
# per-document paths skip them (ShardContext.pad_spans)
PAD_SEGMENT = 128

Spans = tuple[tuple[int, int], ...]  # (start, end) pairs of row indices


@dataclass(frozen=True)
class ShardContext:
    """What the layers read about one SP rank's shard [b, L_pad/sp] of a batch [b, L_pad]: built once per batch
    (shard_batch, or `for_rows` for a shard of one document per row), then only read."""

    position_ids: torch.Tensor  # [b, L_pad/sp] global positions (restart at each packed document)
    # int32 segment starts over the flattened full [b * L_pad] batch, + end; None: one document per row, no pads
    cu_seqlens: torch.Tensor | None
    max_seqlen: int | None  # the longest segment of cu_seqlens
    packed: bool  # more than one document in some row: kernels need the varlen / per-document path
    # each row's leading tokens in this rank's slice that are not pads, one count per row
    real_rows: tuple[int, ...]
    # (start, end) over the flattened [b * L_pad] batch of each row's pads (after its real tokens): segments of
    # their own in cu_seqlens, attended by no real token; attention leaves them out (their output is 0)
    pad_spans: Spans = ()
    seq_len: int | None = None  # the padded row length L_pad (None: unknown, the model checks it by a collective)
    start: int = 0  # this rank's slice of every row: tokens [start, start + L_pad/sp) of the padded row

    @classmethod
    def for_rows(cls, input_ids: torch.Tensor, sp_rank: int, position_ids: torch.Tensor | None = None
                 ) -> ShardContext:
        """A shard [b, s] of rows of one document each, no pads, the row length unknown: position_ids default to
        this rank's global positions sp_rank * s .. sp_rank * s + s - 1."""
        b, s = input_ids.shape
        start = sp_rank * s
        if position_ids is None:
            position_ids = torch.arange(start, start + s, device=input_ids.device).expand(b, s)
        return cls(position_ids, None, None, False, (s,) * b, start=start)

    @property
    def has_pads(self) -> bool:
        """Some row of this rank's slice holds pads (decided on the host: no device sync)."""
        return min(self.real_rows) < self.position_ids.shape[1]

    def real_spans(self, rows: int) -> Spans | None:
        """The real rows of the flattened shard [b * s] as (start, end) spans, for a block that takes them
        ([rows, hidden] with rows = b * s); None: every row is real (or `rows` is not this shard's)."""
        b, s = self.position_ids.shape
        if rows != b * s or not self.has_pads:
            return None
        return tuple((i * s, i * s + n) for i, n in enumerate(self.real_rows) if n > 0)

    def row_mask(self) -> torch.Tensor | None:
        """[b * s] 1.0 for this shard's real tokens, 0.0 for pads; None without pads."""
        if not self.has_pads:
            return None
        s, device = self.position_ids.shape[1], self.position_ids.device
        counts = torch.tensor(self.real_rows, device=device)[:, None]
        return (torch.arange(s, device=device)[None, :] < counts).float().reshape(-1)  # [b, s] -> [b*s]

    def to(self, device) -> ShardContext:
        return ShardContext(self.position_ids.to(device), None if self.cu_seqlens is None else
                            self.cu_seqlens.to(device), self.max_seqlen, self.packed, self.real_rows, self.pad_spans,
                            self.seq_len, self.start)


@dataclass(frozen=True)
class _Scope:
    """What the blocks that transformers' layers call with the hidden states alone (the tiled MLP, the sparse
    block) read of the call they run in: the shard, and whether it is a checkpoint's recompute whose MLP output
    is never read (its value feeds only the residual add; the block's backward recomputes its tiles anyway)."""

    shard: ShardContext | None = None
    mlp_output_unused: bool = False


# the one channel past transformers' layers: set by SequenceParallelCausalLM around its decoder and by the layer
# recompute (levers/recompute.py) around each layer it runs again; per thread (a ContextVar)
_IN_SCOPE: ContextVar[_Scope | None] = ContextVar("ulysses_trainer_shard", default=None)


@contextlib.contextmanager
def shard_scope(context: ShardContext | None, mlp_output_unused: bool = False) -> Iterator[None]:
    """Inside, `shard_in_scope()` is `context` and `mlp_output_unused()` the flag: SequenceParallelCausalLM enters
    it around its decoder; the layer recompute re-enters the shard its forward ran under, the flag set where the
    family lets the recompute skip a tiled MLP's forward (rebuilds, whose outputs are used, leave it off)."""
    token = _IN_SCOPE.set(_Scope(context, mlp_output_unused))
    try:
        yield
    finally:
        _IN_SCOPE.reset(token)


def shard_in_scope() -> ShardContext | None:
    """The context of the shard whose layers run now (None outside the model's calls)."""
    scope = _IN_SCOPE.get()
    return None if scope is None else scope.shard


def mlp_output_unused() -> bool:
    """Whether this is a checkpoint's recompute that needs a tiled MLP's graph, not its value (shard_scope)."""
    scope = _IN_SCOPE.get()
    return scope is not None and scope.mlp_output_unused


@dataclass
class Shard:
    """One SP rank's slice of a batch: tokens and targets [b, L_pad/sp], and what the layers read about it."""

    input_ids: torch.Tensor
    labels: torch.Tensor  # already shifted: labels[t] is the target of input_ids[t]
    context: ShardContext

    @property
    def num_valid(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def model_inputs(self) -> dict:
        """Keyword arguments for SequenceParallelCausalLM.forward (and a DeepSpeed engine holding it)."""
        return {"input_ids": self.input_ids, "labels": self.labels, "context": self.context}

    def to(self, device) -> Shard:
        return Shard(self.input_ids.to(device), self.labels.to(device), self.context.to(device))


def shift_labels(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """labels[t] <- labels[t+1] over the FULL sequence (shifting after sharding would lose a token at
    every shard boundary); no target across a packed-document boundary or past the end."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    shifted[:, :-1][position_ids[:, 1:] == 0] = IGNORE_INDEX  # next token starts a new document
    return shifted


def document_layout(position_ids: torch.Tensor, real_lengths: Sequence[int] | None = None
                    ) -> tuple[torch.Tensor, int, bool, tuple[tuple[int, int], ...]]:
    """cu_seqlens (int32, over the flattened [b*L] batch), the longest segment, whether some row holds more than
    one document, and the pads' spans. real_lengths: each row's tokens before its pads (default: none are pads);
    a row's pads are segments of their own, at most PAD_SEGMENT tokens each, whatever their positions say."""
    b, length = position_ids.shape
    real = [length] * b if real_lengths is None else [int(n) for n in real_lengths]
    starts = position_ids == 0
    starts[:, 0] = True  # every row starts a document, whatever its first position
    packed = bool((starts.sum(1) > 1).any()) if real_lengths is None else \
        any(int(starts[i, :n].sum()) > 1 for i, n in enumerate(real))
    pads = []
    for i, n in enumerate(real):
        if n < length:
            starts[i, n:] = False
            starts[i, n::PAD_SEGMENT] = True  # [n, length) in segments of PAD_SEGMENT tokens
            pads.append((i * length + n, (i + 1) * length))
    flat = torch.nonzero(starts.reshape(-1), as_tuple=False).flatten()  # [n_segments]
    cu = torch.cat([flat, flat.new_tensor([b * length])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return cu, max_len, packed, tuple(pads)


def shard_batch(input_ids: torch.Tensor, *, sp_size: int, sp_rank: int,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                pad_to_multiple_of: int | None = None, pad_token_id: int = 0,
                real_lengths: Sequence[int] | None = None) -> Shard:
    """Shift, pad and slice a batch [b, L] for SP rank `sp_rank` of `sp_size`.

    position_ids restart at 0 at each packed document; default: 0..L-1 per row. labels default to
    input_ids (causal LM); IGNORE_INDEX (-100) entries are not trained on. real_lengths: each row's tokens
    before its own padding (a conversation shorter than the row), default L; the router statistics leave
    every pad out (ShardContext.real_rows).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)  # [L] -> [1, L]
    b, length = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(b, length)
    position_ids = position_ids.reshape(b, length)
    labels = input_ids if labels is None else labels.reshape(b, length)
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} is outside [0, {sp_size})")
    shifted = shift_labels(labels, position_ids)

    total = padded_length(length, sp_size, pad_to_multiple_of)
    n_pad = total - length
    if n_pad:
        # pads continue the last document's positions: causal attention keeps real tokens blind to them
        last = position_ids[:, -1:]
        pad_pos = last + torch.arange(1, n_pad + 1, device=last.device)
        input_ids = torch.cat([input_ids, input_ids.new_full((b, n_pad), pad_token_id)], dim=1)
        shifted = torch.cat([shifted, shifted.new_full((b, n_pad), IGNORE_INDEX)], dim=1)
        position_ids = torch.cat([position_ids, pad_pos], dim=1)
    if real_lengths is not None and (len(real_lengths) != b or not all(0 <= n <= length for n in real_lengths)):
        raise ValueError(f"real_lengths must give one count in [0, {length}] per row of {b}, got {real_lengths}")
    real = [length] * b if real_lengths is None else [int(n) for n in real_lengths]
    # the sp padding and each row's own pads: segments of their own, which kernels leave out
    cu, max_len, packed, pad_spans = document_layout(position_ids, real if total > length or min(real) < length
                                                     else None)

    local = total // sp_size
    sl = slice(sp_rank * local, (sp_rank + 1) * local)  # [b, L_pad] -> [b, L_pad/sp]

    def here(real: int) -> int:  # of a row's first `real` tokens, how many fall in this rank's slice
        return max(0, min(local, real - sp_rank * local))

    context = ShardContext(position_ids[:, sl].contiguous(), cu, max_len, packed, tuple(here(n) for n in real),
                           pad_spans, seq_len=total, start=sl.start)
    return Shard(input_ids[:, sl].contiguous(), shifted[:, sl].contiguous(), context)
