"""Bind each CPU rank to its own cores (``trainer.cpu_affinity=auto``).

Local rank ``r`` with ``t`` threads gets block ``r mod (cores // t)`` of ``t`` consecutive cores, out of the
cores this job may use (its affinity mask at start). With no more ranks than blocks every rank owns its
cores; with more, ranks share blocks round-robin, so consecutive ranks (the tensor-parallel partners, tp
being the innermost dimension of a layout) always sit on different cores and can run a collective at once
instead of waiting for the scheduler to swap one of them in. On the 2-core machine, tp2 x pp2 (4 ranks)
ran 5-27% faster pinned than unpinned in six pairs of runs, median 12% (``benchmarks/results/bench_affinity.md``
holds three); with one rank per core (tp2, pp2) the difference was within run-to-run noise.

GPU ranks are not pinned (their host threads mostly wait on the device).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

AFFINITY_MODES = ("auto", "off")

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
