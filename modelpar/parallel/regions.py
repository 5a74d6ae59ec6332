"""Tensor-parallel regions: the autograd-aware communication ops that sharded layers are built from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from modelpar.parallel.collectives import (
    all_gather,
    all_reduce,
    all_reduce_async,
    comm_tag,
    current_tag,
    reduce_scatter,
    wait_after_hand_over,
)

# Megatron's conjugate pairs: each op's backward is the other's forward, so a column-parallel layer followed by
# a row-parallel one costs one collective forward and one backward.
#
#   op                                   forward          backward
#   copy_to_tp_region          (f)       identity         all-reduce
#   reduce_from_tp_region      (g)       all-reduce       identity
#   gather_from_sequence_region (f, SP)  all-gather       reduce-scatter
#   reduce_scatter_to_sequence_region    reduce-scatter   all-gather     (g, SP)
#   scatter_to_sequence_region           split            all-gather
#   sum_over_tp                          all-reduce       all-reduce     (a sum every rank's output depends on)
#
# The label active at forward time (``comm_tag``) is re-applied in backward, so both directions count under it.


@dataclass(frozen=True, eq=False)
class TensorParallelGroup:
    """The tensor-parallel group a sharded layer talks over: process group, this rank's index, group size.

    ``TensorParallelGroup()`` is the single device (size 1, no process group, no torch.distributed needed);
    every region op below is then the identity and records nothing.
    """

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size > 1 and self.group is None:
            raise ValueError(f"tensor parallelism over {self.size} ranks needs a process group")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} is outside a group of {self.size}")

    @classmethod
    def of(cls, groups) -> TensorParallelGroup:
        """The tp part of a ``modelpar.parallel.groups.ParallelGroups``."""
        return cls(group=groups.tp_group, rank=groups.tp_rank, size=len(groups.tp_ranks))


class _ColumnParallelMatmul(torch.autograd.Function):
    """``f`` fused with the column-parallel matmul, so backward overlaps the all-reduce of the input gradient
    with the weight-gradient matmul (Megatron's asynchronous grad all-reduce). Same collectives as
    ``copy_to_tp_region`` followed by ``F.linear``; autocast-safe (backward casts to the gradient's dtype)."""

    @staticmethod
    def forward(ctx, x, weight, tp):
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.tag = tp, current_tag()
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = torch.matmul(grad_y, weight.to(grad_y.dtype)).to(x.dtype)  # [..., in]
        with comm_tag(ctx.tag):
            work = all_reduce_async(grad_x, ctx.tp.group)
        flat_grad = grad_y.reshape(-1, grad_y.shape[-1])
        grad_w = torch.matmul(flat_grad.t(), x.reshape(-1, x.shape[-1]).to(grad_y.dtype)).to(weight.dtype)
        wait_after_hand_over(work, "all_reduce", ctx.tp.group)  # still in flight: a paired micro-batch computes
        return grad_x, grad_w, None


def column_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """``copy_to_tp_region(x) @ weight.T`` with the backward all-reduce overlapped. x: [..., in] -> [..., out/t]."""
    if tp.size == 1:
        return torch.nn.functional.linear(x, weight)
    return _ColumnParallelMatmul.apply(x, weight, tp)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.tag = tp, current_tag()
        return x

    @staticmethod
    def backward(ctx, grad):
        with comm_tag(ctx.tag):
            return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.tp.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        # the partial sums of a row-parallel matmul or a vocab-parallel lookup: a fresh tensor nothing else reads,
        # so it is summed in place (autograd is told; it would refuse backward if another op had saved it)
        if x.is_contiguous() and not x.is_leaf:
            ctx.mark_dirty(x)
            return all_reduce(x, tp.group)
        return all_reduce(x.clone(memory_format=torch.contiguous_format), tp.group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOverTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.tag = tp, current_tag()
        return all_reduce(x.clone(memory_format=torch.contiguous_format), tp.group)

    @staticmethod
    def backward(ctx, grad):
        with comm_tag(ctx.tag):
            return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.tp.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim, ctx.tag = tp, dim, current_tag()
        return all_gather(x, tp.group, dim)

    @staticmethod
    def backward(ctx, grad):
        with comm_tag(ctx.tag):
            return reduce_scatter(grad, ctx.tp.group, ctx.dim), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim, ctx.tag = tp, dim, current_tag()
        return reduce_scatter(x, tp.group, dim)

    @staticmethod
    def backward(ctx, grad):
        with comm_tag(ctx.tag):
            return all_gather(grad, ctx.tp.group, ctx.dim), None, None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim, ctx.tag = tp, dim, current_tag()
        if x.shape[dim] % tp.size:
            raise ValueError(f"scatter: dim {dim} of size {x.shape[dim]} is not divisible by {tp.size} ranks")
        return x.chunk(tp.size, dim)[tp.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        with comm_tag(ctx.tag):
            return all_gather(grad, ctx.tp.group, ctx.dim), None, None


def copy_to_tp_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward. Enters a column-parallel region."""
    return x if tp.size == 1 else _CopyToTensorParallelRegion.apply(x, tp)


def reduce_from_tp_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """g: all-reduce (sum of partial results) forward, identity backward. Leaves a row-parallel region."""
    return x if tp.size == 1 else _ReduceFromTensorParallelRegion.apply(x, tp)


def sum_over_tp(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """The sum of every tp rank's ``x``, on every rank; backward sums the gradients likewise (each rank's output
    depends on every rank's ``x``, as a norm's sum of squares over heads split by tp)."""
    return x if tp.size == 1 else _SumOverTensorParallel.apply(x, tp)


def gather_from_sequence_region(x: torch.Tensor, tp: TensorParallelGroup, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel f: all-gather the sequence shards ``[b, s/t, h] -> [b, s, h]``; reduce-scatter backward."""
    return x if tp.size == 1 else _GatherFromSequenceRegion.apply(x, tp, dim)


def reduce_scatter_to_sequence_region(x: torch.Tensor, tp: TensorParallelGroup, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel g: sum partial results and keep this rank's sequence shard ``[b, s, h] -> [b, s/t, h]``;
    all-gather backward."""
    return x if tp.size == 1 else _ReduceScatterToSequenceRegion.apply(x, tp, dim)


def scatter_to_sequence_region(x: torch.Tensor, tp: TensorParallelGroup, dim: int = 1) -> torch.Tensor:
    """Keep this rank's sequence shard of a replicated tensor ``[b, s, h] -> [b, s/t, h]`` (no communication);
    all-gather backward."""
    return x if tp.size == 1 else _ScatterToSequenceRegion.apply(x, tp, dim)
