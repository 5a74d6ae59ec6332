"""Warm ranks: run a function on N local processes joined by gloo over loopback, reusing the processes.

    results = run_on_ranks(4, shard_sum, 3, layout=ParallelLayout(tp=2, pp=2))   # rank order

    def shard_sum(x):                          # module level: it is pickled to the workers
        groups = current_groups()              # this rank's tp/pp/dp/embedding groups
        ...
        return value                           # must be picklable

One pool per world size, reused across calls, so a second call costs a queue round trip, not a process start
(``launch`` starts a fresh job instead, and runs under torchrun/SLURM too). Any failure (an exception, a dead
or a stuck rank) tears the pool down, so the next call starts from clean processes. ``rank_setup(rank)`` runs
first in every worker, as with ``launch`` (a backend's bookkeeping, ``modelpar.backends.gloo_cpu.RankSetup``);
a call with another ``rank_setup`` than the pool's replaces the pool. ``modelpar.testing`` runs tests on it.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from modelpar.parallel.groups import ParallelGroups, held_groups, release_groups
from modelpar.parallel.layout import ParallelLayout
from modelpar.parallel.world import RANK_PRELOAD, init_distributed

DEFAULT_TIMEOUT_S = 120.0
_FAILURE_GRACE_S = 1.0  # after one rank fails, how long to wait for the others' own reports
_RELEASE = "release-groups"  # a task telling an idle pool's workers to destroy their cached process groups
# groups a worker keeps between calls: beyond this, it drops them all before the next call (every worker of a
# pool sees the same calls, so all decide alike); each gloo group keeps a socket thread polling
_MAX_HELD_GROUPS = 24


class RankError(RuntimeError):
    """A function raised on a rank; the message carries that rank's traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


class RankTimeout(TimeoutError):
    """Ranks did not finish within ``timeout_s``."""

    def __init__(self, pending: list[int], message: str):
        super().__init__(message)
        self.pending = pending


# -- inside a worker ---------------------------------------------------------------------------------------

_current_layout: ParallelLayout | None = None


def current_groups() -> ParallelGroups:
    """The ``ParallelGroups`` of the layout passed to ``run_on_ranks`` (call inside the rank function)."""
    if _current_layout is None:
        raise RuntimeError("current_groups() needs run_on_ranks(..., layout=ParallelLayout(...))")
    return ParallelGroups.build(_current_layout)


def _exit_cause(code: int | None) -> str:
    """``signal SIGABRT`` for a process a signal ended (a negative exit code), else ``exit code N``."""
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _fault_path(pool_dir: str, rank: int) -> str:
    """Where a worker's faulthandler writes every thread's Python stack if a fatal signal ends it."""
    return os.path.join(pool_dir, f"fault-{rank}")


def _fault_stack(pool_dir: str, rank: int, limit: int = 8000) -> str:
    """The Python stack a dead worker's faulthandler wrote (its last ``limit`` characters), or ``""``."""
    try:
        with open(_fault_path(pool_dir, rank), errors="replace") as f:
            text = f.read().strip()
    except OSError:
        return ""
    return text[-limit:]


def _worker_main(
    rank: int,
    world_size: int,
    init_file: str,
    tasks: mp.Queue,
    results: mp.Queue,
    rank_setup: Callable[[int], None] | None,
) -> None:
    global _current_layout
    # a rank killed by a fatal signal (a crash in native code: SIGSEGV, SIGABRT from glibc's heap checks) writes
    # every thread's Python stack to a file the caller puts into its error: where it happened, not only its exit
    # code (the worker's stderr is the forkserver's, which a test runner's capture may never show)
    fault_file = open(_fault_path(os.path.dirname(init_file), rank), "w")  # open until the worker exits
    faulthandler.enable(file=fault_file, all_threads=True)
    torch.set_num_threads(1)
    if rank_setup is not None:
        rank_setup(rank)
    parent = os.getppid()
    init_distributed(rank, world_size, backend="gloo", init_method=f"file://{init_file}")
    # what the imports made lives as long as the worker: a collection (each release below, Python's own) need
    # not walk it again (about 0.17 s each with torch and the engine loaded)
    gc.freeze()
    results.put(("ready", rank, True, b""))
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the caller died: do not linger as an orphan
                return
            continue
        if task is None:
            return
        if task == _RELEASE:  # another pool is in use: stop this one's group threads until it is needed again
            release_groups()
            gc.collect()
            continue
        call_id, sys_path, payload = task
        if held_groups() > _MAX_HELD_GROUPS:
            release_groups()
            gc.collect()
        for entry in reversed(sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        try:
            fn, args, kwargs, layout = pickle.loads(payload)
            _current_layout = layout
            torch.set_default_dtype(torch.float32)
            torch.set_grad_enabled(True)
            out = fn(*args, **kwargs)
            results.put((call_id, rank, True, pickle.dumps(out)))
        except BaseException:  # noqa: BLE001 - every failure travels back to the caller
            results.put((call_id, rank, False, traceback.format_exc().encode()))
        finally:
            _current_layout = None


# -- in the caller -----------------------------------------------------------------------------------------


_DIR_PREFIX = "modelpar-ranks-"  # + the creating process's pid + a random tail


def remove_stale_dirs(tmp: str) -> list[str]:
    """Remove this user's pool folders under ``tmp`` whose creating process is gone (killed before its exit
    handler ran); returns them. A folder whose pid now names another live process is kept (conservative)."""
    removed = []
    for entry in os.scandir(tmp):
        if not entry.name.startswith(_DIR_PREFIX):
            continue
        pid = entry.name[len(_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.stat(follow_symlinks=False).st_uid != os.getuid() or _alive(int(pid)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class _RankPool:
    """``world_size`` warm worker processes sharing one gloo world."""

    def __init__(self, world_size: int, rank_setup: Callable[[int], None] | None = None, start_timeout_s: float = 60.0):
        ctx = mp.get_context("forkserver")
        preload = [*RANK_PRELOAD, __name__]
        ctx.set_forkserver_preload(preload + ([type(rank_setup).__module__] if rank_setup is not None else []))
        self.world_size = world_size
        self.rank_setup = rank_setup
        remove_stale_dirs(tempfile.gettempdir())
        self._dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        init_file = os.path.join(self._dir, "store")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, world_size, init_file, self.tasks[r], self.results, rank_setup),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._calls = 0
        self.holds_groups = False  # whether a call since the last release may have built process groups
        try:
            self._collect("ready", set(range(world_size)), start_timeout_s, "start-up")
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def release(self) -> None:
        """Have every worker destroy its cached process groups (in order with the calls: all ranks agree)."""
        if self.holds_groups:
            for q in self.tasks:
                q.put(_RELEASE)
            self.holds_groups = False

    def run(self, fn: Callable, args: tuple, kwargs: dict, layout: ParallelLayout | None, timeout_s: float) -> list:
        self._calls += 1
        self.holds_groups = True
        call_id = self._calls
        payload = pickle.dumps((fn, args, kwargs, layout))
        for q in self.tasks:
            q.put((call_id, list(sys.path), payload))
        name = getattr(fn, "__qualname__", repr(fn))
        raw = self._collect(call_id, set(range(self.world_size)), timeout_s, name)
        return [pickle.loads(raw[r]) for r in range(self.world_size)]

    def _collect(self, call_id, pending: set[int], timeout_s: float, name: str) -> dict[int, bytes]:
        deadline = time.monotonic() + timeout_s
        done: dict[int, bytes] = {}
        failures: dict[int, str] = {}
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                got_id, rank, ok, data = self.results.get(timeout=min(0.05, deadline - now))
            except queue.Empty:
                dead = [r for r in sorted(pending) if not self.procs[r].is_alive()]
                for r in dead:
                    failures[r] = f"rank {r} died ({_exit_cause(self.procs[r].exitcode)}) while running {name}"
                    stack = _fault_stack(self._dir, r)
                    if stack:
                        failures[r] += f"; its Python stack (faulthandler):\n{stack}"
                    pending.discard(r)
                if dead:
                    deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
                continue
            if got_id != call_id:
                continue  # a late report from an earlier, abandoned call
            pending.discard(rank)
            if ok:
                done[rank] = data
            else:
                failures[rank] = f"rank {rank} of {self.world_size} raised in {name}:\n{data.decode()}"
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        if failures:
            first = min(failures)
            others = sorted(set(failures) - {first})
            note = f"\n(also failed: ranks {others})" if others else ""
            stuck = f"\n(still running when the pool was stopped: ranks {sorted(pending)})" if pending else ""
            raise RankError(first, failures[first] + note + stuck)
        if pending:
            raise RankTimeout(
                sorted(pending),
                f"{name} timed out after {timeout_s:g}s on {self.world_size} ranks: "
                f"ranks {sorted(pending)} had not finished (finished: {sorted(done)})",
            )
        return done

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs, strict=True):
            if p.is_alive():
                try:
                    q.put_nowait(None)
                except Exception:  # noqa: BLE001 - a broken queue only means the worker is already gone
                    pass
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for q in [*self.tasks, self.results]:
            q.close()
            q.cancel_join_thread()
        for name in ["store", *(os.path.basename(_fault_path(self._dir, r)) for r in range(self.world_size))]:
            try:
                os.remove(os.path.join(self._dir, name))
            except OSError:
                pass
        os.rmdir(self._dir) if os.path.isdir(self._dir) and not os.listdir(self._dir) else None


_pools: dict[int, _RankPool] = {}


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    layout: ParallelLayout | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    rank_setup: Callable[[int], None] | None = None,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` warm ranks and return each rank's result in rank order.

    ``fn``, its arguments and its results must be picklable (a module-level function), and so must
    ``rank_setup``, which each worker runs once when it starts (it must compare equal across calls for the
    pool to be reused). With ``layout``, the layout's process groups are built on every rank first;
    ``current_groups()`` returns them inside ``fn``. Raises ``RankError`` (naming the rank, with its traceback)
    if any rank raises or dies, and ``RankTimeout`` (naming the ranks that had not finished) after
    ``timeout_s``; either way the workers are replaced.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if layout is not None:
        layout.check_world_size(world_size)
    try:
        pickle.dumps((fn, args, kwargs, layout, rank_setup))
    except Exception as exc:
        raise TypeError(f"run_on_ranks needs picklable fn and arguments (a module-level function): {exc}") from exc
    pool = _pools.get(world_size)
    if pool is not None and (not pool.alive() or pool.rank_setup != rank_setup):
        _pools.pop(world_size)
        pool.close()
        pool = None
    for size, other in _pools.items():
        if size != world_size:  # an idle gloo group still polls its sockets: idle pools drop theirs
            other.release()
    if pool is None:
        pool = _pools[world_size] = _RankPool(world_size, rank_setup)
    try:
        return pool.run(fn, args, kwargs, layout, timeout_s)
    except BaseException:
        _pools.pop(world_size, None)
        pool.close()
        raise


def release_pools() -> None:
    """Have every warm pool destroy its cached process groups; the workers stay, the next call rebuilds
    what it needs (the pytest plugin calls this after each test module)."""
    for p in _pools.values():
        p.release()


def shutdown_pools() -> None:
    """Stop every warm worker (also registered at interpreter exit)."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close()


atexit.register(shutdown_pools)
