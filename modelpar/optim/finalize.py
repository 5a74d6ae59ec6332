"""Gradient finalisation: everything that turns this rank's backward gradients into the step's, in one call.

    finalize_grads(optimizer, chunks, groups, tied=tied, whole_experts=whole_experts)   # once, after backward

1. the data-parallel average over dp x cp (the optimizer's: an overlapped bucketed all-reduce, ZeRO-1's
   reduce-scatter, or FSDP2's reduce-scatter already done in backward; experts over the ranks holding them);
2. experts FSDP2 left whole (no other rank holds them): divided by dp x cp, as the others were averaged;
3. tp partial sums: weights replicated over tp whose ranks each saw part of the work (norm weights under
   sequence parallel, kv heads replicated when kv_heads < tp, a router's gate);
4. the tied embedding: its copies on the first and last pipeline stages get the sum of both gradients.

2-4 are linear and commute with the average of 1; each optimizer runs them where its reduction allows (after
an overlapped all-reduce has written its averages back, before a reduce-scatter reads the gradients).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from modelpar.model.transformer import ModelChunk
from modelpar.optim.data_parallel import DataParallelOptimizer
from modelpar.optim.fsdp import is_sharded, local
from modelpar.parallel import collectives
from modelpar.parallel.groups import ParallelGroups


def finalize_grads(
    optimizer: DataParallelOptimizer,
    chunks: Sequence[ModelChunk],
    groups: ParallelGroups,
    *,
    tied: Sequence[torch.nn.Parameter] = (),
    whole_experts: Sequence[torch.nn.Parameter] = (),
    defer_flags: bool = True,
) -> None:
    """Finalise this step's gradients of ``chunks`` (see the module docstring). ``tied``: this rank's copies of
    a tied embedding held on two stages; ``whole_experts``: what ``apply_fsdp`` left whole. ``defer_flags``: as
    for ``DataParallelOptimizer.reduce_gradients`` (the step reads them back with its own values)."""

    def commuting_sums() -> None:
        average_whole_experts(whole_experts, len(groups.dp_cp_ranks))
        for chunk in chunks:
            reduce_tensor_parallel_grads(chunk)
        sum_tied_embedding(tied, groups.embedding_group)

    optimizer.reduce_gradients(commuting_sums, defer_flags=defer_flags)


def average_whole_experts(params: Sequence[torch.nn.Parameter], divisor: int) -> None:
    """Divide the gradients of experts held by this rank alone by dp x cp (each rank's loss is a mean over its
    own tokens; the experts saw every rank's tokens routed to them)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_div_(grads, float(divisor))


@torch.no_grad()
def reduce_tensor_parallel_grads(chunk: ModelChunk) -> None:
    """Sum the partial gradients of ``chunk``'s tp-replicated weights over the tp group; once after backward.

    Partial gradients come from norm weights under sequence parallel (each rank saw s/t tokens), from kv heads
    replicated because kv_heads < tp (each rank used them for its own query heads only) and from a MoE
    router (each tp rank routes its own tokens). One all-reduce per chunk, tagged "grad_sync"; nothing when
    no weight is partial. Under ZeRO-2/3 the gradients are already dp-sharded (FSDP2 reduce-scattered them; a
    sum over tp and a mean over dp commute): each rank sums the rows of its dp shard, the same rows on every tp
    rank.
    """
    partial = [s for s in chunk.logical_shards().values() if s.grad_is_partial]
    if not partial:
        return
    buffers = []
    for shard in partial:
        full = torch.zeros(shard.global_shape, dtype=shard.param.dtype, device=shard.param.device)
        piece = None if shard.param.grad is None else shard.piece_of(shard.param.grad)
        if piece is not None:
            full[piece[1]] = piece[0]
        buffers.append(full.flatten())
    flat = torch.cat(buffers)
    with collectives.comm_tag("grad_sync"):
        collectives.all_reduce(flat, chunk.tp.group)
    for shard, summed in zip(partial, flat.split([b.numel() for b in buffers]), strict=True):
        if shard.param.grad is None:
            shard.param.grad = torch.zeros_like(shard.param)
        piece = shard.piece_of(shard.param.grad)
        if piece is not None:
            piece[0].copy_(summed.view(shard.global_shape)[piece[1]])


def sum_tied_embedding(tied: Sequence[torch.nn.Parameter], embedding_group) -> None:
    """The embedding on the first stage and its copy on the last stage get the sum of both gradients (one
    all-reduce over the embedding group, tagged "tied_embedding"); nothing when ``tied`` is empty."""
    if not tied:
        return
    if is_sharded(tied[0]):  # ZeRO-2/3: both stages hold the same dp shard of it; sum the local shards
        grads = [local(p.grad) for p in tied if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads]) if len(grads) == len(tied) else None
        if flat is None:
            raise RuntimeError("a tied embedding copy has no gradient under ZeRO-2/3")
        with collectives.comm_tag("tied_embedding"):
            collectives.all_reduce(flat, embedding_group)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(piece.view_as(g))
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in tied]
    flat = torch.cat([g.flatten() for g in grads])
    with collectives.comm_tag("tied_embedding"):
        collectives.all_reduce(flat, embedding_group)
    for p, piece in zip(tied, flat.split([g.numel() for g in grads]), strict=True):
        if p.grad is None:
            p.grad = piece.view_as(p).clone()
        else:  # in place: a zero-0 gradient stays in its all-reduce bucket
            p.grad.copy_(piece.view_as(p))


__all__ = ["average_whole_experts", "finalize_grads", "reduce_tensor_parallel_grads", "sum_tied_embedding"]
