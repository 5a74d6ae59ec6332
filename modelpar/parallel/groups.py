"""A layout's process groups on the initialised world, and this rank's coordinates in them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch.distributed as dist

from modelpar.parallel import collectives
from modelpar.parallel.layout import ParallelLayout
from modelpar.parallel.world import on_destroy, world_timeout

# observer(kind, ranks, create) -> group: wraps each dist.new_group of ParallelGroups.build (a backend that
# tracks per-group resources, e.g. gloo's socket threads, registers one)
GroupCreationObserver = Callable[[str, Sequence[int], Callable[[], dist.ProcessGroup]], dist.ProcessGroup]
_creation_observers: list[GroupCreationObserver] = []


def observe_group_creation(observer: GroupCreationObserver) -> None:
    """Route every later group creation of ``ParallelGroups.build`` through ``observer`` (once per observer)."""
    if observer not in _creation_observers:
        _creation_observers.append(observer)


# (kind, ranks) -> group, shared by every layout built on this world: a 4-rank world tried under a dozen
# layouts holds each distinct group once (each gloo group keeps a socket thread polling its epoll set, so
# idle duplicates cost CPU). Within one layout every kind keeps its own group, as collectives on different
# kinds may be ordered differently across ranks.
_groups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}
_kept: set[int] = set()  # ids of groups in _groups that release_groups leaves alone (keep_group)


def _new_group(kind: str, ranks: Sequence[int]) -> dist.ProcessGroup:
    """The group of ``ranks`` for ``kind``, created once per world. Every rank calls this for every group in
    the same order, so every rank reaches the same cache decision and the collective ``new_group`` calls
    stay matched."""
    key = (kind, tuple(ranks))
    if key not in _groups:
        create = functools.partial(dist.new_group, list(ranks), timeout=world_timeout(), group_desc=kind)
        for observer in _creation_observers:
            create = functools.partial(observer, kind, ranks, create)
        _groups[key] = create()
    return _groups[key]


def _member(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is a group this rank belongs to (torch marks the others with an int)."""
    return group is not None and group != dist.GroupMember.NON_GROUP_MEMBER


def held_groups() -> int:
    """How many groups this rank belongs to that ``ParallelGroups.build`` created and ``release_groups`` would
    destroy (kept groups do not count: releasing cannot lower them)."""
    return sum(_member(g) and id(g) not in _kept for g in _groups.values())


def keep_group(group: dist.ProcessGroup | None) -> None:
    """Exempt ``group`` from ``release_groups``: a DeviceMesh was made of it. DTensor caches sharding results by
    mesh, and meshes compare equal by ranks alone, so a later mesh of the same ranks must find this group alive
    (the next build of the same (kind, ranks) returns it)."""
    if _member(group):
        _kept.add(id(group))


def release_groups() -> None:
    """Destroy the groups ``ParallelGroups.build`` created on this world, except those ``keep_group`` named
    (the default group stays too).

    Collective in the sense that every rank must call it at the same point of its sequence of builds; the
    next ``build`` creates the groups again. Idle warm workers call it so their groups' socket threads stop.
    """
    released = {key: g for key, g in _groups.items() if id(g) not in _kept}
    for key in released:
        del _groups[key]
    ParallelGroups._cache.clear()
    collectives.forget_sizes()
    for group in released.values():
        if _member(group):
            dist.destroy_process_group(group)


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """This rank's process groups for one layout, plus its coordinates.

    Built collectively (every rank must call ``ParallelGroups.build`` with the same layout, in the same order).
    Groups are cached per layout, so building twice is free; ``destroy_distributed`` clears the cache.
    """

    layout: ParallelLayout
    rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    embedding_group: dist.ProcessGroup | None  # None on middle pipeline stages
    tp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    embedding_ranks: tuple[int, ...]
    # context parallelism: the cp ring, and the dp x cp ranks that hold the same weights (gradients reduce over
    # them); with cp=1 these are this rank alone and the dp group, no new group is made
    cp_group: dist.ProcessGroup | None = None
    cp_ranks: tuple[int, ...] = ()
    dp_cp_group: dist.ProcessGroup | None = None
    dp_cp_ranks: tuple[int, ...] = ()
    # expert parallelism: the ranks splitting the experts, and those holding the same experts (their gradients
    # reduce there); with ep=1 these are this rank alone and the dp x cp group, no new group is made
    ep_group: dist.ProcessGroup | None = None
    ep_ranks: tuple[int, ...] = ()
    expert_dp_group: dist.ProcessGroup | None = None
    expert_dp_ranks: tuple[int, ...] = ()

    _cache = {}  # layout -> ParallelGroups of this process

    @property
    def tp_rank(self) -> int:
        return self.tp_ranks.index(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.pp_ranks.index(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.dp_ranks.index(self.rank)

    @property
    def cp_rank(self) -> int:
        return self.cp_ranks.index(self.rank) if self.cp_ranks else 0

    @property
    def ep_rank(self) -> int:
        return self.ep_ranks.index(self.rank) if self.ep_ranks else 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @classmethod
    def build(cls, layout: ParallelLayout) -> ParallelGroups:
        """Create (or fetch cached) groups of ``layout`` on the initialised world."""
        layout = ParallelLayout(layout.tp, layout.pp, layout.dp, layout.vpp, layout.cp, layout.ep)
        key = (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep)
        if key in cls._cache:
            cached = cls._cache[key]
            return cached if cached.layout == layout else _with_layout(cached, layout)
        if not dist.is_initialized():
            raise RuntimeError("call init_distributed (or use modelpar.testing.run_on_ranks) before building groups")
        layout.check_world_size(dist.get_world_size())
        rank = dist.get_rank()
        mine = {}
        # new_group is collective over the whole world: every rank creates every group, in the same order.
        kinds = [
            ("tp", layout.all_tp_groups()),
            ("pp", layout.all_pp_groups()),
            ("dp", layout.all_dp_groups()),
            ("embedding", layout.all_embedding_groups()),
        ]
        if layout.cp > 1:
            kinds.append(("cp", layout.all_cp_groups()))
            if layout.dp > 1:
                kinds.append(("dp_cp", layout.all_dp_cp_groups()))
        if layout.ep > 1:
            kinds.append(("ep", layout.all_ep_groups()))
            if layout.ep < layout.dp * layout.cp:
                kinds.append(("expert_dp", layout.all_expert_dp_groups()))
        for kind, groups in kinds:
            for ranks in groups:
                group = _new_group(kind, ranks)
                if rank in ranks:
                    mine[kind] = (group, tuple(ranks))
        built = cls(
            layout=layout,
            rank=rank,
            tp_group=mine["tp"][0],
            pp_group=mine["pp"][0],
            dp_group=mine["dp"][0],
            embedding_group=mine["embedding"][0] if "embedding" in mine else None,
            tp_ranks=mine["tp"][1],
            pp_ranks=mine["pp"][1],
            dp_ranks=mine["dp"][1],
            embedding_ranks=mine["embedding"][1] if "embedding" in mine else (),
            cp_group=mine["cp"][0] if "cp" in mine else None,
            cp_ranks=mine["cp"][1] if "cp" in mine else (rank,),
            dp_cp_group=mine.get("dp_cp", mine.get("cp", mine["dp"]))[0],
            dp_cp_ranks=mine.get("dp_cp", mine.get("cp", mine["dp"]))[1],
            ep_group=mine["ep"][0] if "ep" in mine else None,
            ep_ranks=mine["ep"][1] if "ep" in mine else (rank,),
        )
        if "ep" in mine:  # experts split over all of dp x cp: each is held once, nothing to reduce
            expert_dp = mine.get("expert_dp", (None, (rank,)))
        else:
            expert_dp = (built.dp_cp_group, built.dp_cp_ranks)
        built = replace(built, expert_dp_group=expert_dp[0], expert_dp_ranks=expert_dp[1])
        cls._cache[key] = built
        return built

    def stage_group(self) -> dist.ProcessGroup | None:
        """Every rank of this rank's pipeline stage (tp x dp x cp), or None when that is this rank alone: the
        world when pp=1, else a group of its own, made the first time (collective over the world: every rank
        makes every stage's group, in order, as ``build`` does; ``_new_group`` keeps them)."""
        layout = self.layout
        if layout.world_size == layout.pp:
            return None
        if layout.pp == 1:
            return dist.group.WORLD
        mine = None
        for stage in range(layout.pp):
            ranks = [r for r in range(layout.world_size) if layout.coords(r).pp == stage]
            group = _new_group("stage", ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def context_split(self, a2a: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """This rank's two sub-groups of its cp group for hybrid context parallelism: the ``a2a`` consecutive cp
        ranks of its all-to-all group, and the ranks at its place in every such group (its ring).

        Collective over the world whenever the sub-groups do not exist yet (every rank makes every sub-group,
        in the same order, as ``build`` does); ``_new_group`` keeps them until ``release_groups``.
        """
        cp = self.layout.cp
        if a2a < 1 or cp % a2a:
            raise ValueError(f"an all-to-all group of {a2a} cp ranks must divide cp={cp}")
        every = self.layout.all_cp_groups()
        blocks = [ranks[i : i + a2a] for ranks in every for i in range(0, cp, a2a)]
        rings = [ranks[j::a2a] for ranks in every for j in range(a2a)]
        mine = {}
        for kind, groups in (("cp_a2a", blocks), ("cp_ring", rings)):
            for ranks in groups:
                group = _new_group(kind, ranks)
                if self.rank in ranks:
                    mine[kind] = group
        return mine["cp_a2a"], mine["cp_ring"]


def _with_layout(groups: ParallelGroups, layout: ParallelLayout) -> ParallelGroups:
    """Same groups under a layout differing only in vpp (vpp changes no process group)."""
    return replace(groups, layout=layout)


on_destroy(ParallelGroups._cache.clear)
on_destroy(_groups.clear)
on_destroy(_kept.clear)
