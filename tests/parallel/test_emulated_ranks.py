"""The emulated-rank harness: results in rank order, and every failure path named and cleaned up."""

import faulthandler
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from modelpar.parallel.pool import _pools, remove_stale_dirs
from modelpar.testing import RankError, RankTimeout, run_on_ranks


def _rank_and_args(a, b=0):
    return dist.get_rank(), a, b, torch.get_num_threads()


def _raise_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from {bad_rank}")
    return dist.get_rank()


def _sleep_on(bad_rank, seconds):
    if dist.get_rank() == bad_rank:
        time.sleep(seconds)
    return os.getpid()


def _exit_on(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    return dist.get_rank()


def _abort_on(bad_rank):
    if dist.get_rank() == bad_rank:
        os.abort()  # what glibc does on a corrupted heap
    return dist.get_rank()


def _pid():
    return os.getpid()


def test_results_come_back_in_rank_order_with_one_thread_each():
    assert run_on_ranks(3, _rank_and_args, "x", b=7) == [(r, "x", 7, 1) for r in range(3)]


def test_second_call_reuses_warm_workers():
    first = run_on_ranks(2, _pid)
    second = run_on_ranks(2, _pid)
    assert first == second  # the same processes: no new rank was started


def test_raising_rank_is_named_with_its_traceback():
    with pytest.raises(RankError, match=r"rank 2 of 3 raised in _raise_on") as info:
        run_on_ranks(3, _raise_on, 2)
    assert info.value.rank == 2
    assert "ValueError: boom from 2" in str(info.value)
    assert 3 not in _pools or _pools[3].alive()
    assert run_on_ranks(3, _raise_on, -1) == [0, 1, 2]  # a fresh pool after the failure


def test_sleeping_rank_times_out_naming_it_and_leaves_no_orphans():
    pids = run_on_ranks(2, _pid)
    start = time.perf_counter()
    with pytest.raises(RankTimeout, match=r"ranks \[1\] had not finished") as info:
        run_on_ranks(2, _sleep_on, 1, 60.0, timeout_s=2.0)
    assert time.perf_counter() - start < 10
    assert info.value.pending == [1]
    for pid in pids:
        assert not _process_exists(pid), f"worker {pid} outlived the timeout"


def test_rank_calling_os_exit_is_reported_without_waiting_for_the_timeout():
    start = time.perf_counter()
    with pytest.raises(RankError, match=r"rank 1 died \(exit code 3\)"):
        run_on_ranks(2, _exit_on, 1, timeout_s=60.0)
    assert time.perf_counter() - start < 10


def test_a_rank_killed_by_a_signal_is_named_with_it_and_its_python_stack():
    # faulthandler writes each thread's stack to a file of the pool's, which the error carries: a worker's
    # stderr is the forkserver's, which this test's capture does not show
    assert run_on_ranks(2, faulthandler.is_enabled) == [True, True]
    with pytest.raises(RankError, match=r"rank 0 died \(signal SIGABRT\) while running _abort_on") as info:
        run_on_ranks(2, _abort_on, 0, timeout_s=60.0)
    assert "its Python stack (faulthandler)" in str(info.value)
    assert re.search(r'test_emulated_ranks\.py", line \d+ in _abort_on', str(info.value)), str(info.value)


def test_unpicklable_function_is_refused_in_the_caller():
    with pytest.raises(TypeError, match="picklable"):
        run_on_ranks(2, lambda: 1)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie awaiting its parent's reap is gone for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _socket_threads_after_build(layout):
    from modelpar.backends.gloo_cpu import gloo_socket_threads
    from modelpar.parallel.groups import ParallelGroups, held_groups

    groups = ParallelGroups.build(layout) if layout is not None else None
    total = torch.ones(1)
    if groups is not None:  # the groups still work after the others were released
        dist.all_reduce(total, group=groups.tp_group)
    return held_groups(), len(gloo_socket_threads()), total.item()


def test_layouts_share_their_groups_and_an_idle_pool_releases_them():
    from modelpar.parallel.layout import ParallelLayout
    from modelpar.parallel.pool import shutdown_pools

    shutdown_pools()  # fresh workers: no groups from earlier tests (meshes' groups are kept through releases)
    layouts = [ParallelLayout(tp=2, pp=2), ParallelLayout(dp=4), ParallelLayout(tp=2, dp=2)]
    held = [run_on_ranks(4, _socket_threads_after_build, lay)[0] for lay in layouts]
    # rank 0 of tp2-pp2 is in a tp, pp, dp and embedding group (4); dp4 brings 4 others; of tp2-dp2's, only
    # the dp group [0, 2] is new: its tp group [0, 1] is tp2-pp2's, its pp and embedding groups ([0]) are dp4's
    assert [h[0] for h in held] == [4, 8, 9]
    assert held[-1][1] == held[-1][0] + 1  # one socket thread per held group, plus the default group's
    run_on_ranks(2, _socket_threads_after_build, None)  # another pool in use: the idle one drops its groups
    assert run_on_ranks(4, _socket_threads_after_build, None)[0][:2] == (0, 1)
    assert run_on_ranks(4, _socket_threads_after_build, layouts[0])[0] == (4, 5, 2.0)


def test_the_folder_of_a_killed_callers_pool_is_removed_by_the_next_pool(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid whose process is gone, as a caller killed before its exit handler ran
    stale = tmp_path / f"modelpar-ranks-{gone.pid}-k2x9"
    stale.mkdir()
    (stale / "store").write_text("")
    live = tmp_path / f"modelpar-ranks-{os.getpid()}-a8q1"  # this process's own
    live.mkdir()
    unnamed = tmp_path / "modelpar-ranks-q7w2"  # no pid in the name (an older pool's): left alone
    unnamed.mkdir()
    assert remove_stale_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and unnamed.exists()
