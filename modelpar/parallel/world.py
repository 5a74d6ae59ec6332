"""Process-group set-up: where a rank comes from (torchrun, SLURM or arguments) and its parallel groups.

torch.distributed is the only transport: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from modelpar.parallel import collective_trace

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
    collective_trace.enable()  # torch's flight recorder of collectives, read back by hang reports
    url = init_method or f"tcp://{env.master_addr}:{env.master_port}"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if init_method is None and env.source == "torchrun" and restart not in (None, "0"):
        # torchrun --max-restarts keeps its rendezvous store across restarts: the gloo/NCCL addresses the last
        # attempt's ranks published there are stale, so each attempt meets under its own prefix
        store, _, _ = next(rendezvous(f"{url}?rank={env.rank}&world_size={env.world_size}", timeout=_timeout))
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(f"attempt-{restart}/", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=_timeout,
        )
        return env
    dist.init_process_group(
        backend=backend, init_method=url, rank=env.rank, world_size=env.world_size, timeout=_timeout
    )
    return env


_on_destroy: list[Callable[[], None]] = []  # forget what was built on this world (cached groups)


def on_destroy(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever ``destroy_distributed`` tears the world down."""
    _on_destroy.append(callback)


def world_timeout() -> datetime.timedelta:
    """The collective timeout the world was initialised with; every group we create inherits it."""
    return _timeout


def destroy_distributed() -> None:
    """Tear down the default group and forget everything built on it."""
    for callback in _on_destroy:
        callback()
    if dist.is_initialized():
        dist.destroy_process_group()
