"""Collectives that the engine runs, each one recorded when a ``record_comm()`` block is active.

Everything that crosses ranks in the model goes through these functions, so communication can be counted
exactly (kind, group size, elements, bytes) and compared against theory.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CommEvent:
    """One collective: ``kind`` (all_reduce, all_gather, reduce_scatter, ...), its group size and payload."""

    kind: str
    group_size: int
    elements: int
    bytes: int
    tag: str = ""


@dataclass
class CommLog:
    """Events recorded inside one ``record_comm()`` block, in call order."""

    events: list[CommEvent] = field(default_factory=list)

    def count(self, kind: str | None = None, tag: str | None = None) -> int:
        return sum(1 for e in self._select(kind, tag))

    def total_bytes(self, kind: str | None = None, tag: str | None = None) -> int:
        return sum(e.bytes for e in self._select(kind, tag))

    def by_kind(self) -> dict[str, int]:
        """Bytes per collective kind."""
        out: Counter[str] = Counter()
        for e in self.events:
            out[e.kind] += e.bytes
        return dict(out)

    def _select(self, kind: str | None, tag: str | None) -> Iterator[CommEvent]:
        return (e for e in self.events if (kind is None or e.kind == kind) and (tag is None or e.tag == tag))


_active: list[CommLog] = []
_tags: list[str] = []


@contextlib.contextmanager
def record_comm() -> Iterator[CommLog]:
    """Record every collective issued through this module (forward and backward) while the block runs."""
    log = CommLog()
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)


@contextlib.contextmanager
def comm_tag(tag: str) -> Iterator[None]:
    """Label the collectives issued inside the block (e.g. "embedding", "loss", "layer")."""
    _tags.append(tag)
    try:
        yield
    finally:
        _tags.pop()


def _record(kind: str, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if _active:
        event = CommEvent(
            kind=kind,
            group_size=dist.get_world_size(group),
            elements=tensor.numel(),
            bytes=tensor.numel() * tensor.element_size(),
            tag=_tags[-1] if _tags else "",
        )
        for log in _active:
            log.events.append(event)


class CollectiveObserver(Protocol):
    """Told when this rank blocks in a collective and when it returns (a flight recorder, for hang reports)."""

    def wait(self, label: str) -> None: ...

    def done_waiting(self) -> None: ...


_observer: CollectiveObserver | None = None


def set_collective_observer(observer: CollectiveObserver | None) -> None:
    """Report every blocking collective of this process to ``observer`` (None: stop)."""
    global _observer
    _observer = observer


@contextlib.contextmanager
def _blocking(kind: str, group: dist.ProcessGroup | None) -> Iterator[None]:
    observer = _observer
    if observer is None:
        yield
        return
    observer.wait(f"{kind} over {dist.get_world_size(group)} ranks")
    try:
        yield
    finally:
        observer.done_waiting()


# torch renamed all_gather_into_tensor; keep working on releases before the rename
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# -- collective algorithms ------------------------------------------------------------------------------------
#
# gloo runs a collective through its worker threads and a ring of 2(t-1) steps; on loopback each step is a
# thread hand-off, so a small all-reduce is latency-bound (about 1-2 ms for 4 KiB over 2 ranks on a 2-core
# machine), while a pair of point-to-point messages costs a few hundred microseconds. For small power-of-two
# groups on gloo the collectives below therefore run as recursive doubling over torch.distributed's own
# isend/irecv (log2 t rounds, each an exchange with rank ^ 2^k), the latency-optimal textbook algorithm:
#
#   all-reduce       round k: swap the whole partial sum with rank ^ 2^k, add        (t=4: 2 rounds, 2 n sent)
#   all-gather       round k: swap the 2^k blocks gathered so far with rank ^ 2^k    (t-1 blocks sent)
#   reduce-scatter   recursive halving: send the half the partner keeps, add the half received
#
# Every rank adds the same two operands in the same order up to commutativity (a + b == b + a bit for bit), so
# all ranks end with identical results; the summation order may differ from gloo's ring by an ulp. NCCL (GPU)
# keeps its native collectives. ``set_collective_algorithm`` picks the policy (recipe: parallel.collectives).

COLLECTIVE_ALGORITHMS = ("auto", "native", "exchange")
EXCHANGE_MAX_BYTES = 1 << 20  # auto: above this (and more than 2 ranks), gloo's bandwidth-optimal ring wins
_algorithm = "auto"
_EXCHANGE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


def set_collective_algorithm(name: str) -> None:
    """``auto``: exchange for small power-of-two gloo groups (any size for 2 ranks), native otherwise;
    ``native``: always the backend's own collectives; ``exchange``: always exchange on power-of-two groups."""
    global _algorithm
    if name not in COLLECTIVE_ALGORITHMS:
        raise ValueError(f"collective algorithm {name!r} is not one of {COLLECTIVE_ALGORITHMS}")
    _algorithm = name


def collective_algorithm() -> str:
    return _algorithm


def _uses_exchange(group: dist.ProcessGroup | None, nbytes: int, op=dist.ReduceOp.SUM) -> bool:
    if _algorithm == "native" or not any(op == known for known in _EXCHANGE_OPS):
        return False
    size = dist.get_world_size(group)
    if size < 2 or size & (size - 1):
        return False
    if _algorithm == "exchange":
        return True
    return dist.get_backend(group) == "gloo" and (size == 2 or nbytes <= EXCHANGE_MAX_BYTES)


def _combine(acc: torch.Tensor, other: torch.Tensor, op) -> None:
    if op == dist.ReduceOp.SUM:
        acc.add_(other)
    elif op == dist.ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    else:
        torch.minimum(acc, other, out=acc)


def _swap(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None, peer: int) -> list:
    """Post the send of ``send`` to group rank ``peer`` and the receive of its message into ``recv``."""
    peer = dist.get_global_rank(group, peer) if group is not None else peer
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    return dist.batch_isend_irecv(ops)


class _ExchangeAllReduce:
    """Recursive-doubling all-reduce in flight; ``wait()`` finishes the remaining rounds (``dist.Work``-like)."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, op):
        self.tensor, self.group, self.op = tensor, group, op
        self.me, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.flat = tensor.view(-1)  # callers pass contiguous tensors only
        self.buf = torch.empty_like(self.flat)
        self.distance = 1
        self.pending = _swap(self.flat, self.buf, group, self.me ^ 1)

    def wait(self) -> bool:
        while self.pending:
            for work in self.pending:
                work.wait()
            _combine(self.flat, self.buf, self.op)
            self.distance *= 2
            self.pending = (
                _swap(self.flat, self.buf, self.group, self.me ^ self.distance) if (self.distance < self.size) else []
            )
        return True


def _exchange_all_gather(out: torch.Tensor, part: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """out [t*n, ...] <- every rank's ``part`` [n, ...] in rank order, by recursive doubling."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    blocks = out.view(size, *part.shape)
    blocks[me].copy_(part)
    distance = 1
    while distance < size:
        mine, theirs = me & ~(distance - 1), (me ^ distance) & ~(distance - 1)
        for work in _swap(blocks[mine : mine + distance], blocks[theirs : theirs + distance], group, me ^ distance):
            work.wait()
        distance *= 2


def _exchange_reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """out [n, ...] <- block ``rank`` of the sum over ranks of ``full`` [t*n, ...], by recursive halving."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    acc = full.reshape(size, *out.shape).clone()
    lo, span = 0, size
    while span > 1:
        half = span // 2
        keep = lo + (half if me & half else 0)
        give = lo + (0 if me & half else half)
        buf = torch.empty_like(acc[keep : keep + half])
        for work in _swap(acc[give : give + half], buf, group, me ^ half):
            work.wait()
        acc[keep : keep + half].add_(buf)
        lo, span = keep, half
    out.copy_(acc[me])


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` (contiguous) over ``group``; returns it."""
    _record("all_reduce", tensor, group)
    with _blocking("all_reduce", group):
        if _uses_exchange(group, tensor.numel() * tensor.element_size(), op) and tensor.is_contiguous():
            _ExchangeAllReduce(tensor, group, op).wait()
        else:
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (records the gathered output size)."""
    world = dist.get_world_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0], *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _record("all_gather", out, group)
    with _blocking("all_gather", group):
        if _uses_exchange(group, out.numel() * out.element_size()):
            _exchange_all_gather(out, moved, group)
        else:
            _all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Sum ``tensor`` over ranks and keep this rank's slice along ``dim`` (records the input size)."""
    world = dist.get_world_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    if moved.shape[0] % world:
        raise ValueError(f"reduce_scatter: dim {dim} of size {moved.shape[0]} is not divisible by {world} ranks")
    out = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _record("reduce_scatter", moved, group)
    with _blocking("reduce_scatter", group):
        if _uses_exchange(group, moved.numel() * moved.element_size()):
            _exchange_reduce_scatter(out, moved, group)
        else:
            dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def all_reduce_async(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM):
    """Start an in-place all-reduce of ``tensor`` over ``group`` and return its handle (``.wait()`` before reading).

    The caller must not touch ``tensor`` until the handle is waited on; it lets gradient buckets reduce while
    backward is still computing the rest. Handles of one group must be waited on in the order they were made.
    """
    _record("all_reduce", tensor, group)
    if _uses_exchange(group, tensor.numel() * tensor.element_size(), op) and tensor.is_contiguous():
        return _ExchangeAllReduce(tensor, group, op)
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


# -- tensor-parallel regions (autograd-aware) --------------------------------------------------------------
#
# Megatron's conjugate pairs: each op's backward is the other's forward, so a column-parallel layer followed by
# a row-parallel one costs one collective forward and one backward.
#
#   op                                   forward          backward
#   copy_to_tp_region          (f)       identity         all-reduce
#   reduce_from_tp_region      (g)       all-reduce       identity
#   gather_from_sequence_region (f, SP)  all-gather       reduce-scatter
#   reduce_scatter_to_sequence_region    reduce-scatter   all-gather     (g, SP)
#   scatter_to_sequence_region           split            all-gather
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


def _current_tag() -> str:
    return _tags[-1] if _tags else ""


class _ColumnParallelMatmul(torch.autograd.Function):
    """``f`` fused with the column-parallel matmul, so backward overlaps the all-reduce of the input gradient
    with the weight-gradient matmul (Megatron's asynchronous grad all-reduce). Same collectives as
    ``copy_to_tp_region`` followed by ``F.linear``; autocast-safe (backward casts to the gradient's dtype)."""

    @staticmethod
    def forward(ctx, x, weight, tp):
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.tag = tp, _current_tag()
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
        with _blocking("all_reduce", ctx.tp.group):
            work.wait()
        return grad_x, grad_w, None


def column_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """``copy_to_tp_region(x) @ weight.T`` with the backward all-reduce overlapped. x: [..., in] -> [..., out/t]."""
    if tp.size == 1:
        return torch.nn.functional.linear(x, weight)
    return _ColumnParallelMatmul.apply(x, weight, tp)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.tag = tp, _current_tag()
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


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim, ctx.tag = tp, dim, _current_tag()
        return all_gather(x, tp.group, dim)

    @staticmethod
    def backward(ctx, grad):
        with comm_tag(ctx.tag):
            return reduce_scatter(grad, ctx.tp.group, ctx.dim), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim, ctx.tag = tp, dim, _current_tag()
        return reduce_scatter(x, tp.group, dim)

    @staticmethod
    def backward(ctx, grad):
        with comm_tag(ctx.tag):
            return all_gather(grad, ctx.tp.group, ctx.dim), None, None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim, ctx.tag = tp, dim, _current_tag()
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
