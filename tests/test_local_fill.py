"""The rehearsal's process group (parallel/local_fill.py): every collective leaves this rank's own values,
through each torch.distributed entry DeepSpeed and the trainer use, and the c10d ops stay visible to
CollectiveLog. Rank 2 of 4, in this process."""

import pytest
import torch
import torch.distributed as dist

from ulysses_trainer.parallel.fake import CollectiveLog, fake_process_group

RANK, WORLD = 2, 4


@pytest.fixture
def group():
    with fake_process_group(RANK, WORLD, gpus_per_node=8, device="cpu", fill="local"):
        yield dist.group.WORLD


def _x(*shape):
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def test_all_gather_holds_the_local_shard_in_every_slot(group):
    x = _x(3, 5)
    out = torch.zeros(WORLD * 3, 5)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, x.repeat(WORLD, 1))
    stacked = torch.zeros(WORLD, 3, 5)
    dist.all_gather_into_tensor(stacked, x)
    assert all(torch.equal(stacked[r], x) for r in range(WORLD))
    slots = [torch.zeros(3, 5) for _ in range(WORLD)]
    dist.all_gather(slots, x)
    assert all(torch.equal(s, x) for s in slots)
    work = dist.all_gather_into_tensor(out.zero_(), x, async_op=True)  # ZeRO-3's prefetch: async
    work.wait()
    assert torch.equal(out, x.repeat(WORLD, 1))


def test_all_to_all_output_equals_its_input(group):
    x = _x(WORLD, 2, 3)  # Ulysses' send buffer: [sp, b, s/sp, h/sp, d]-like, chunk r to rank r
    out = torch.zeros_like(x)
    dist.all_to_all_single(out, x)
    assert torch.equal(out, x)
    outs = [torch.zeros(2, 3) for _ in range(WORLD)]
    dist.all_to_all(outs, list(x.unbind(0)))
    assert all(torch.equal(o, x[r]) for r, o in enumerate(outs))


def test_reduce_scatter_output_is_this_ranks_slice(group):
    x = _x(WORLD * 2, 3)
    out = torch.zeros(2, 3)
    dist.reduce_scatter_tensor(out, x)
    assert torch.equal(out, x[RANK * 2:(RANK + 1) * 2])
    out2 = torch.zeros(6)
    dist.reduce_scatter_tensor(out2, x.reshape(-1))
    assert torch.equal(out2, x.reshape(WORLD, -1)[RANK])


def test_reductions_and_broadcast_leave_the_input(group):
    x = _x(4)
    y = x.clone()
    dist.all_reduce(y)
    dist.broadcast(y, src=0)
    assert torch.equal(y, x)


def test_coalesced_gathers_and_scatters_fill_each_tensor(group):
    a, b = _x(2), _x(3) * 10
    outs = [torch.zeros(WORLD * 2), torch.zeros(WORLD * 3)]
    with dist._coalescing_manager(async_ops=False):
        dist.all_gather_into_tensor(outs[0], a)
        dist.all_gather_into_tensor(outs[1], b)
    assert torch.equal(outs[0], a.repeat(WORLD)) and torch.equal(outs[1], b.repeat(WORLD))
    big = [_x(WORLD * 2), _x(WORLD * 3)]
    small = [torch.zeros(2), torch.zeros(3)]
    with dist._coalescing_manager(async_ops=False):
        for o, i in zip(small, big):
            dist.reduce_scatter_tensor(o, i)
    assert all(torch.equal(o, i.reshape(WORLD, -1)[RANK]) for o, i in zip(small, big))


def test_subgroups_fill_too_and_collectives_are_counted(group):
    sub = dist.new_group([0, 1, 2, 3])  # DeepSpeed's sp / dp groups are made like this
    x = _x(3)
    out = torch.zeros(WORLD * 3)
    with CollectiveLog() as log:
        dist.all_gather_into_tensor(out, x, group=sub)
        dist.all_to_all_single(torch.zeros(8), _x(8), group=sub)
        dist.reduce_scatter_tensor(torch.zeros(2), _x(8), group=sub)
        dist.all_reduce(x, group=sub)
    assert torch.equal(out, x.repeat(WORLD))
    assert {op: row["calls"] for op, row in log.ops.items()} == {
        "all_gather": 1, "all_to_all": 1, "reduce_scatter": 1, "all_reduce": 1}
    assert log.ops["all_gather"]["bytes"] == 3 * 4 and log.ops["all_to_all"]["bytes"] == 8 * 4


def test_fill_none_is_torchs_bare_fake_group(group):
    # (torch 2.11's fake group leaves outputs as allocated; from 2.13 torch's own fake group copies local values)
    assert dist.get_backend() == "ulysses_local_fill"
    dist.destroy_process_group()
    with fake_process_group(RANK, WORLD, gpus_per_node=8, device="cpu", fill="none"):
        assert dist.get_backend() == "fake"


def test_unknown_fill_is_refused():
    with pytest.raises(ValueError, match="pick one of local, none"):
        with fake_process_group(RANK, WORLD, gpus_per_node=8, device="cpu", fill="zeros"):
            pass


def test_in_place_gather_and_scatter_as_zero3_calls_them(group):
    # ZeRO-3 gathers into a flat buffer whose slot `rank` is the input itself, and may reduce-scatter in place
    flat = torch.zeros(WORLD * 3)
    mine = flat[RANK * 3:(RANK + 1) * 3]
    mine.copy_(_x(3))
    dist.all_gather_into_tensor(flat, mine)
    assert torch.equal(flat, _x(3).repeat(WORLD))
    grads = _x(WORLD * 2)
    dist.reduce_scatter_tensor(grads[RANK * 2:(RANK + 1) * 2], grads)
    assert torch.equal(grads, _x(WORLD * 2))
