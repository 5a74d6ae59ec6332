"""Where Muon's matrices live, and how a step orthogonalises each one whole, whatever the layout.

Muon's momentum is elementwise, so every optimizer keeps it on the pieces it updates (whole tp-local
parameters, ZeRO-1's flat segments, FSDP2's dp shards). Newton-Schulz is not: it needs each *logical* matrix
whole, the single-device model's ``q_proj.weight`` (not the fused q/k/v block, whose singular values mix three
matrices: orthogonalising the block would make q, k and v share one spectrum, and would change with how many
heads a tp rank fuses), one expert's ``w1``, a ``down_proj`` split over tp by columns.

``MuonLayout`` numbers every Muon matrix of this pipeline stage (the union over its tp x dp x cp ranks, so
experts held elsewhere under ep too) into one flat index space, and gives each local parameter the position
of every element in it. One step of ``orthogonalise``::

    U:  each rank writes the updates of the elements it is the one writer of   -> all-reduce over tp, dp x cp
    O:  each matrix's owner runs Newton-Schulz on it whole (owners balanced by NS FLOPs), zeros elsewhere
                                                                               -> all-reduce over tp, dp x cp
    every rank reads its pieces' O back by position

A sum of one value and zeros is that value, so the result is bit-identical to one device's. The one writer
of an element: a tp-replicated piece's primary rank, and under ZeRO-0 dp x cp rank 0 (experts: the first
rank holding them); ZeRO-1/2/3 segments and dp shards are held once already. The flat buffers hold the
stage's Muon matrices whole (two all-reduces of them per step): simple and exact, sized for the models this
runs; the owner assignment is what spreads the Newton-Schulz work, ``1/(tp x dp x cp)`` of it per rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from modelpar.model.layers.shard import ShardInfo
from modelpar.optim.muon import MuonSettings, adjust_ratio, newton_schulz, newton_schulz_flops, split_rows
from modelpar.parallel import collectives


@dataclass(frozen=True)
class Matrix:
    """One matrix Newton-Schulz runs on: a logical Muon matrix of the stage (or, per head, a block of its rows,
    named ``name[a:b]``), its shape, place in the flat buffer, owner rank."""

    name: str
    shape: tuple[int, int]
    offset: int
    owner: int  # index in the stage (dp_cp_rank * tp + tp_rank)
    flops: int

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass
class MuonLayout:
    """Every Muon matrix of this stage and where this rank's parameters hold them (see the module docstring)."""

    settings: MuonSettings
    matrices: list[Matrix]
    positions: dict[int, torch.Tensor]  # id(param) -> long [param's tp-local shape], -1: no Muon matrix there
    writes: dict[int, torch.Tensor]  # id(param) -> bool, like positions: this rank writes the element's update
    stage_index: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    ratios: torch.Tensor = field(default=None)  # [total] float64: each element's matrix's lr ratio
    ns_flops_by_rank: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.matrices[-1].offset + self.matrices[-1].numel if self.matrices else 0

    def is_muon(self, param: torch.Tensor) -> bool:
        return id(param) in self.positions

    def my_ns_flops(self) -> int:
        """Newton-Schulz FLOPs this rank runs per step."""
        return self.ns_flops_by_rank[self.stage_index]

    def balance(self) -> float:
        """The busiest rank's Newton-Schulz FLOPs over the mean (1.0: perfectly even)."""
        total = sum(self.ns_flops_by_rank)
        return max(self.ns_flops_by_rank) * len(self.ns_flops_by_rank) / total if total else 1.0

    @torch.no_grad()
    def orthogonalise(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """``pieces``: ``(update, positions, writes)`` flat, of each piece this rank updates (an empty update
        for one without a gradient). Returns each piece's orthogonalised update (fp32, flat). Collective over
        the stage: every rank calls it every step, with its pieces in a fixed order."""
        device = pieces[0][0].device if pieces else torch.device("cpu")
        flat = torch.zeros(self.total, dtype=torch.float32, device=device)
        for update, pos, write in pieces:
            if update.numel():
                flat[pos[write]] = update.float()[write]
        self._sum_over_stage(flat)
        out = torch.zeros_like(flat)
        for m in self.matrices:
            if m.owner == self.stage_index:
                whole = flat[m.offset : m.offset + m.numel].view(m.shape)
                out[m.offset : m.offset + m.numel] = newton_schulz(whole, self.settings).float().reshape(-1)
        self._sum_over_stage(out)
        return [out[pos] for _, pos, _ in pieces]

    def _sum_over_stage(self, flat: torch.Tensor) -> None:
        with collectives.comm_tag("muon"):
            for group in (self.tp_group, self.dp_group):
                if group is not None:
                    collectives.all_reduce(flat, group)


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or None when it is this rank alone (nothing to reduce)."""
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _union(names: dict[str, tuple[int, int]], groups: Sequence[dist.ProcessGroup | None]) -> dict[str, tuple]:
    """Every rank's ``{name: shape}`` of ``groups`` merged (collective over each, in order)."""
    for group in groups:
        if group is None:
            continue
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, names, group=group)
        for theirs in everyone:
            names = names | theirs
    return names


def build_muon_layout(
    settings: MuonSettings,
    params: Sequence[torch.Tensor],
    shards: dict[str, ShardInfo],
    *,
    tp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    replica_writer: dict[int, bool],
) -> MuonLayout:
    """The layout of ``params`` (this rank's trainable parameters) whose logical tensors (``shards``, of all
    this rank's chunks) are all Muon matrices. ``dp_group``: the stage's ranks besides tp (dp x cp);
    ``replica_writer[id(param)]``: False where another dp rank writes the same values (ZeRO-0 replicas).
    Collective over tp and ``dp_group`` (the union of names)."""
    tp_group, dp_group = _group(tp_group), _group(dp_group)
    by_param: dict[int, list[tuple[str, ShardInfo]]] = {}
    for name, shard in shards.items():
        by_param.setdefault(id(shard.param), []).append((name, shard))
    muon = [
        p
        for p in params
        if by_param.get(id(p)) and all(settings.uses_muon(n, s.global_shape) for n, s in by_param[id(p)])
    ]
    local = {n: tuple(s.global_shape) for p in muon for n, s in by_param[id(p)]}
    names = _union(local, [tp_group, dp_group])
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    dp = 1 if dp_group is None else dist.get_world_size(dp_group)
    stage_index = (0 if dp_group is None else dist.get_rank(dp_group)) * tp + (
        0 if tp_group is None else dist.get_rank(tp_group)
    )
    # each logical matrix whole, or (q/k/v per head) as blocks of rows, contiguous in the flat buffer
    blocks, offset, where = [], 0, {}
    for name in sorted(names):
        rows, cols = names[name]
        step = split_rows(settings, name, (rows, cols))
        where[name] = offset
        for first in range(0, rows, step):
            blocks.append((name if step == rows else f"{name}[{first}:{first + step}]", (step, cols), offset))
            offset += step * cols
    # owners: the largest matrices first, each to the least loaded rank (ties: the lowest index)
    loads = [0] * (tp * dp)
    owner = {}
    for label, shape, _ in sorted(blocks, key=lambda b: (-newton_schulz_flops(b[1], settings.ns_steps), b[0])):
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        owner[label] = rank
        loads[rank] += newton_schulz_flops(shape, settings.ns_steps)
    flops = functools.partial(newton_schulz_flops, ns_steps=settings.ns_steps)
    matrices = [Matrix(label, shape, off, owner[label], flops(shape)) for label, shape, off in blocks]
    positions, writes = {}, {}
    for p in muon:
        local_shape = tuple(p.shape)  # a DTensor reports the tp-local (unsharded over dp) shape
        # on the host whatever the default device (the dry run's is meta): pieces copy theirs to their device
        pos = torch.full(local_shape, -1, dtype=torch.long, device="cpu")
        write = torch.zeros(local_shape, dtype=torch.bool, device="cpu")
        for name, shard in by_param[id(p)]:
            start, shape = where[name], names[name]
            block = torch.arange(start, start + shape[0] * shape[1], dtype=torch.long, device="cpu")
            block = block.view(shape)[shard.index]
            pos[shard.local_rows] = block
            write[shard.local_rows] = shard.primary and replica_writer.get(id(p), True)
        if bool((pos < 0).any()):
            raise ValueError(f"a Muon parameter {local_shape} has elements no logical matrix covers (padding?)")
        positions[id(p)], writes[id(p)] = pos, write
    ratios = torch.empty(offset, dtype=torch.float64, device="cpu")
    for m in matrices:
        ratios[m.offset : m.offset + m.numel] = adjust_ratio(settings.adjust_lr, m.shape)
    return MuonLayout(settings, matrices, positions, writes, stage_index, tp_group, dp_group, ratios, loads)


__all__ = ["Matrix", "MuonLayout", "build_muon_layout"]
