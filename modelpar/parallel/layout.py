"""Parallel layout: how ``tp x cp x pp x dp`` ranks map onto the world.

Rank order is ``(dp, pp, cp, tp)`` with tp varying fastest, so the ranks of one tensor-parallel group are
neighbours (the GPUs of one node), then context-parallel ranks (the sequence split), then pipeline stages,
then data-parallel replicas::

    tp=2, pp=2, dp=2            rank = ((dp * pp + pp_rank) * cp + cp_rank) * tp + tp_rank
    rank : 0 1 2 3 4 5 6 7
    tp   : 0 1 0 1 0 1 0 1
    pp   : 0 0 1 1 0 0 1 1
    dp   : 0 0 0 0 1 1 1 1

With cp=1 the mapping is the ``tp x pp x dp`` one above. Weights are replicated over cp as over dp, so their
gradients are reduced over the ``dp x cp`` ranks of a (pp, tp) coordinate (``dp_cp_ranks``).

Expert parallelism (``ep``) adds no ranks: it is carved from the ``dp x cp`` ranks of each (pp, tp) coordinate,
in rank order, as in Megatron-Core: consecutive blocks of ``ep`` of them split the experts (``ep_ranks``), and
the ranks at the same position of every block hold the same experts (``expert_dp_ranks``, where expert
gradients are reduced)::

    dp=4, ep=2 (tp=pp=cp=1)     ranks 0 1 | 2 3      ep groups [0, 1], [2, 3]; expert dp groups [0, 2], [1, 3]

A layout is plain data: it builds no process groups (see ``modelpar.parallel.groups.ParallelGroups``), so any
number of layouts can coexist in one process.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """An impossible parallel layout; the message is one line naming the problem and a fix."""


@dataclass(frozen=True)
class RankCoords:
    """Coordinates of one rank in the layout."""

    dp: int
    pp: int
    tp: int
    cp: int = 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelLayout:
    """``tp`` tensor-parallel x ``cp`` context-parallel x ``pp`` pipeline stages x ``dp`` replicas; ``vpp``
    model chunks per stage; ``ep`` expert-parallel ranks inside ``dp x cp``."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise LayoutError(f"{name}={value!r} must be a positive integer")
            if value < 1:
                raise LayoutError(f"{name}={value} must be >= 1")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"vpp={self.vpp} needs pipeline parallelism; set pp >= 2 or vpp=1")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(
                f"ep={self.ep} must divide dp x cp = {self.dp * self.cp} (experts are split over ranks carved from "
                f"the data-parallel ones); try ep in {_divisors(self.dp * self.cp)}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of ``rank`` (tp fastest, then cp, then pp, then dp)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size} ({self})")
        inner = self.tp * self.cp
        return RankCoords(
            dp=rank // (inner * self.pp),
            pp=(rank // inner) % self.pp,
            tp=rank % self.tp,
            cp=(rank // self.tp) % self.cp,
        )

    def rank(self, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """Global rank at coordinates ``(dp, pp, tp, cp)``."""
        if not (0 <= dp < self.dp and 0 <= pp < self.pp and 0 <= tp < self.tp and 0 <= cp < self.cp):
            raise LayoutError(f"coordinates dp={dp} pp={pp} tp={tp} cp={cp} are outside {self}")
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def tp_ranks(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(c.dp, c.pp, t, c.cp) for t in range(self.tp)]

    def pp_ranks(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(c.dp, p, c.tp, c.cp) for p in range(self.pp)]

    def dp_ranks(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(d, c.pp, c.tp, c.cp) for d in range(self.dp)]

    def cp_ranks(self, rank: int) -> list[int]:
        """The context-parallel ranks of ``rank``, in ring order (cp coordinate 0, 1, ...)."""
        c = self.coords(rank)
        return [self.rank(c.dp, c.pp, c.tp, k) for k in range(self.cp)]

    def dp_cp_ranks(self, rank: int) -> list[int]:
        """Every rank holding the same weights as ``rank`` (its dp replicas x its cp ranks), ascending."""
        c = self.coords(rank)
        return sorted(self.rank(d, c.pp, c.tp, k) for d in range(self.dp) for k in range(self.cp))

    def ep_ranks(self, rank: int) -> list[int]:
        """The ranks splitting the experts with ``rank``: its block of ``ep`` consecutive dp x cp ranks."""
        same = self.dp_cp_ranks(rank)
        block = same.index(rank) // self.ep
        return same[block * self.ep : (block + 1) * self.ep]

    def expert_dp_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same experts as ``rank`` (the same position in every ep block)."""
        same = self.dp_cp_ranks(rank)
        return same[same.index(rank) % self.ep :: self.ep]

    def embedding_ranks(self, rank: int) -> list[int]:
        """First and last pipeline stage of ``rank``'s pipeline (one rank when pp == 1)."""
        stages = self.pp_ranks(rank)
        return sorted({stages[0], stages[-1]})

    def all_tp_groups(self) -> list[list[int]]:
        return [
            self.tp_ranks(self.rank(d, p, 0, k)) for d in range(self.dp) for p in range(self.pp) for k in range(self.cp)
        ]

    def all_pp_groups(self) -> list[list[int]]:
        return [
            self.pp_ranks(self.rank(d, 0, t, k)) for d in range(self.dp) for k in range(self.cp) for t in range(self.tp)
        ]

    def all_dp_groups(self) -> list[list[int]]:
        return [
            self.dp_ranks(self.rank(0, p, t, k)) for p in range(self.pp) for k in range(self.cp) for t in range(self.tp)
        ]

    def all_cp_groups(self) -> list[list[int]]:
        return [
            self.cp_ranks(self.rank(d, p, t, 0)) for d in range(self.dp) for p in range(self.pp) for t in range(self.tp)
        ]

    def all_dp_cp_groups(self) -> list[list[int]]:
        return [self.dp_cp_ranks(self.rank(0, p, t, 0)) for p in range(self.pp) for t in range(self.tp)]

    def all_ep_groups(self) -> list[list[int]]:
        firsts = [r for g in self.all_dp_cp_groups() for r in g[:: self.ep]]
        return [self.ep_ranks(r) for r in firsts]

    def all_expert_dp_groups(self) -> list[list[int]]:
        return [self.expert_dp_ranks(r) for g in self.all_dp_cp_groups() for r in g[: self.ep]]

    def all_embedding_groups(self) -> list[list[int]]:
        return [self.embedding_ranks(g[0]) for g in self.all_pp_groups()]

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise LayoutError(
                f"layout {self} needs {self.world_size} ranks but the world has {world_size}; "
                f"change dp to {world_size // (self.tp * self.cp * self.pp)} or launch {self.world_size} ranks"
                if world_size % (self.tp * self.cp * self.pp) == 0
                else f"layout {self} needs {self.world_size} ranks but the world has {world_size}; "
                f"tp*cp*pp={self.tp * self.cp * self.pp} must divide the world size"
            )

    def check_model(self, *, layers: int, heads: int, kv_heads: int, ffn_hidden: int) -> None:
        """Reject a layout that cannot shard a model of this shape (one line, with a fix)."""
        if heads % self.tp:
            raise LayoutError(f"tp={self.tp} does not divide heads={heads}; try tp in {_divisors(heads)}")
        if kv_heads % self.tp and self.tp % kv_heads:
            raise LayoutError(
                f"tp={self.tp} and kv_heads={kv_heads}: one must divide the other so kv heads shard or replicate "
                f"evenly; try tp in {[d for d in _divisors(heads) if kv_heads % d == 0 or d % kv_heads == 0]}"
            )
        if ffn_hidden % self.tp:
            raise LayoutError(
                f"tp={self.tp} does not divide ffn_hidden={ffn_hidden}; try tp in "
                f"{[d for d in _divisors(heads) if ffn_hidden % d == 0]}"
            )
        chunks = self.pp * self.vpp
        if chunks > layers:
            raise LayoutError(f"pp*vpp={chunks} exceeds the {layers} layers; use pp*vpp <= {layers}")

    def __str__(self) -> str:
        extra = f"-vpp{self.vpp}" if self.vpp > 1 else ""
        cp = f"-cp{self.cp}" if self.cp > 1 else ""
        ep = f"-ep{self.ep}" if self.ep > 1 else ""
        return f"tp{self.tp}{cp}-pp{self.pp}-dp{self.dp}{ep}{extra}"
