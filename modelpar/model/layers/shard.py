"""Logical tensors: where this rank's piece of each global (single-device) weight lives.

A sharded layer may fuse several logical tensors into one local parameter (q, k and v in one column-parallel
weight) and may pad one (the vocabulary rounded up to a multiple of tp). A ``ShardInfo`` says, for one logical
tensor, which rows of which local parameter hold it and which block of the global tensor they are::

    global q_proj.weight [hq*d, h]          local qkv_proj.weight [(hq + 2*hkv)*d / t, h]   (tp rank 1 of 2)
    +---------+                             +---------+
    | rank 0  |                             |  q  1/2 |  <- local_rows  <->  index = (slice(hq*d/2, hq*d), slice(None))
    +---------+                             +---------+
    | rank 1  |                             |  k  1/2 |
    +---------+                             |  v  1/2 |
                                            +---------+

Checkpoints save ``shard.tensor`` with ``shard.index``; loading copies ``global[shard.index]`` into it, so any
tp can read weights written by any other. ``load_full_weights`` does the same for one layer, from full weights in
memory (``layer.load_full(weight)``), so a shard can be compared with its single-device twin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from modelpar.parallel.dtensors import is_dtensor


@dataclass(frozen=True, eq=False)
class ShardInfo:
    """This rank's piece of one logical tensor.

    ``param[local_rows]`` (rows along dim 0 of the local, possibly fused, parameter; an int picks one entry of a
    stacked parameter, e.g. one expert of a MoE layer's [experts, f, h] weight) holds
    ``global[index]``: the range ``offset .. offset + local_shape[dim]`` along ``dim`` (None: the whole tensor).
    ``replicated_over_tp``: other tp ranks hold the same values; ``primary`` marks the lowest such rank, the one
    that saves them. ``grad_is_partial``: the local gradient is only this rank's contribution and
    ``reduce_tensor_parallel_grads`` sums it over the ranks holding the same values.

    Primary pieces tile every logical tensor exactly once, so a global gradient norm counts each element once as
    the sum of ``shard.grad.square().sum()`` over primary shards, all-reduced over tp and pp. (A fused parameter
    can mix sharded and replicated rows, e.g. q with replicated k/v: count per shard, not per parameter.)
    """

    param: nn.Parameter
    local_rows: slice | int
    global_shape: tuple[int, ...]
    dim: int | None = None
    offset: int = 0
    replicated_over_tp: bool = False
    primary: bool = True
    grad_is_partial: bool = False

    @property
    def tensor(self) -> torch.Tensor:
        """The local piece, a view sharing storage with the parameter (writes go into the model)."""
        return self.param.detach()[self.local_rows]

    @property
    def grad(self) -> torch.Tensor | None:
        """The local piece of the parameter's gradient (None before backward)."""
        return None if self.param.grad is None else self.param.grad[self.local_rows]

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def index(self) -> tuple[slice, ...]:
        """Slices that cut this rank's piece out of the global tensor."""
        return self._index(self.local_shape)

    def _index(self, local_shape: tuple[int, ...]) -> tuple[slice, ...]:
        if self.dim is None:
            return tuple(slice(None) for _ in self.global_shape)
        size = local_shape[self.dim]
        return tuple(
            slice(self.offset, self.offset + size) if d == self.dim else slice(None)
            for d in range(len(self.global_shape))
        )

    def piece_of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]] | None:
        """The part of this logical tensor that ``tensor`` holds, and the block of the global tensor it is.

        ``tensor`` is ``param`` or its gradient: ``(tensor[local_rows], index)``. Under ZeRO-2/3 it may be
        the dp shard FSDP2 keeps of either (a DTensor whose rank holds a ``torch.chunk``-style slice of dim
        0): then only the rows of ``local_rows`` inside that slice, a view into the local shard, and where
        they sit; None when the shard holds none of them. Reads shapes only (no collective)."""
        if not is_dtensor(tensor):
            return tensor[self.local_rows], self.index
        mine = tensor.to_local()
        mesh = tensor.device_mesh
        rank, size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)  # the shard dim is the last
        rows = tensor.shape[0]
        start = min(rank * -(-rows // size), rows)
        stop = start + mine.shape[0]
        if isinstance(self.local_rows, int):  # one entry of a stacked parameter
            if not start <= self.local_rows < stop:
                return None
            return mine[self.local_rows - start], self._index(tuple(tensor.shape[1:]))
        first, last, _ = self.local_rows.indices(rows)
        lo, hi = max(first, start), min(last, stop)
        if lo >= hi:
            return None
        index = list(self._index((last - first, *tensor.shape[1:])))
        base = index[0].start or 0  # global row of local row ``first``
        index[0] = slice(base + lo - first, base + hi - first)
        return mine[lo - start : hi - start], tuple(index)


@dataclass(frozen=True)
class ColumnPart:
    """One logical tensor fused into a column-parallel weight: rows ``offset .. offset + size`` of its ``rows``.

    ``replicas``: how many tp ranks hold the same rows (> 1 for kv heads replicated when kv_heads < tp);
    ``primary``: this rank is the lowest of them. Local rows past ``rows - offset`` are padding. Only fused or
    unevenly split layers need these: ``ColumnParallelLinear(in, out, tp)`` with an int ``out`` makes its own.
    """

    name: str
    rows: int
    offset: int
    size: int
    replicas: int = 1
    primary: bool = True

    @classmethod
    def even(cls, name: str, rows: int, tp_rank: int, tp_size: int) -> ColumnPart:
        """Rows split evenly: rank r holds block r of ``tp_size``."""
        if rows % tp_size:
            raise ValueError(f"{name}: {rows} rows do not split over tp={tp_size}")
        size = rows // tp_size
        return cls(name, rows, tp_rank * size, size)


@torch.no_grad()
def load_full_weights(shards: Mapping[str, ShardInfo], weights: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
    """Copy ``full[shard.index]`` into each shard, from the full (single-device) value of each logical tensor.

    ``weights``: one tensor when ``shards`` holds one logical tensor, else ``{name: full tensor}`` for each.
    Padded local rows (vocabulary rounded up to a multiple of tp) are left as they are.
    """
    if isinstance(weights, torch.Tensor):
        if len(shards) != 1:
            raise ValueError(f"this layer fuses {sorted(shards)}: pass {{name: full weight}} for each")
        weights = {next(iter(shards)): weights}
    if set(weights) != set(shards):
        raise ValueError(f"got full weights for {sorted(weights)}, the layer holds {sorted(shards)}")
    for name, shard in shards.items():
        full = weights[name]
        if tuple(full.shape) != shard.global_shape:
            raise ValueError(f"{name}: got shape {tuple(full.shape)}, expected the full {shard.global_shape}")
        shard.tensor.copy_(full[shard.index])
