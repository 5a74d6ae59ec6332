"""Collectives that the engine runs, each one recorded when a ``record_comm()`` block is active.

Everything that crosses ranks in the model goes through these functions, so communication can be counted
exactly (kind, group size, elements, bytes) and compared against theory.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

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


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group``; returns it."""
    _record("all_reduce", tensor, group)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (records the gathered output size)."""
    world = dist.get_world_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0], *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _record("all_gather", out, group)
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Sum ``tensor`` over ranks and keep this rank's slice along ``dim`` (records the input size)."""
    world = dist.get_world_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    if moved.shape[0] % world:
        raise ValueError(f"reduce_scatter: dim {dim} of size {moved.shape[0]} is not divisible by {world} ranks")
    out = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _record("reduce_scatter", moved, group)
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def all_reduce_async(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> dist.Work:
    """Start an in-place all-reduce of ``tensor`` over ``group`` and return its handle (``.wait()`` before reading).

    The caller must not touch ``tensor`` until the handle is waited on; it lets gradient buckets reduce while
    backward is still computing the rest.
    """
    _record("all_reduce", tensor, group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)
