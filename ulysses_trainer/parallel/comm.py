"""The Ulysses all-to-all, as an autograd function (its backward is the reverse all-to-all).

Collective invariant: every rank of the SP group calls these in the same order with tensors of the
same shape; the sequence is padded to a multiple of sp before sharding so local lengths agree.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _seq_to_heads(x: torch.Tensor, sp_size: int, group) -> torch.Tensor:
    b, s_local, h, d = x.shape
    assert h % sp_size == 0, f"{h} heads do not split over sp_size={sp_size}; pick an sp_size dividing the head count"
    # [b, s/sp, h, d] -> [sp, b, s/sp, h/sp, d]: chunk r of dim 0 goes to rank r
    send = x.reshape(b, s_local, sp_size, h // sp_size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[r] = rank r's sequence chunk of my heads: [sp, b, s/sp, h/sp, d] -> [b, s, h/sp, d]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, sp_size * s_local, h // sp_size, d)


def _heads_to_seq(x: torch.Tensor, sp_size: int, group) -> torch.Tensor:
    b, s, h_local, d = x.shape
    assert s % sp_size == 0, f"sequence {s} does not split over sp_size={sp_size}; pad to a multiple of sp_size"
    # [b, s, h/sp, d] -> [sp, b, s/sp, h/sp, d]: sequence chunk r goes back to rank r
    send = x.reshape(b, sp_size, s // sp_size, h_local, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[r] = my sequence chunk of rank r's heads: [sp, b, s/sp, h/sp, d] -> [b, s/sp, h, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // sp_size, sp_size * h_local, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp_size, group):
        ctx.sp_size, ctx.group = sp_size, group
        return _seq_to_heads(x, sp_size, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.sp_size, ctx.group), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp_size, group):
        ctx.sp_size, ctx.group = sp_size, group
        return _heads_to_seq(x, sp_size, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.sp_size, ctx.group), None, None


def seq_to_heads(x: torch.Tensor, sp_size: int, group) -> torch.Tensor:
    """All-to-all: [b, s/sp, h, d] (my tokens, all heads) -> [b, s, h/sp, d] (all tokens, my heads)."""
    return x if sp_size == 1 else _SeqToHeads.apply(x, sp_size, group)


def heads_to_seq(x: torch.Tensor, sp_size: int, group) -> torch.Tensor:
    """All-to-all: [b, s, h/sp, d] (all tokens, my heads) -> [b, s/sp, h, d] (my tokens, all heads)."""
    return x if sp_size == 1 else _HeadsToSeq.apply(x, sp_size, group)


def _on_comm_device(t: torch.Tensor) -> torch.Tensor:
    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors
    if dist.get_backend() == "nccl":
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


def all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Reduce a small CPU tensor over a group (world when None); returns a CPU tensor. No-op without
    a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return t
    x = _on_comm_device(t)
    dist.all_reduce(x, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    return x.cpu()


def world_rank() -> int:
    """This process's rank in the world (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_objects(value: Any) -> list[Any]:
    """Every rank's picklable `value`, by rank (collective over the world); [value] without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def sum_in_place(t: torch.Tensor, group=None) -> None:
    """Sum a tensor of any size over a group in place, on its own device (a full gradient from each rank's
    part). No-op without a process group or with a group of one."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    return all_reduce(t, "sum", group)


def gather_sequence(x: torch.Tensor, sp_size: int, group) -> torch.Tensor:
    """All-gather a per-rank sequence slice [s/sp, ...] into the full [s, ...] (diagnostics only)."""
    if sp_size == 1:
        return x
    x = _on_comm_device(x.contiguous())
    parts = [torch.empty_like(x) for _ in range(sp_size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group; the backward of a sum is the sum of the grads over the same group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = _on_comm_device(x.contiguous().clone())
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y.to(x.device)

    @staticmethod
    def backward(ctx, grad):
        g = _on_comm_device(grad.contiguous().clone())
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g.to(grad.device), None


def all_reduce_sum_differentiable(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a tensor over a group (world when None) with autograd: every rank's backward gets the sum of all
    ranks' grads of the result. A collective in forward and in backward: every rank of the group calls it.
    Identity without a process group or with a group of one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)
