"""Emulated ranks for tests: run a function on N local processes joined by gloo over loopback.

    from modelpar import ParallelLayout
    from modelpar.testing import run_on_ranks, current_groups

    def shard_sum(x):
        groups = current_groups()              # this rank's tp/pp/dp/embedding groups
        ...
        return value                           # must be picklable

    results = run_on_ranks(4, shard_sum, 3, layout=ParallelLayout(tp=2, pp=2))   # rank order

The ranks are the warm worker pool of ``modelpar.parallel.pool`` (one pool per world size, reused across
calls; any failure replaces it), each rank a CPU process on one thread that notes its gloo groups' socket
threads as a launched CPU rank does. Also a pytest plugin (registered through the ``pytest11`` entry point):
``@pytest.mark.ranks(4, layout=ParallelLayout(tp=2, pp=2))`` runs a test body on 4 ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modelpar.backends.gloo_cpu import RankSetup
from modelpar.parallel import pool
from modelpar.parallel.layout import ParallelLayout
from modelpar.parallel.pool import DEFAULT_TIMEOUT_S, RankError, RankTimeout, current_groups, shutdown_pools

EMULATED_RANK = RankSetup()  # one thread, not bound to a core; watches its gloo groups' socket threads


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    layout: ParallelLayout | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` emulated ranks and return each rank's result in rank order.

    ``fn``, its arguments and its results must be picklable (a module-level function). With ``layout``, the
    layout's process groups are built on every rank first; ``current_groups()`` returns them inside ``fn``.
    Raises ``RankError`` (naming the rank, with its traceback) if any rank raises or dies, and ``RankTimeout``
    (naming the ranks that had not finished) after ``timeout_s``; either way the workers are replaced.
    """
    return pool.run_on_ranks(
        world_size, fn, *args, layout=layout, timeout_s=timeout_s, rank_setup=EMULATED_RANK, **kwargs
    )


# -- pytest plugin -----------------------------------------------------------------------------------------


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "ranks(n, layout=None, timeout_s=120): run the test body on n emulated ranks (gloo on loopback)",
    )


def pytest_runtest_teardown(item, nextitem) -> None:
    """After a test module, idle warm ranks drop their process groups: each gloo group's socket thread keeps
    polling, and a dozen layouts' worth of them in idle workers slows every later test that runs processes."""
    if nextitem is None or nextitem.module is not item.module:
        pool.release_pools()


def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None:
        return None
    world_size = marker.args[0] if marker.args else marker.kwargs["n"]
    layout = marker.kwargs.get("layout")
    timeout_s = marker.kwargs.get("timeout_s", DEFAULT_TIMEOUT_S)
    funcargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    run_on_ranks(world_size, pyfuncitem.obj, layout=layout, timeout_s=timeout_s, **funcargs)
    return True


__all__ = ["DEFAULT_TIMEOUT_S", "RankError", "RankTimeout", "current_groups", "run_on_ranks", "shutdown_pools"]
