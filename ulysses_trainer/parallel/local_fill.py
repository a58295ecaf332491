"""The rehearsal's process group: torch's fake backend, with every collective's output filled from this
rank's own data (`collective_fill: "local"`).

On the bare fake group an all-gather or all-to-all leaves its output as the allocator left it (zeros, or stale
memory), so gathered ZeRO-3 weights and all-to-all outputs hold no real values: GPU kernels then run faster
than on real data (an H200 runs FA4 21%, cuDNN attention 27% and a bf16 matmul 20% faster on zeros,
benchmarks/data_dependence.py), and the gradient norm can come out non-finite, so the update is skipped. Here each
collective leaves what a real rank would see, up to which rank's numbers they are:

- all-gather: this rank's input in every rank's slot;
- all-to-all: its own input (every chunk it would receive is shaped like the one it sends);
- reduce-scatter: its own slice of the input (what the sum would be with one rank);
- all-reduce, broadcast, reduce: the input unchanged (the fake backend's own answer).

The copies run on the caller's current stream at call time: ordered as NCCL's output is for every consumer that
waits on the work or its stream, as DeepSpeed's do. They are the only GPU work the group adds.

torch.distributed calls a Python `ProcessGroup`'s methods from Python (`dist.all_gather_into_tensor` ->
`_allgather_base`, or `all_gather_single` from torch 2.13 on); each override first calls the fake backend
through the dispatcher (so `CollectiveLog` still sees every c10d op) and then fills.
(From torch 2.13 torch's fake backend itself leaves the same local values; the copy then runs twice.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BACKEND = "ulysses_local_fill"
FILLS = ("local", "none")  # collective_fill: this module's group | torch's bare fake group


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _copy(out: torch.Tensor, src: torch.Tensor) -> None:
    """out <- src, where src may be out itself (in-place collectives) or overlap it."""
    if out.data_ptr() == src.data_ptr() and out.shape == src.shape:
        return
    out.copy_(src.clone() if _shares_memory(out, src) else src)


def _fill_gathered(out: torch.Tensor, inp: torch.Tensor, world_size: int, rank: int) -> None:
    # out: [world * n, ...] or [world, n, ...], contiguous; inp: [n, ...] -> inp in each of the world slots
    slots, src = out.view(world_size, -1), inp.reshape(1, -1)
    if src.data_ptr() == slots[rank].data_ptr():  # in place (ZeRO-3): the input is this rank's slot already
        slots[:rank].copy_(src)
        slots[rank + 1:].copy_(src)
    else:
        _copy(slots, src.expand_as(slots))


def _fill_own_slice(out: torch.Tensor, inp: torch.Tensor, world_size: int, rank: int) -> None:
    # inp: [world * n, ...] contiguous; out: [n, ...] -> slice `rank` of inp
    _copy(out, inp.reshape(world_size, -1)[rank].view_as(out))


def _fill_like(out: torch.Tensor, inp: torch.Tensor) -> None:
    # all-to-all: out and inp hold the same number of elements with even splits; uneven splits: inp's
    # elements repeated to out's length (every value still one this rank holds)
    if out.numel() == inp.numel():
        _copy(out, inp.view_as(out))
    elif inp.numel() > 0:
        flat = inp.reshape(-1)
        reps = -(-out.numel() // flat.numel())
        out.copy_(flat.repeat(reps)[:out.numel()].view_as(out))


class _Common(dist.ProcessGroup):
    """The collectives whose names every torch version shares."""

    def allgather(self, outputs, inputs, *opts):
        work = super().allgather(outputs, inputs, *opts)
        for slots, inp in zip(outputs, inputs):  # outputs: [[world tensors] per input]
            for out in slots:
                _copy(out, inp)
        return work

    def allgather_coalesced(self, output_lists, inputs, *opts):
        work = super().allgather_coalesced(output_lists, inputs, *opts)
        for slots, inp in zip(output_lists, inputs):
            for out in slots:
                _copy(out, inp)
        return work

    def alltoall(self, outs, inps, *opts):
        work = super().alltoall(outs, inps, *opts)
        for out, inp in zip(outs, inps):
            _fill_like(out, inp)
        return work

    def reduce_scatter(self, outs, input_lists, *opts):
        work = super().reduce_scatter(outs, input_lists, *opts)
        for out, parts in zip(outs, input_lists):  # parts: world tensors, one per rank's output
            _copy(out, parts[self.rank()])
        return work


def _gathered(out: torch.Tensor, inp: torch.Tensor, pg: dist.ProcessGroup) -> None:
    _fill_gathered(out, inp, pg.size(), pg.rank())


def _own_slice(out: torch.Tensor, inp: torch.Tensor, pg: dist.ProcessGroup) -> None:
    _fill_own_slice(out, inp, pg.size(), pg.rank())


def _like(out: torch.Tensor, inp: torch.Tensor, pg: dist.ProcessGroup) -> None:
    _fill_like(out, inp)


def _filled(work, fill, out, inp, pg: dist.ProcessGroup):
    """After the fake backend's collective (`work`, returned): `fill(out, inp, group)`."""
    fill(out, inp, pg)
    return work


def _filled_each(work, fill, outs, inps, pg: dist.ProcessGroup):
    """As _filled, for a coalesced call's lists of outputs and inputs."""
    for out, inp in zip(outs, inps):
        fill(out, inp, pg)
    return work


class _TensorNames(_Common):
    """torch < 2.13: dist.all_gather_into_tensor -> _allgather_base, all_to_all_single -> alltoall_base,
    reduce_scatter_tensor -> _reduce_scatter_base, the coalescing manager -> *_tensor_coalesced."""

    def _allgather_base(self, out, inp, *opts):
        return _filled(super()._allgather_base(out, inp, *opts), _gathered, out, inp, self)

    def allgather_into_tensor_coalesced(self, outs, inps, *opts):
        return _filled_each(super().allgather_into_tensor_coalesced(outs, inps, *opts), _gathered, outs, inps, self)

    def alltoall_base(self, out, inp, *rest):
        return _filled(super().alltoall_base(out, inp, *rest), _like, out, inp, self)

    def _reduce_scatter_base(self, out, inp, *opts):
        return _filled(super()._reduce_scatter_base(out, inp, *opts), _own_slice, out, inp, self)

    def reduce_scatter_tensor_coalesced(self, outs, inps, *opts):
        return _filled_each(super().reduce_scatter_tensor_coalesced(outs, inps, *opts), _own_slice, outs, inps, self)


class _SingleNames(_Common):
    """torch >= 2.13: the same collectives as `*_single`; its C++ old names forward to these (overriding both
    would recurse), so only these are overridden."""

    def all_gather_single(self, out, inp, *opts):
        return _filled(super().all_gather_single(out, inp, *opts), _gathered, out, inp, self)

    def all_gather_single_coalesced(self, outs, inps, *opts):
        return _filled_each(super().all_gather_single_coalesced(outs, inps, *opts), _gathered, outs, inps, self)

    def all_to_all_single(self, out, inp, *rest):
        return _filled(super().all_to_all_single(out, inp, *rest), _like, out, inp, self)

    def reduce_scatter_single(self, out, inp, *opts):
        return _filled(super().reduce_scatter_single(out, inp, *opts), _own_slice, out, inp, self)

    def reduce_scatter_single_coalesced(self, outs, inps, *opts):
        return _filled_each(super().reduce_scatter_single_coalesced(outs, inps, *opts), _own_slice, outs, inps, self)


_Names = _SingleNames if hasattr(dist.ProcessGroup, "all_gather_single") else _TensorNames


class LocalFillGroup(_Names):
    """rank of world on the fake backend; each collective's output holds this rank's own values (above)."""

    def __init__(self, rank: int, world_size: int, fake_backend) -> None:
        super().__init__(rank, world_size)
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, fake_backend)
        self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND


def create_group(common_opts, backend_opts) -> LocalFillGroup:
    """torch's extended backend API: this rank's LocalFillGroup around a fake backend (registered for the rehearsal's
    block only, parallel/fake.py through parallel/integrations.process_group_backend)."""
    from torch.testing._internal.distributed.fake_pg import _create_fake_pg

    return LocalFillGroup(common_opts.group_rank, common_opts.group_size, _create_fake_pg(common_opts, backend_opts))
