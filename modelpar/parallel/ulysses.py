"""Ulysses context parallelism: the sequence shard of q, k, v turned into a head shard by one all-to-all, and the
attention output turned back by another (Jacobs et al. 2023).

The all-to-all runs over a group of ``n`` cp ranks (``parallel.cp_comm=alltoall``: all of cp;
``hybrid``: ``parallel.cp_a2a`` consecutive cp ranks, a ring across the groups). Member ``j`` of the group sends
heads ``j*h/n .. (j+1)*h/n`` of its own tokens to member ``j`` and receives those heads of every member's tokens.
Each member holds two chunks of the load-balanced split (``modelpar.parallel.context``): group ``g`` of ``n``
members ``g*n + j`` holds chunks ``g*n + j`` and ``2cp-1-g*n-j``, so after the exchange the group's tokens are,
put in order, super-chunks ``g`` and ``2R-1-g`` of size ``n`` chunks: the balanced split of a cp ring of
``R = cp/n`` ranks. The gathered tokens are put in that order (true sequence order when ``n = cp``), so the
masks, positions and document ids of the whole sequence apply unchanged::

    cp=4, n=2, chunks 0..7    group 0 = ranks 0, 1: rank 0 [0 | 7], rank 1 [1 | 6] -> heads/2 of [0 1 | 6 7]
                              group 1 = ranks 2, 3: rank 2 [2 | 5], rank 3 [3 | 4] -> heads/2 of [2 3 | 4 5]

Grouped-query attention: with ``hkv`` kv heads (per tp rank) divisible by ``n`` the kv heads are split like the
query heads. Otherwise each kv head is repeated ``r = n / gcd(hkv, n)`` times first (the fewest copies whose
count ``lcm(hkv, n)`` splits over ``n``; ``hkv < n`` gives one kv head per member), and the repeats' gradients
sum back into it. The query heads per tp rank must divide by ``n`` (validated with the recipe).

The all-to-all is its own adjoint: the backward of each exchange is the exchange of the gradient the other way.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from einops import rearrange

from modelpar.parallel.collectives import all_to_all, comm_tag, current_tag


class _Exchange(torch.autograd.Function):
    """x [n, ...]: slice j to member j of ``group``; returns [n, ...], slice j from member j. Backward: the same
    exchange of the gradient (an even all-to-all is its own inverse)."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size, ctx.tag = group, size, current_tag()
        return all_to_all(x, [1] * size, [1] * size, group)

    @staticmethod
    def backward(ctx, grad):
        with comm_tag(ctx.tag):
            return all_to_all(grad, [1] * ctx.size, [1] * ctx.size, ctx.group), None, None


def kv_repeats(kv_heads: int, size: int) -> int:
    """How many times each of ``kv_heads`` is repeated before splitting kv heads over ``size`` ranks: 1 when they
    divide evenly, else ``size / gcd(kv_heads, size)`` (``lcm(kv_heads, size)`` heads in all)."""
    return size // math.gcd(kv_heads, size)


def _super_chunks(got: torch.Tensor) -> torch.Tensor:
    """[member, b, L, h, d] received from each group member -> [b, size*L, h, d]: the group's two super-chunks."""
    got = rearrange(got, "m b (two c) h d -> two m b c h d", two=2)
    first = rearrange(got[0], "m b c h d -> b (m c) h d")  # chunks g*n .. g*n+n-1: members in order
    second = rearrange(got[1].flip(0), "m b c h d -> b (m c) h d")  # chunks 2cp-1-g*n-j: members reversed
    return torch.cat([first, second], dim=1)


def heads_from_sequence(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """This rank's tokens of every head x [b, L, h, d] (two chunks of L/2) -> every group member's tokens of this
    rank's h/size heads [b, size*L, h/size, d], in the order of the group's two super-chunks."""
    parts = rearrange(x, "b l (m h) d -> m b l h d", m=size).contiguous()
    return _super_chunks(_Exchange.apply(parts, group, size))


def sequence_from_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Inverse of ``heads_from_sequence``: [b, size*L, h/size, d] -> this rank's tokens of every head [b, L, h, d]."""
    first, second = x.chunk(2, dim=1)
    first = rearrange(first, "b (m c) h d -> m b c h d", m=size)
    second = rearrange(second, "b (m c) h d -> m b c h d", m=size).flip(0)
    parts = torch.stack([first, second], dim=2).flatten(2, 3).contiguous()  # [member, b, L, h/size, d]
    got = _Exchange.apply(parts, group, size)  # [head group, b, L, h/size, d]
    return rearrange(got, "m b l h d -> b l (m h) d")


def exchange_qkv(q, k, v, group: dist.ProcessGroup, size: int):
    """q [b, L, hq, d], k, v [b, L, hkv, d] -> q [b, size*L, hq/size, d], k, v [b, size*L, hkv*r/size, d] with
    ``r = kv_repeats(hkv, size)``: the head shard of the group's tokens, q, k and v in one all-to-all."""
    hq, hkv = q.shape[2], k.shape[2]
    if hq % size:
        raise ValueError(f"{hq} query heads cannot be split over an all-to-all of {size} ranks")
    r = kv_repeats(hkv, size)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    split = [hq // size, hkv * r // size, hkv * r // size]
    parts = torch.cat([rearrange(t, "b l (m h) d -> m b l h d", m=size) for t in (q, k, v)], dim=3).contiguous()
    got = _super_chunks(_Exchange.apply(parts, group, size))
    return got.split(split, dim=2)


__all__ = ["exchange_qkv", "heads_from_sequence", "kv_repeats", "sequence_from_heads"]
