"""Process-group set-up: where a rank comes from (torchrun, SLURM or arguments) and its parallel groups.

torch.distributed is the only transport: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from modelpar.parallel import collective_trace
from modelpar.parallel.admission import AdmissionSpec, admit

DEFAULT_TIMEOUT_S = 300.0
LOCAL_ADDR = "127.0.0.1"
# What a fork server loads once for the CPU ranks it forks (the launcher's and the warm pool's). ``torch._dynamo``
# is there because ``torch.optim.Optimizer.__init__`` imports it on first use: two CPU-seconds that every rank
# building an optimizer would otherwise pay after the fork, most of a tiny run's time in each rank.
RANK_PRELOAD = ("torch", "torch.distributed", "torch._dynamo")
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
    admission: AdmissionSpec | None = None,
) -> LaunchEnv:
    """Initialise the default process group from the launcher environment, or from the arguments.

    Local runs bind 127.0.0.1. Every collective inherits ``timeout_s``. ``init_method`` (for instance a
    ``file://`` store) replaces the TCP rendezvous; emulated ranks use it to avoid port races. With
    ``admission``, every rank proves it holds the job's secret before the group exists
    (``modelpar.parallel.admission``).
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
    # torchrun --max-restarts may keep its rendezvous store across restarts: the gloo/NCCL addresses the last
    # attempt's ranks published there are stale, so each attempt meets under its own prefix
    prefix = (
        f"attempt-{restart}/" if init_method is None and env.source == "torchrun" and restart not in (None, "0") else ""
    )
    store = rendezvous_store(env, url)
    if admission is not None:  # before the process group exists: no collective reaches a rank not admitted
        prefix += admit(store, env.rank, env.world_size, admission, _timeout)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(prefix, store) if prefix else store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=_timeout,
    )
    return env


def rendezvous_store(env: LaunchEnv, url: str) -> dist.Store:
    """The store the ranks meet through. Under torchrun the workers use its agent's store (a client, no new
    listener); otherwise rank 0 serves a TCP store listening on ``MASTER_ADDR`` only (torch's own would listen on
    every interface), or a ``file://`` store is opened."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not url.startswith("tcp://") or agent_store:
        store, _, _ = next(rendezvous(f"{url}?rank={env.rank}&world_size={env.world_size}", timeout=_timeout))
        store.set_timeout(_timeout)
        return store
    listen_fd = None
    if env.rank == 0:
        listen_fd = listen_on(env.master_addr, env.master_port)
    return dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=env.rank == 0,
        timeout=_timeout,
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def listen_on(addr: str, port: int) -> int:
    """A listening socket bound to ``addr:port`` alone, as a file descriptor for the store to serve on."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        raise RuntimeError(
            f"cannot listen on MASTER_ADDR:MASTER_PORT {addr}:{port} ({exc.strerror}); choose a free MASTER_PORT "
            "or an address of this host"
        ) from None
    sock.listen(1024)
    return sock.detach()


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
