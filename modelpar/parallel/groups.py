"""Process-group set-up: where a rank comes from (torchrun, SLURM or arguments) and its parallel groups.

torch.distributed is the only transport: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from modelpar.backends.gloo_cpu import gloo_socket_threads
from modelpar.parallel.layout import ParallelLayout

DEFAULT_TIMEOUT_S = 300.0
LOCAL_ADDR = "127.0.0.1"
_timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)  # of the world; every group we create inherits it


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "args"


def launch_env_from_environ(environ: dict[str, str] | None = None) -> LaunchEnv | None:
    """Read rank and rendezvous from torchrun (RANK/WORLD_SIZE/...) or SLURM (SLURM_PROCID/...); None if neither."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", LOCAL_ADDR),
            master_port=int(env.get("MASTER_PORT", 29500)),
            source="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if "MASTER_ADDR" not in env:
            raise RuntimeError(
                "SLURM job without MASTER_ADDR: export MASTER_ADDR=<first node's address> (and MASTER_PORT) "
                "in the batch script; modelpar never guesses a multi-node address"
            )
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env.get("MASTER_PORT", 29500)),
            source="slurm",
        )
    return None


def choose_backend() -> str:
    """NCCL when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    master_addr: str = LOCAL_ADDR,
    master_port: int = 29500,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    init_method: str | None = None,
) -> LaunchEnv:
    """Initialise the default process group from the launcher environment, or from the arguments.

    Local runs bind 127.0.0.1. Every collective inherits ``timeout_s``. ``init_method`` (for instance a
    ``file://`` store) replaces the TCP rendezvous; emulated ranks use it to avoid port races.
    """
    env = launch_env_from_environ()
    if env is None:
        if rank is None or world_size is None:
            raise RuntimeError("no torchrun/SLURM environment: pass rank= and world_size= to init_distributed")
        env = LaunchEnv(rank, world_size, rank, master_addr, master_port, "args")
    backend = backend or choose_backend()
    if backend == "gloo" and env.master_addr in (LOCAL_ADDR, "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    global _timeout
    _timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        init_method=init_method or f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=_timeout,
    )
    return env


def destroy_distributed() -> None:
    """Tear down the default group and forget every cached layout's groups."""
    ParallelGroups._cache.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


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
    # gloo socket threads (modelpar.backends.gloo_cpu) this rank's group of each kind brought along; empty on NCCL
    socket_threads: dict[str, tuple[int, ...]] = field(default_factory=dict)

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
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @classmethod
    def build(cls, layout: ParallelLayout) -> ParallelGroups:
        """Create (or fetch cached) groups of ``layout`` on the initialised world."""
        layout = ParallelLayout(layout.tp, layout.pp, layout.dp, layout.vpp)
        key = (layout.tp, layout.pp, layout.dp)
        if key in cls._cache:
            cached = cls._cache[key]
            return cached if cached.layout == layout else _with_layout(cached, layout)
        if not dist.is_initialized():
            raise RuntimeError("call init_distributed (or use modelpar.testing.run_on_ranks) before building groups")
        layout.check_world_size(dist.get_world_size())
        rank = dist.get_rank()
        mine = {}
        threads = {}
        gloo = dist.get_backend() == "gloo"  # each gloo group brings its own socket thread
        # new_group is collective over the whole world: every rank creates every group, in the same order.
        for kind, groups in (
            ("tp", layout.all_tp_groups()),
            ("pp", layout.all_pp_groups()),
            ("dp", layout.all_dp_groups()),
            ("embedding", layout.all_embedding_groups()),
        ):
            for ranks in groups:
                before = set(gloo_socket_threads()) if gloo else set()
                group = dist.new_group(ranks, timeout=_timeout)
                if rank in ranks:
                    mine[kind] = (group, tuple(ranks))
                    threads[kind] = tuple(sorted(set(gloo_socket_threads()) - before)) if gloo else ()
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
            socket_threads=threads,
        )
        cls._cache[key] = built
        return built


def _with_layout(groups: ParallelGroups, layout: ParallelLayout) -> ParallelGroups:
    """Same groups under a layout differing only in vpp (vpp changes no process group)."""
    from dataclasses import replace

    return replace(groups, layout=layout)
