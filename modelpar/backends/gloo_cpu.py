"""Bind each CPU rank to its own cores (``trainer.cpu_affinity=auto``).

Local rank ``r`` with ``t`` threads gets block ``r mod (cores // t)`` of ``t`` consecutive cores, out of the
cores this job may use (its affinity mask at start). With no more ranks than blocks every rank owns its
cores; with more, ranks share blocks round-robin, so consecutive ranks (the tensor-parallel partners, tp
being the innermost dimension of a layout) always sit on different cores and can run a collective at once
instead of waiting for the scheduler to swap one of them in. On the 2-core machine, tp2 x pp2 (4 ranks)
ran 5-27% faster pinned than unpinned in six pairs of runs, median 12% (``benchmarks/results/bench_affinity.md``
holds three); with one rank per core (tp2, pp2) the difference was within run-to-run noise.

GPU ranks are not pinned (their host threads mostly wait on the device).

``trainer.gloo_threads=idle`` (the default) also moves gloo's socket threads (``gloo_tcp_loop``, one per
process group) to the idle scheduling class. Such a thread runs an epoll loop over level-triggered sockets and
only *tries* the connection's lock; while the rank's compute thread holds that lock (it posts every send and
receive, and writes a message itself when the peer is already waiting for it), every wake-up of the socket
thread finds the lock taken and goes straight back to epoll, so it spins on the very core the lock holder
needs. On the 2-core machine that was 4-6 million ``epoll_wait`` calls in a 13 s tp2 run and a posting time of
0.2-0.5 s per step (289 collectives) instead of 0.06 s. At idle priority the socket thread yields the core to
the compute thread whenever both want it and still runs the moment the compute thread blocks; it keeps a small
share of the core (the idle class is weighted, not starved), so progress never stops.
Alternating steps in the same workers (``benchmarks/transport_threads.py``, two runs): tp2 1.34-1.47x and
tp2 x pp2 1.09-1.10x faster, pp2 and dp2 unchanged within noise (their transfers are few and large); the socket
threads' CPU time per tp2 step fell from 271-378 ms to 45 ms.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence

AFFINITY_MODES = ("auto", "off")
GLOO_THREAD_MODES = ("idle", "normal")
GLOO_SOCKET_THREAD = "gloo_tcp_loop"  # the name gloo gives each process group's socket (epoll) thread

_JOB_CORES: list[int] | None = None  # this process's mask when first asked: what the job may use


def job_cores() -> list[int]:
    """The cores this process could use before any pinning (its affinity mask at the first call)."""
    global _JOB_CORES
    if _JOB_CORES is None:
        _JOB_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return list(_JOB_CORES)


def core_block(local_rank: int, threads: int, cores: Sequence[int]) -> list[int]:
    """The cores of local rank ``local_rank`` running ``threads`` threads, out of ``cores``."""
    cores = sorted(cores)
    if local_rank < 0 or threads < 1:
        raise ValueError(f"local_rank={local_rank} must be >= 0 and threads={threads} >= 1")
    if len(cores) <= threads:
        return cores
    block = local_rank % (len(cores) // threads)
    return cores[block * threads : (block + 1) * threads]


def pin_cpu_rank(local_rank: int, threads: int) -> list[int]:
    """Bind this process to its block of cores (see the module docstring); returns them ([] where the OS
    offers no affinity control)."""
    cores = job_cores()
    if not cores:
        return []
    mine = core_block(local_rank, threads, cores)
    os.sched_setaffinity(0, mine)
    return mine


@contextlib.contextmanager
def pinned(local_rank: int, threads: int, enabled: bool = True) -> Iterator[list[int]]:
    """``pin_cpu_rank`` for the block's duration, then the job's whole mask again (for reused workers)."""
    if not enabled or not job_cores():
        yield []
        return
    try:
        yield pin_cpu_rank(local_rank, threads)
    finally:
        os.sched_setaffinity(0, job_cores())


def gloo_socket_threads() -> list[int]:
    """Thread ids of this process's gloo socket threads ([] where /proc is not available)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == GLOO_SOCKET_THREAD:
                    out.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(out)


def set_gloo_threads(mode: str, threads: Iterable[int] | None = None) -> list[int]:
    """Put gloo socket threads in the idle scheduling class (``idle``) or back to the normal one (``normal``):
    ``threads`` (ids, e.g. ``ParallelGroups.socket_threads["tp"]``), or else every one of this process.
    Returns the threads changed. Threads of process groups created later start normal. Going back to normal
    needs root or CAP_SYS_NICE (an unprivileged process may lower a thread's class but not raise it again);
    without them such threads stay idle (``priority_restorable`` tells which case this is)."""
    if mode not in GLOO_THREAD_MODES:
        raise ValueError(f"gloo thread mode {mode!r} is not one of {GLOO_THREAD_MODES}")
    if not hasattr(os, "sched_setscheduler"):
        return []
    policy = os.SCHED_IDLE if mode == "idle" else os.SCHED_OTHER
    changed = []
    for tid in gloo_socket_threads() if threads is None else threads:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except (ProcessLookupError, PermissionError):
            continue
        changed.append(tid)
    return changed


_RESTORABLE: bool | None = None


def priority_restorable() -> bool:
    """Whether this process may move a thread from the idle class back to normal (tried once on a helper
    thread that only waits; cached)."""
    global _RESTORABLE
    if _RESTORABLE is None:
        import threading

        if not hasattr(os, "sched_setscheduler"):
            _RESTORABLE = False
            return _RESTORABLE
        release = threading.Event()
        helper = threading.Thread(target=release.wait, name="modelpar-priority-probe", daemon=True)
        helper.start()
        try:
            os.sched_setscheduler(helper.native_id, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(helper.native_id, os.SCHED_OTHER, os.sched_param(0))
            _RESTORABLE = True
        except OSError:
            _RESTORABLE = False
        finally:
            release.set()
            helper.join()
    return _RESTORABLE
