"""Expert-parallel regions: the autograd-aware communication of a mixture-of-experts layer.

Experts are split over an ``ep`` group carved from the ``dp x cp`` ranks of one (pp, tp) coordinate
(``ParallelLayout.ep_ranks``); each ep rank holds ``experts / ep`` whole experts, replicated over the other
``dp x cp / ep`` ranks (the expert data-parallel group, over which their gradients are reduced) and over tp.

    tokens routed to experts of every ep rank --dispatch (all-to-all)--> the rows of this rank's experts
    expert outputs --combine (all-to-all, the splits swapped)--> back where their tokens live

Each op's backward is the other's forward. Inside a MoE layer under tp without sequence parallelism the
tokens are split over tp (``split_tokens`` / ``gather_tokens``), so tp ranks route and compute disjoint tokens
instead of repeating the same work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from modelpar.parallel.collectives import all_gather, all_to_all, comm_tag, current_tag
from modelpar.parallel.regions import TensorParallelGroup


@dataclass(frozen=True, eq=False)
class ExpertParallelGroup:
    """The ep group a MoE layer dispatches over, and where its tokens' global-batch statistics are summed.

    ``ExpertParallelGroup()``: one rank holds every expert and sees the whole batch (single device).
    ``batch_groups``: the groups (dp x cp; the tp group is the layer's own) over which routing counts of the
    global micro-batch are summed; ``batch_ranks``: how many dp x cp ranks share the global batch.
    """

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1
    batch_groups: tuple[dist.ProcessGroup, ...] = ()
    batch_ranks: int = 1

    def __post_init__(self) -> None:
        if self.size > 1 and self.group is None:
            raise ValueError(f"expert parallelism over {self.size} ranks needs a process group")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"ep rank {self.rank} is outside a group of {self.size}")

    @classmethod
    def of(cls, groups) -> ExpertParallelGroup:
        """The ep part of a ``modelpar.parallel.groups.ParallelGroups``."""
        dp_cp = len(groups.dp_cp_ranks)
        return cls(
            group=groups.ep_group,
            rank=groups.ep_rank,
            size=len(groups.ep_ranks),
            batch_groups=(groups.dp_cp_group,) if dp_cp > 1 else (),
            batch_ranks=dp_cp,
        )


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group, ctx.tag = (send_splits, recv_splits), group, current_tag()
        return all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        with comm_tag(ctx.tag):
            return all_to_all(grad, recv_splits, send_splits, ctx.group), None, None, None


def all_to_all_tokens(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], ep: ExpertParallelGroup
) -> torch.Tensor:
    """Rows of x [n, h] to the ep ranks (``send_splits[r]`` rows to rank r, in order) -> [sum(recv_splits), h];
    the backward sends the gradients back the same way reversed."""
    if ep.size == 1:
        return x
    return _AllToAll.apply(x, send_splits, recv_splits, ep.group)


class _SplitTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.tag = tp, current_tag()
        return x.chunk(tp.size)[tp.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        with comm_tag(ctx.tag):
            return all_gather(grad, ctx.tp.group), None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return all_gather(x, tp.group)

    @staticmethod
    def backward(ctx, grad):
        # the gradient of a tp-replicated activation is the same on every tp rank: keep this rank's rows
        return grad.chunk(ctx.tp.size)[ctx.tp.rank].contiguous(), None


def split_tokens(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """This tp rank's 1/t of the tokens x [n, h] (replicated over tp) -> [n/t, h]; all-gather backward."""
    if tp.size == 1:
        return x
    if x.shape[0] % tp.size:
        raise ValueError(f"a MoE layer splits its {x.shape[0]} tokens over tp={tp.size}: make b*s divisible by tp")
    return _SplitTokens.apply(x, tp)


def gather_tokens(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """Every tp rank's tokens [n/t, h] -> [n, h] replicated over tp; backward keeps this rank's rows."""
    return x if tp.size == 1 else _GatherTokens.apply(x, tp)
