"""CPU ranks bound to their own cores: which cores each local rank gets, and that the binding is undone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from modelpar.affinity import core_block, job_cores, pinned


@pytest.mark.parametrize(
    "cores, threads, want",
    [
        ([0, 1], 1, [[0], [1], [0], [1]]),  # 4 ranks on 2 cores: tp partners (ranks 0,1 and 2,3) apart
        (list(range(8)), 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (list(range(6)), 4, [[0, 1, 2, 3]] * 4),  # one block of 4 fits; every rank gets it
        ([3, 1], 4, [[1, 3]] * 4),  # fewer cores than threads: all of them
    ],
)
def test_local_ranks_get_consecutive_blocks_round_robin(cores, threads, want):
    assert [core_block(r, threads, cores) for r in range(4)] == want


def test_bad_block_request_is_refused():
    with pytest.raises(ValueError, match="threads=0"):
        core_block(0, 0, [0, 1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity control on this OS")
def test_pinning_binds_then_restores_the_jobs_mask():
    everything = job_cores()
    with pinned(len(everything) - 1, 1) as mine:
        assert mine == [everything[-1]] and sorted(os.sched_getaffinity(0)) == mine
    assert sorted(os.sched_getaffinity(0)) == everything
    with pinned(0, 1, enabled=False) as mine:
        assert mine == [] and sorted(os.sched_getaffinity(0)) == everything


def _write_mask(out_dir: str) -> None:
    import torch.distributed as dist

    Path(out_dir, f"rank{dist.get_rank()}").write_text(json.dumps(sorted(os.sched_getaffinity(0))))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity control on this OS")
@pytest.mark.parametrize("pin", [True, False])
def test_launched_cpu_ranks_run_on_their_own_cores_unless_told_not_to(tmp_path, pin):
    from modelpar.launch import launch

    launch(3, _write_mask, str(tmp_path), timeout_s=60.0, pin_cpu=pin)
    masks = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(3)]
    cores = job_cores()
    assert masks == ([core_block(r, 1, cores) for r in range(3)] if pin else [cores] * 3)
