"""Start the ranks of a job: under torchrun/SLURM use their environment, otherwise spawn local processes.

Local spawning binds 127.0.0.1 and watches every rank: the first rank to fail is named with its error,
and the others are stopped, so a job never lingers after one of its ranks has died.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from modelpar.parallel.world import LOCAL_ADDR, destroy_distributed, init_distributed, launch_env_from_environ

_STOP_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """A rank failed; the message names it and carries its error."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCAL_ADDR, 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, timeout_s, threads, rank_setup, fn, args, errors) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR=LOCAL_ADDR,
        MASTER_PORT=str(port),
    )
    if rank_setup is not None:
        rank_setup(rank)
    import torch

    torch.set_num_threads(threads)
    try:
        init_distributed(timeout_s=timeout_s)
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then the rank exits non-zero
        errors.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        destroy_distributed()


def launch(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 300.0,
    threads_per_rank: int = 1,
    flight_dir: str | None = None,
    rank_setup: Callable[[int], None] | None = None,
) -> None:
    """Run ``fn(*args)`` on every rank of a ``world_size`` job.

    Under torchrun or SLURM this process is one rank: it joins the job described by the environment.
    Otherwise ``world_size`` local processes are spawned (gloo on CPU, one per GPU with NCCL).
    ``rank_setup(local_rank)`` runs first in every rank process, before torch starts its threads (a backend's
    core binding, ``modelpar.backends.rank_setup``).
    Raises ``LaunchError`` naming the first rank that failed; with ``flight_dir`` (where the ranks' flight
    recorders write), the message also names the rank that stopped making progress and its action.
    """
    env = launch_env_from_environ()
    if env is not None:
        if env.world_size != world_size:
            raise LaunchError(
                env.rank,
                f"the recipe's layout needs {world_size} ranks but {env.source} started {env.world_size}; "
                f"launch {world_size} processes or change parallel.dp",
            )
        if rank_setup is not None and int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) > 1:
            rank_setup(env.local_rank)
        init_distributed(timeout_s=timeout_s)
        try:
            fn(*args)
        finally:
            destroy_distributed()
        return

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                r,
                world_size,
                port,
                timeout_s,
                threads_per_rank,
                rank_setup if world_size > 1 else None,
                fn,
                args,
                errors,
            ),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        _watch(procs, errors, flight_dir)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=_STOP_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()


def _watch(procs: list, errors, flight_dir: str | None) -> None:
    """Wait for every rank; on the first failure, give the others a moment to report, then raise."""
    while True:
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            reports = _drain(errors, deadline=time.monotonic() + _STOP_GRACE_S)
            alive = [r for r, p in enumerate(procs) if p.exitcode is None]
            hang = _hang_summary(flight_dir, alive)
            killed = [r for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0]
            if killed:  # a rank killed by a signal is the cause; the errors of its peers are the consequence
                rank = killed[0]
                after = f"; ranks {sorted(reports)} failed after it" if reports else ""
                name = signal.Signals(-procs[rank].exitcode).name
                raise LaunchError(rank, f"rank {rank} died (signal {name}){after}; the other ranks were stopped{hang}")
            if reports:
                rank = next(iter(reports))  # the first to report is the likeliest cause; the rest follow it
                message, trace = reports[rank]
                raise LaunchError(rank, f"rank {rank} failed: {message}\n{trace.rstrip()}{hang}")
            rank = failed[0]
            code = procs[rank].exitcode
            raise LaunchError(rank, f"rank {rank} died (exit code {code}); the other ranks were stopped{hang}")
        if all(p.exitcode == 0 for p in procs):
            return
        time.sleep(0.05)


def _hang_summary(flight_dir: str | None, alive: list[int]) -> str:
    """The flight recorders' account of who was stuck where, when there are records to read."""
    if flight_dir is None:
        return ""
    from modelpar.training.flight import hang_report, read_flight

    snapshots = read_flight(flight_dir)
    if not snapshots:
        return ""
    return "\n" + hang_report(snapshots, suspects=alive or None)


def _drain(errors, deadline: float) -> dict[int, tuple[str, str]]:
    reports: dict[int, tuple[str, str]] = {}
    while time.monotonic() < deadline:
        try:
            rank, message, trace = errors.get(timeout=0.1)
        except queue.Empty:
            if reports:
                break
            continue
        reports[rank] = (message, trace)
    return reports
