"""Sharding is pure: shift before slicing, pad to a multiple of sp, global positions, doc layout."""

import pytest
import torch

from ulysses_trainer.parallel.sharding import IGNORE_INDEX, shard_batch
from ulysses_trainer.vocabulary.layout import padded_length


def test_shift_then_shard_loses_no_token():
    ids = torch.arange(100, 110)[None]  # 10 tokens, sp=4 -> padded to 12
    shards = [shard_batch(ids, sp_size=4, sp_rank=r) for r in range(4)]
    labels = torch.cat([s.labels for s in shards], dim=1)[0]
    assert labels.tolist() == list(range(101, 110)) + [IGNORE_INDEX] * 3
    pos = torch.cat([s.context.position_ids for s in shards], dim=1)[0]
    assert pos.tolist() == list(range(12))  # global, pads continue the last document
    assert sum(s.num_valid for s in shards) == 9
    assert all(s.input_ids.shape == (1, 3) for s in shards)


def test_packed_documents_do_not_predict_across_boundaries():
    ids = torch.arange(7)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    s = shard_batch(ids, position_ids=pos, sp_size=1, sp_rank=0)
    assert s.labels[0].tolist() == [1, 2, IGNORE_INDEX, 4, IGNORE_INDEX, 6, IGNORE_INDEX]
    assert s.context.cu_seqlens.tolist() == [0, 3, 5, 7] and s.context.max_seqlen == 3 and s.context.packed


def test_batch_rows_are_documents():
    ids = torch.zeros(2, 6, dtype=torch.long)
    s = shard_batch(ids, sp_size=2, sp_rank=1, pad_to_multiple_of=4)
    assert s.input_ids.shape == (2, 4)  # 6 -> 8, half each
    # each row's sp padding is a segment of its own, which the kernels leave out
    c = s.context
    assert c.cu_seqlens.tolist() == [0, 6, 8, 14, 16] and not c.packed and c.pad_spans == ((6, 8), (14, 16))


def test_pads_are_segments_of_their_own_cut_at_pad_segment():
    from ulysses_trainer.parallel.sharding import PAD_SEGMENT

    L, real = 2 * PAD_SEGMENT + 40, [PAD_SEGMENT + 10, 2 * PAD_SEGMENT + 40]
    pos = torch.cat([torch.arange(60), torch.arange(L - 60)])[None].repeat(2, 1)  # two documents a row
    pos[0, real[0]:] = pos[0, real[0] - 1] + 1 + torch.arange(L - real[0])  # pads continue the last document
    s = shard_batch(torch.ones(2, L, dtype=torch.long), position_ids=pos, sp_size=4, sp_rank=0, real_lengths=real)
    total = padded_length(L, 4)  # 296: no sp padding
    row0 = [0, 60, real[0], real[0] + PAD_SEGMENT]  # the pads: 158 tokens, in segments of 128 and 30
    row1 = [total, total + 60]
    assert s.context.cu_seqlens.tolist() == row0 + row1 + [2 * total] and s.context.packed
    assert s.context.pad_spans == ((real[0], total),) and s.context.max_seqlen == L - 60
    last = shard_batch(torch.ones(2, L, dtype=torch.long), position_ids=pos, sp_size=4, sp_rank=3, real_lengths=real)
    assert last.context.real_rows == (0, total // 4)
    assert last.context.cu_seqlens.tolist() == s.context.cu_seqlens.tolist()


def test_padded_length_and_bad_rank():
    assert padded_length(37, 4, 16) == 48 and padded_length(40, 8) == 40 and padded_length(1, 3, 2) == 6
    with pytest.raises(ValueError, match="sp_rank"):
        shard_batch(torch.zeros(1, 4, dtype=torch.long), sp_size=2, sp_rank=2)


def test_the_context_is_what_the_layers_read_of_a_shard():
    from ulysses_trainer.parallel.sharding import ShardContext, shard_in_scope, shard_scope

    ids = torch.ones(2, 10, dtype=torch.long)  # rows of 7 and 10 real tokens, sp=2 -> padded to 10, 5 per rank
    first, second = (shard_batch(ids, sp_size=2, sp_rank=r, real_lengths=[7, 10]).context for r in (0, 1))
    assert (first.seq_len, first.start, second.start) == (10, 0, 5)
    assert first.real_rows == (5, 5) and not first.has_pads and first.real_spans(10) is None
    assert first.row_mask() is None
    assert second.real_rows == (2, 5) and second.has_pads
    assert second.real_spans(10) == ((0, 2), (5, 10)) and second.real_spans(12) is None  # over [b * s] rows
    assert second.row_mask().tolist() == [1, 1, 0, 0, 0, 1, 1, 1, 1, 1]
    rows = ShardContext.for_rows(torch.zeros(2, 4, dtype=torch.long), sp_rank=3)
    assert rows.position_ids[1].tolist() == [12, 13, 14, 15] and rows.cu_seqlens is None and rows.seq_len is None
    assert shard_in_scope() is None
    with shard_scope(second):
        assert shard_in_scope() is second
        with shard_scope(first):
            assert shard_in_scope() is first
        assert shard_in_scope() is second
    assert shard_in_scope() is None


def test_a_shard_of_another_rank_or_row_length_is_refused_on_the_host():
    from ulysses_trainer.parallel.shard_check import check_shard
    from ulysses_trainer.parallel.state import ParallelState

    shard = shard_batch(torch.arange(12)[None], sp_size=2, sp_rank=0)  # rank 0's 6 tokens of a 12-token row
    rank = lambda r: ParallelState(world_size=2, rank=r, sp_size=2, sp_rank=r, dp_size=1, dp_rank=0)  # noqa: E731
    check_shard(rank(0), shard.input_ids, shard.context)  # no group needed: the host's numbers suffice
    with pytest.raises(ValueError, match="SP rank 1 holds the slice of the row starting at token 0, which is SP "
                                         "rank 0's: each SP rank takes its L/sp slice"):
        check_shard(rank(1), shard.input_ids, shard.context)
    whole = shard_batch(torch.arange(12)[None], sp_size=1, sp_rank=0)  # the whole row on a rank of sp=2
    with pytest.raises(ValueError, match="this rank holds 12 tokens per row, and 12 x sp_size 2 = 24 is not"):
        check_shard(rank(1), whole.input_ids, whole.context)
