"""Start the ranks of a job: under torchrun/SLURM use their environment, otherwise spawn local processes.

Local spawning opens no listening socket beyond 127.0.0.1 (rendezvous through a file store in a private
directory; gloo's pairs on loopback) and watches every rank: the first rank to fail is named with its error,
and the others are stopped, so a job never lingers after one of its ranks has died.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path
from typing import Any

from modelpar.parallel.admission import AdmissionSpec
from modelpar.parallel.redact import redact
from modelpar.parallel.world import (
    LOCAL_ADDR,
    RANK_PRELOAD,
    destroy_distributed,
    init_distributed,
    launch_env_from_environ,
)

_STOP_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """A rank failed; the message names it and carries its error."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


class _ParentFd:
    """One of the launcher's file descriptors (its stdout, its stderr), handed to a rank started by a fork server:
    a forked rank inherits the server's, which are the launcher's as they were when the server started."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _ParentFd._received, (reduction.DupFd(self.fd),)  # sent with the process, as a connection is

    @staticmethod
    def _received(dup) -> int:
        return dup.detach()


def _adopt(environ: dict[str, str], umask: int, stdio: tuple | None) -> None:
    """Take the launcher's environment, file mode mask and (from a fork server) its stdout and stderr, as a spawned
    rank has them: a fork server started earlier has its own. (multiprocessing passes the working directory.)"""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    os.umask(umask)
    if stdio is None:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for target, fd in zip((1, 2), stdio, strict=True):
        os.dup2(fd, target)
        os.close(fd)


def _rank_main(
    rank, world_size, store, timeout_s, threads, rank_setup, admission, fn, args, errors, environ, umask, stdio
) -> None:
    _adopt(environ, umask, stdio)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR=LOCAL_ADDR)
    # a fatal signal (a crash in native code: SIGSEGV, SIGABRT from glibc's heap checks) prints every thread's
    # Python stack to the rank's stderr, the launcher's: where it happened, beside the launcher's "died" line
    faulthandler.enable(all_threads=True)
    if rank_setup is not None:
        rank_setup(rank)
    import torch  # after the core binding: torch's thread pools start on the cores this rank owns
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        init_distributed(timeout_s=timeout_s, init_method=f"file://{store}", admission=admission)
        fn(*args)
        # no rank closes its sockets before every rank is done: gloo connects a new group's pairs lazily, and a
        # rank whose function returned at once could otherwise leave while a peer still connects to it, failing
        # that peer's start with "Connection closed by peer" (seen in about 1 of 6 three-rank launches)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then the rank exits non-zero
        # a verdict (an exception class with ``one_line = True``: halted by a health check, a failed save) is
        # its message; the traceback of anything else is the news
        trace = "" if getattr(exc, "one_line", False) else traceback.format_exc()
        errors.put((rank, f"{type(exc).__name__}: {exc}", trace))
        raise SystemExit(1) from None
    finally:
        destroy_distributed()


def launch(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 300.0,
    threads_per_rank: int = 1,
    hang_report: Callable[[list[int]], str] | None = None,
    rank_setup: Callable[[int], None] | None = None,
    log_path: str | None = None,
    admission: AdmissionSpec | None = None,
) -> None:
    """Run ``fn(*args)`` on every rank of a ``world_size`` job.

    Under torchrun or SLURM this process is one rank: it joins the job described by the environment.
    Otherwise ``world_size`` local processes are spawned (gloo on CPU, one per GPU with NCCL).
    ``rank_setup(local_rank)`` runs first in every rank process, before torch starts its threads (a backend's
    core binding, ``modelpar.backends.rank_setup``).
    Raises ``LaunchError`` naming the first rank that failed; ``hang_report(alive ranks)`` adds lines to its
    message, e.g. the rank that stopped making progress and its action (``modelpar.training.flight``). A rank
    whose process is stopped (frozen) is named as the cause, in a few lines; the tracebacks of the ranks that
    timed out waiting for it go to ``log_path``. With ``admission`` every rank proves it holds the job's secret
    before the process group exists (``modelpar.parallel.admission``).
    """
    env = launch_env_from_environ()
    if env is not None:
        if env.world_size != world_size:
            raise LaunchError(
                env.rank,
                f"the recipe's layout needs {world_size} ranks but {env.source} started {env.world_size}; "
                f"launch {world_size} processes, change parallel.dp, or set trainer.elastic=true to re-choose the "
                "layout for this world",
            )
        if rank_setup is not None and int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) > 1:
            rank_setup(env.local_rank)
        init_distributed(timeout_s=timeout_s, admission=admission)
        try:
            fn(*args)
        except Exception as exc:
            lost = peer_lost(exc)
            if lost is None:
                raise
            raise LaunchError(env.rank, _lost_peer_message(env, lost, exc, log_path)) from None
        finally:
            destroy_distributed()
        return

    ctx = _start_context(fn, rank_setup)
    forked = ctx.get_start_method() == "forkserver"
    stdio = (_ParentFd(1), _ParentFd(2)) if forked else None
    errors = ctx.Queue()
    # rendezvous through a file in a directory only this user can read: a TCP store would listen on every
    # network interface, where anyone could join or disrupt the job (gloo's own pairs bind 127.0.0.1)
    store_dir = tempfile.mkdtemp(prefix="modelpar-rendezvous-")
    store = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                r,
                world_size,
                store,
                timeout_s,
                threads_per_rank,
                rank_setup if world_size > 1 else None,
                admission,
                fn,
                args,
                errors,
                dict(os.environ),
                current_umask(),
                stdio,
            ),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        _watch(procs, errors, hang_report, log_path)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=_STOP_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(store_dir, ignore_errors=True)


# what the transport says when a collective fails because a peer went away (died, was stopped, hung)
_PEER_GONE = re.compile(
    r"Connection (?:reset|closed) by peer|Broken pipe|Connection refused|Timed out waiting|communicator was aborted"
)


def peer_lost(exc: BaseException) -> str | None:
    """The transport's own words if ``exc`` is a collective that failed because a peer went away, else None:
    gloo's "Read error [127.0.0.1]:8338: Connection reset by peer", without its source path and advice."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if not _PEER_GONE.search(text):
        return None
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)  # gloo's "[.../pair.cc:537] "
    return text.split(". This is typically")[0].strip().rstrip(".")


def _lost_peer_message(env, lost: str, exc: BaseException, log_path: str | None) -> str:
    """One line for a rank under torchrun/SLURM whose peer went away: the cause is that peer, named by its own
    output and the launcher's; this rank's traceback goes to ``log_path``."""
    where = ""
    if log_path is not None:
        with open(log_path, "a") as log:
            trace = "".join(traceback.format_exception(exc))
            log.write(redact(f"rank {env.rank} (host {os.uname().nodename}): lost a peer\n{trace}\n"))
        where = f"; its traceback: {log_path}"
    return (
        f"rank {env.rank} lost a peer in a collective ({lost}): another rank of the job died, hung or was stopped, "
        f"and its own output and {env.source}'s name it{where}"
    )


def current_umask() -> int:
    """This process's file mode mask (reading it means setting it, and back)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _start_context(fn: Callable[..., Any], rank_setup: Callable[[int], None] | None):
    """How local ranks start: ``spawn`` (a fresh interpreter each, what CUDA needs) unless the backend's rank set-up
    names another way (``gloo_cpu.RankSetup.start_method``). A fork server preloads torch and the engine's modules
    that ``fn`` and the set-up live in (once per launcher process: later launches reuse it)."""
    method = getattr(rank_setup, "start_method", "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ours = [m for m in (fn.__module__, type(rank_setup).__module__, __name__) if m.startswith("modelpar")]
        ctx.set_forkserver_preload([*RANK_PRELOAD, *ours])
    return ctx


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger, a paused machine): state T or t in /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _watch(procs: list, errors, hang_report: Callable[[list[int]], str] | None, log_path: str | None = None) -> None:
    """Wait for every rank; on the first failure, give the others a moment to report, then raise."""
    while True:
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            reports = _drain(errors, deadline=time.monotonic() + _STOP_GRACE_S)
            alive = [r for r, p in enumerate(procs) if p.exitcode is None]
            frozen = [r for r in alive if _stopped(procs[r].pid)]
            if frozen:  # the ranks that timed out are its victims: name the frozen one, keep their traces aside
                raise LaunchError(frozen[0], _frozen_message(frozen, reports, hang_report, log_path))
            hang = hang_report(alive) if hang_report is not None else ""
            killed = [r for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0]
            if killed:  # a rank killed by a signal is the cause; the errors of its peers are the consequence
                rank = killed[0]
                after = f"; ranks {sorted(reports)} failed after it" if reports else ""
                name = signal.Signals(-procs[rank].exitcode).name
                raise LaunchError(rank, f"rank {rank} died (signal {name}){after}; the other ranks were stopped{hang}")
            if reports:
                rank = next(iter(reports))  # the first to report is the likeliest cause; the rest follow it
                message, trace = reports[rank]
                if not trace:  # a verdict every rank reached alike: its message says it all (the ranks still
                    # exiting when it arrived are not stuck, so no hang report follows it)
                    raise LaunchError(rank, f"halted: {message}")
                raise LaunchError(rank, f"rank {rank} failed: {message}\n{trace.rstrip()}{hang}")
            rank = failed[0]
            code = procs[rank].exitcode
            raise LaunchError(rank, f"rank {rank} died (exit code {code}); the other ranks were stopped{hang}")
        if all(p.exitcode == 0 for p in procs):
            return
        time.sleep(0.05)


def _frozen_message(
    frozen: list[int], reports: dict, hang_report: Callable[[list[int]], str] | None, log_path: str | None
) -> str:
    """At most five lines: the frozen rank with its coordinates and last action, its victims, the log."""
    rank = frozen[0]
    where = hang_report(frozen).strip().splitlines() if hang_report is not None else []
    culprit = where[0] if where else f"rank {rank}"
    lines = [f"{culprit}: its process is stopped (SIGSTOP, a hung device or a paused machine)"]
    if len(frozen) > 1:
        lines.append(f"ranks {frozen[1:]} are stopped too")
    if reports:
        lines.append(f"ranks {sorted(reports)} timed out waiting for it; the other ranks were stopped")
    if log_path is not None:
        with open(log_path, "a") as log:
            for r, (message, trace) in sorted(reports.items()):
                log.write(redact(f"rank {r}: {message}\n{trace}\n"))
            log.write("\n".join(where) + "\n")
        lines.append(f"tracebacks of the ranks that timed out: {log_path}")
    return "\n".join(lines)


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
