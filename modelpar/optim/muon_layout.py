"""Where Muon's matrices live, and which rank orthogonalises each one whole, whatever the layout.

Muon's momentum is elementwise, so every optimizer keeps it on the pieces it updates (whole tp-local
parameters, ZeRO-1's flat segments, FSDP2's dp shards). Newton-Schulz is not: it needs each *logical* matrix
whole, the single-device model's ``q_proj.weight`` (not the fused q/k/v block, whose singular values mix three
matrices: orthogonalising the block would make q, k and v share one spectrum, and would change with how many
heads a tp rank fuses), one expert's ``w1``, a ``down_proj`` split over tp by columns.

``MuonLayout`` numbers every Muon matrix of this pipeline stage (the union over its tp x dp x cp ranks, so
experts held elsewhere under ep too) into one flat index space, gives each local parameter the position of
every element in it, and each matrix an owner: the largest matrices first, each to the least loaded rank of
the stage by Newton-Schulz FLOPs, so each rank does about ``1/(tp x dp x cp)`` of the work. The one writer of
an element (whose update its owner takes): a tp-replicated piece's primary rank, and under ZeRO-0 one of the
dp x cp replicas (experts: of the ranks holding them), each replica the writer of an even stretch of every
parameter's elements, so each sends its share; ZeRO-1/2/3 segments and dp shards are held once already.

A step moves each matrix's pieces to its owner and the results back with two all-to-alls over the stage
(``modelpar.optim.muon_exchange``; ``route`` plans one rank's side once): no rank holds more than its own
pieces and the matrices it owns, and the owner's input is the single device's, bit for bit.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from modelpar.model.layers.shard import ShardInfo
from modelpar.optim.muon import (
    MuonSettings,
    adjust_ratio,
    least_loaded_owners,
    newton_schulz,
    newton_schulz_batched,
    newton_schulz_flops,
    split_rows,
)
from modelpar.optim.muon_exchange import MatrixTable, Route, route, symmetric_route
from modelpar.parallel import collectives

EXPERTS = "*.experts.*"  # a routed expert's matrices (MoE), orthogonalised in batches of one shape


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
    stage_index: int  # this rank's rank in stage_group
    stage_group: dist.ProcessGroup | None  # the stage's tp x dp x cp ranks; None: this rank alone
    tp_group: dist.ProcessGroup | None = None
    ns_flops_by_rank: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        ms = self.matrices
        # experts of one shape are orthogonalised as one batch (on whichever rank owns them)
        first: dict[tuple[int, int], int] = {}
        batches = [first.setdefault(m.shape, i) if _is_expert(m.name) else i for i, m in enumerate(ms)]
        self.table = MatrixTable(
            starts=torch.tensor([m.offset for m in ms], dtype=torch.long, device="cpu"),
            owners=torch.tensor([m.owner for m in ms], dtype=torch.long, device="cpu"),
            numels=torch.tensor([m.numel for m in ms], dtype=torch.long, device="cpu"),
            ranks=max(len(self.ns_flops_by_rank), 1),
            batches=torch.tensor(batches, dtype=torch.long, device="cpu"),
        )
        ratios = [adjust_ratio(self.settings.adjust_lr, m.shape) for m in ms]
        self.matrix_ratios = torch.tensor(ratios, dtype=torch.float64, device="cpu")

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

    def ratios_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The learning-rate ratio (float64) of the matrix each flat position lies in."""
        return self.matrix_ratios[self.table.matrix_of(positions)]

    def route(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> Route:
        """This rank's side of every step's exchange for its ``pieces`` (``(positions, writes)``, flat host
        tensors, in the order each step passes their updates), its index tensors on ``device``. Collective over
        the stage, once; on the meta device (the dry run: no peer data) the route of a symmetric world."""
        shapes = [m.shape for m in self.matrices]
        if device.type == "meta":
            return symmetric_route(self.table, self.stage_index, shapes, pieces).to(device)
        return route(self.table, self.stage_index, shapes, pieces, self._transport).to(device)

    @torch.no_grad()
    def orthogonalise(self, route: Route, values: torch.Tensor) -> torch.Tensor:
        """What comes back for this rank's pieces (fp32, flat; ``route.spread`` places it) from their momentum
        updates ``values`` (fp32, flat, one piece after another; zeros for a piece without a gradient).
        Collective over the stage: every rank calls it every step."""
        return route.exchange(values, self._newton_schulz, self._transport)

    def _newton_schulz(self, batch: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """In ``ns_dtype``: the exchange copies it into its fp32 buffer."""
        if len(indices) == 1:
            return newton_schulz(batch[0], self.settings)
        return newton_schulz_batched(batch, self.settings)

    def _transport(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        if self.stage_group is None:
            return tensor
        with collectives.comm_tag("muon"):
            return collectives.all_to_all(tensor, send, recv, self.stage_group)


def _is_expert(name: str) -> bool:
    """Whether the logical matrix ``name`` is one routed expert's (``...mlp.experts.<id>.w1.weight``)."""
    return fnmatch.fnmatchcase(name, EXPERTS)


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or None when it is this rank alone (nothing to exchange)."""
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _union(names: dict[str, tuple[int, int]], group: dist.ProcessGroup | None) -> dict[str, tuple]:
    """Every rank's ``{name: shape}`` of ``group`` merged (collective over it)."""
    if group is None:
        return names
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
    stage_group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None = None,
    replicas: dict[int, tuple[int, int]],
) -> MuonLayout:
    """The layout of ``params`` (this rank's trainable parameters) whose logical tensors (``shards``, of all
    this rank's chunks) are all Muon matrices. ``stage_group``: every rank of this pipeline stage (tp x dp x
    cp); ``replicas[id(param)]``: ``(index, count)`` where ``count`` dp ranks hold the same values (ZeRO-0
    replicas): replica ``index`` writes the ``index``-th of ``count`` even stretches of the parameter's
    elements that this rank writes at all (tp: its primary rows), so each sends 1/count of them. Collective
    over ``stage_group`` (the union of names)."""
    stage_group, tp_group = _group(stage_group), _group(tp_group)
    by_param: dict[int, list[tuple[str, ShardInfo]]] = {}
    for name, shard in shards.items():
        by_param.setdefault(id(shard.param), []).append((name, shard))
    muon = [
        p
        for p in params
        if by_param.get(id(p)) and all(settings.uses_muon(n, s.global_shape) for n, s in by_param[id(p)])
    ]
    local = {n: tuple(s.global_shape) for p in muon for n, s in by_param[id(p)]}
    names = _union(local, stage_group)
    ranks = 1 if stage_group is None else dist.get_world_size(stage_group)
    stage_index = 0 if stage_group is None else dist.get_rank(stage_group)
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
    flops = functools.partial(newton_schulz_flops, ns_steps=settings.ns_steps)
    biggest_first = sorted(blocks, key=lambda b: (-flops(b[1]), b[0]))
    owners, loads = least_loaded_owners([flops(shape) for _, shape, _ in biggest_first], ranks)
    owner = {label: rank for (label, _, _), rank in zip(biggest_first, owners, strict=True)}
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
            write[shard.local_rows] = shard.primary
        index, count = replicas.get(id(p), (0, 1))
        if count > 1:  # ZeRO-0 replicas: this one writes its stretch of the elements written here only
            flat = write.view(-1)
            nth, n = flat.cumsum(0) - 1, int(flat.sum())
            flat &= (nth >= n * index // count) & (nth < n * (index + 1) // count)
        if bool((pos < 0).any()):
            raise ValueError(f"a Muon parameter {local_shape} has elements no logical matrix covers (padding?)")
        positions[id(p)], writes[id(p)] = pos, write
    return MuonLayout(settings, matrices, positions, writes, stage_index, stage_group, tp_group, loads)


__all__ = ["Matrix", "MuonLayout", "build_muon_layout"]
