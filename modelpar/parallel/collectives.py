"""Collectives that the engine runs: torch.distributed's own, observable from outside.

Everything that crosses ranks in the model goes through these functions, so communication can be counted
exactly (kind, group size, elements, bytes) while a ``record_comm()`` block is active, and a blocking
collective is reported to an observer (the flight recorder) when one is set. A transport backend may install
a ``CollectiveAlgorithm`` that runs some collectives its own way (``modelpar.backends.gloo_cpu``); without one,
every call goes straight to torch.distributed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from modelpar.parallel import handoff


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


class _TagStack(threading.local):
    """``comm_tag`` labels, one stack per thread: two paired micro-batches (``modelpar.parallel.handoff``)
    each label their own collectives."""

    def __init__(self) -> None:
        self.stack: list[str] = []


_tags = _TagStack()


@contextlib.contextmanager
def record_comm() -> Iterator[CommLog]:
    """Record every collective issued through this module (forward and backward) while the block runs."""
    log = CommLog()
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)


def label_module(module: torch.nn.Module, tag: str) -> None:
    """Label the collectives ``module`` issues in its forward with ``tag`` (the tp region ops carry the label
    into backward), by hooks around its call: the module's own code never mentions communication."""
    module.register_forward_pre_hook(functools.partial(_push_tag, tag))
    module.register_forward_hook(_pop_tag, always_call=True)


def _push_tag(tag: str, module, args) -> None:
    _tags.stack.append(tag)


def _pop_tag(module, args, output) -> None:
    _tags.stack.pop()


@contextlib.contextmanager
def comm_tag(tag: str) -> Iterator[None]:
    """Label the collectives issued inside the block (e.g. "embedding", "loss", "layer")."""
    _tags.stack.append(tag)
    try:
        yield
    finally:
        _tags.stack.pop()


def current_tag() -> str:
    """The innermost ``comm_tag`` label ("" outside any)."""
    return _tags.stack[-1] if _tags.stack else ""


_sizes: dict = {}  # process group -> its size, asked of torch.distributed once
_native_avg: dict = {}  # process group -> whether its backend averages in the collective (NCCL)


def forget_sizes() -> None:
    """Drop the cached sizes (and so the references to groups about to be destroyed)."""
    _sizes.clear()
    _native_avg.clear()


def group_size(group: dist.ProcessGroup | None) -> int:
    """The size of ``group`` (None: the world), cached so the hot path never asks torch.distributed."""
    size = _sizes.get(group)
    if size is None:
        size = _sizes[group] = dist.get_world_size(group)
    return size


def _record(kind: str, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if _active:
        event = CommEvent(
            kind=kind,
            group_size=group_size(group),
            elements=tensor.numel(),
            bytes=tensor.numel() * tensor.element_size(),
            tag=_tags.stack[-1] if _tags.stack else "",
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


def profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A range named ``name`` in a ``torch.profiler`` trace while one records; nothing (and no cost) otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _profiled(kind: str) -> contextlib.AbstractContextManager:
    return profiler_range(f"{kind}:{_tags.stack[-1]}" if _tags.stack else kind)


@dataclass
class WaitLog:
    """Host seconds this process spent waiting in each kind of collective, and how many waits (``record_waits``)."""

    seconds: Counter = field(default_factory=Counter)
    count: Counter = field(default_factory=Counter)


_wait_logs: list[WaitLog] = []


@contextlib.contextmanager
def record_waits() -> Iterator[WaitLog]:
    """Time every wait in a collective (``blocking``) while the block runs, on every thread (a DualPipeV pair's
    forward runs on its own, which a ``torch.profiler`` trace started on this one does not see)."""
    log = WaitLog()
    _wait_logs.append(log)
    try:
        yield log
    finally:
        _wait_logs.remove(log)


@contextlib.contextmanager
def blocking(kind: str, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Tell the observer (if any) that this rank waits in collective ``kind`` over ``group`` until the block ends;
    a profiler trace shows the block as ``kind:tag``; ``record_waits`` times it."""
    observer = _observer
    start = time.perf_counter() if _wait_logs else 0.0
    with _profiled(kind):
        try:
            # inside a compiled block the observer's clock would break the graph (Dynamo warns on every rank)
            if observer is None or torch.compiler.is_compiling():
                yield
                return
            observer.wait(f"{kind} over {group_size(group)} ranks")
            try:
                yield
            finally:
                observer.done_waiting()
        finally:
            if _wait_logs:
                waited = time.perf_counter() - start
                for log in _wait_logs:
                    log.seconds[kind] += waited
                    log.count[kind] += 1


# torch renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn with a FutureWarning); keep
# working on releases before the rename
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveAlgorithm(Protocol):
    """Another way to run some collectives, installed by a transport backend (``install_algorithm``).

    Each method either runs the collective and returns a handle / True, or returns None / False to leave it to
    torch.distributed. Every rank of a group must make the same choice for the same call.
    """

    def all_reduce_async(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, op): ...

    def all_gather_into(self, out: torch.Tensor, part: torch.Tensor, group: dist.ProcessGroup | None) -> bool: ...

    def reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> bool: ...


_algorithm: CollectiveAlgorithm | None = None


def install_algorithm(algorithm: CollectiveAlgorithm | None) -> CollectiveAlgorithm | None:
    """Run collectives through ``algorithm`` from now on (None: torch.distributed only); returns the previous one."""
    global _algorithm
    previous, _algorithm = _algorithm, algorithm
    return previous


def installed_algorithm() -> CollectiveAlgorithm | None:
    return _algorithm


def wait_after_hand_over(work, kind: str, group: dist.ProcessGroup | None) -> None:
    """Wait on a posted collective ``kind`` after ``handoff.while_in_flight()`` let a paired micro-batch compute
    (a no-op outside a pair); the wait is what ``blocking`` observes, times and shows in a trace."""
    handoff.while_in_flight()
    with blocking(kind, group):
        work.wait()


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` (contiguous) over ``group``; returns it. Posted, then handed over
    (``handoff.while_in_flight``, as ``all_to_all``), then waited on."""
    _record("all_reduce", tensor, group)
    with profiler_range("post:all_reduce"):
        work = _post_all_reduce(tensor, group, op)
    wait_after_hand_over(work, "all_reduce", group)
    return tensor


class _DividedAfter:
    """A sum in flight whose ``wait()`` divides it by the group's size: ``ReduceOp.AVG`` where the backend has
    none (gloo); NCCL averages inside the collective, a pass over the tensor fewer."""

    def __init__(self, work, tensor: torch.Tensor, size: int):
        self.work, self.tensor, self.size = work, tensor, size

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.tensor.div_(self.size)
            self.work = None
        return True


def _post_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op):
    work = _algorithm.all_reduce_async(tensor, group, op) if _algorithm is not None else None
    if work is not None:
        return work
    if op == dist.ReduceOp.AVG:
        native = _native_avg.get(group)
        if native is None:
            native = _native_avg[group] = dist.get_backend(group) == "nccl"
        if not native:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
            return _DividedAfter(work, tensor, group_size(group))
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def _gather_buffers(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int):
    """``tensor`` with ``dim`` moved first (contiguous), and the empty gathered output of an all-gather of it."""
    world = group_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    return moved, torch.empty((world * moved.shape[0], *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)


def _scatter_buffers(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int):
    """``tensor`` with ``dim`` moved first (contiguous), and the empty output of a reduce-scatter of it."""
    world = group_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    if moved.shape[0] % world:
        raise ValueError(f"reduce_scatter: dim {dim} of size {moved.shape[0]} is not divisible by {world} ranks")
    return moved, torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (records the gathered output size)."""
    moved, out = _gather_buffers(tensor, group, dim)
    _record("all_gather", out, group)
    with blocking("all_gather", group):
        if _algorithm is None or not _algorithm.all_gather_into(out, moved, group):
            _all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Sum ``tensor`` over ranks and keep this rank's slice along ``dim`` (records the input size)."""
    moved, out = _scatter_buffers(tensor, group, dim)
    _record("reduce_scatter", moved, group)
    with blocking("reduce_scatter", group):
        if _algorithm is None or not _algorithm.reduce_scatter_into(out, moved, group):
            _reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


class _Done:
    """The handle of a collective that already ran (a ``CollectiveAlgorithm`` runs its own to completion)."""

    def wait(self) -> bool:
        return True


def all_gather_async(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0):
    """Start ``all_gather(tensor, group, dim)``; returns (handle, result): read the result only after
    ``wait_after_hand_over(handle, "all_gather", group)``. Records as ``all_gather`` does."""
    moved, out = _gather_buffers(tensor, group, dim)
    _record("all_gather", out, group)
    with _profiled("all_gather"):
        if _algorithm is not None and _algorithm.all_gather_into(out, moved, group):
            work = _Done()
        else:
            work = _all_gather_single(out, moved, group=group, async_op=True)
    return work, out.movedim(0, dim)


def reduce_scatter_async(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0):
    """Start ``reduce_scatter(tensor, group, dim)``; returns (handle, result), as ``all_gather_async``."""
    moved, out = _scatter_buffers(tensor, group, dim)
    _record("reduce_scatter", moved, group)
    with _profiled("reduce_scatter"):
        if _algorithm is not None and _algorithm.reduce_scatter_into(out, moved, group):
            work = _Done()
        else:
            work = _reduce_scatter_single(out, moved, group=group, async_op=True)
    return work, out.movedim(0, dim)


def all_reduce_async(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM):
    """Start an in-place all-reduce of ``tensor`` over ``group`` and return its handle (``.wait()`` before reading).

    The caller must not touch ``tensor`` until the handle is waited on; it lets gradient buckets reduce while
    backward is still computing the rest. Handles of one group must be waited on in the order they were made.
    ``op=ReduceOp.AVG`` is the mean on every backend (the sum divided by the group's size where it has none).
    """
    _record("all_reduce", tensor, group)
    with _profiled("all_reduce"):
        return _post_all_reduce(tensor, group, op)


def send_recv(
    send: torch.Tensor, recv: torch.Tensor, send_to: int, recv_from: int, group: dist.ProcessGroup | None
) -> list:
    """Post ``send`` to global rank ``send_to`` and a receive into ``recv`` from ``recv_from`` as one
    ``batch_isend_irecv`` (one step of a ring); returns the works to wait on. Records the bytes sent."""
    _record("send_recv", send, group)
    ops = [dist.P2POp(dist.isend, send, send_to, group), dist.P2POp(dist.irecv, recv, recv_from, group)]
    with _profiled("send_recv"):
        return dist.batch_isend_irecv(ops)


def all_to_all(
    tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Rows ``send_splits[r]`` of ``tensor`` (dim 0, in rank order) go to rank r; returns the rows received,
    ``recv_splits[r]`` from rank r, in rank order (uneven splits). Records the bytes this rank sends.

    Posted without waiting, then ``handoff.while_in_flight()`` lets a paired micro-batch compute (DualPipeV's
    overlapped pairs; nothing outside one) before the wait, which is all a trace's ``all_to_all:tag`` range
    shows: the exchange's exposed time."""
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
    _record("all_to_all", tensor, group)
    with profiler_range("post:all_to_all"):
        work = dist.all_to_all_single(out, tensor, recv_splits, send_splits, group=group, async_op=True)
    wait_after_hand_over(work, "all_to_all", group)
    return out
