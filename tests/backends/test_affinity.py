"""CPU ranks bound to their own cores: which cores each local rank gets, and that the binding is undone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from modelpar.backends.gloo_cpu import core_block, job_cores, pinned
from tests.helpers import make_config


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
    from modelpar.backends.gloo_cpu import RankSetup
    from modelpar.parallel.launch import launch

    launch(3, _write_mask, str(tmp_path), timeout_s=60.0, rank_setup=RankSetup(threads=1, pin=pin))
    masks = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(3)]
    cores = job_cores()
    assert masks == ([core_block(r, 1, cores) for r in range(3)] if pin else [cores] * 3)


def _gloo_thread_policies(mode: str) -> dict:
    """On a rank: build a subgroup, set its socket threads' mode, and report policies plus a working all-reduce."""
    import torch
    import torch.distributed as dist

    from modelpar.backends.gloo_cpu import gloo_socket_threads, priority_restorable, set_gloo_threads
    from modelpar.parallel import collectives

    before = set(gloo_socket_threads())
    group = dist.new_group([0, 1])
    mine = sorted(set(gloo_socket_threads()) - before)
    changed = set_gloo_threads(mode, mine)
    x = torch.full((4096,), float(dist.get_rank() + 1))
    collectives.all_reduce(x, group)  # the socket thread still makes progress
    out = {
        "mine": mine,
        "changed": changed,
        "policies": [os.sched_getscheduler(tid) for tid in mine],
        "main": os.sched_getscheduler(0),
        "sum": x[0].item(),
        "restorable": priority_restorable(),
    }
    set_gloo_threads("normal", mine)
    out["after"] = [os.sched_getscheduler(tid) for tid in mine]
    dist.destroy_process_group(group)
    return out


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no idle scheduling class on this OS")
@pytest.mark.parametrize("mode", ["idle", "normal"])
def test_gloo_socket_threads_go_idle_and_back_while_collectives_still_run(mode):
    from modelpar.testing import run_on_ranks

    for rank in run_on_ranks(2, _gloo_thread_policies, mode):
        assert rank["sum"] == 3.0
        assert len(rank["mine"]) == 1 and rank["changed"] == rank["mine"]  # one socket thread per group
        assert rank["policies"] == [os.SCHED_IDLE if mode == "idle" else os.SCHED_OTHER]
        assert rank["main"] == os.SCHED_OTHER  # the compute thread keeps its class
        # back to normal needs root or CAP_SYS_NICE; without them the idled thread stays idle (documented)
        stuck = mode == "idle" and not rank["restorable"]
        assert rank["after"] == [os.SCHED_IDLE if stuck else os.SCHED_OTHER]


def test_unknown_gloo_thread_mode_is_refused():
    from modelpar.backends.gloo_cpu import set_gloo_threads

    with pytest.raises(ValueError, match="'low' is not one of"):
        set_gloo_threads("low")


def _trainer_gloo_policies(cfg, data_path: str) -> dict:
    from modelpar.backends.gloo_cpu import gloo_socket_threads, priority_restorable, socket_threads
    from modelpar.parallel.groups import ParallelGroups
    from modelpar.training.trainer import Trainer

    def idle() -> set[int]:
        return {tid for tid in gloo_socket_threads() if os.sched_getscheduler(tid) == os.SCHED_IDLE}

    groups = ParallelGroups.build(cfg.parallel.layout())  # cached: the trainer gets these same groups
    before = idle()  # threads a warm worker could not restore after an earlier test (unprivileged runs)
    trainer = Trainer(cfg, data_path, None)
    during = idle()
    trainer.fit()
    return {
        "tp": set(socket_threads(groups.tp_group)),
        "pp": set(socket_threads(groups.pp_group)),
        "before": before,
        "during": during,
        "after": idle(),
        "restorable": priority_restorable(),
    }


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no idle scheduling class on this OS")
@pytest.mark.parametrize("mode", ["idle", "normal"])
def test_trainer_puts_only_the_tp_groups_socket_threads_idle_for_the_run(mode, token_path, tmp_path):
    from dataclasses import replace

    from modelpar.testing import run_on_ranks

    cfg = make_config(tmp_path, tp=2, pp=2)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=1, ckpt_every=0, gloo_threads=mode))
    for rank in run_on_ranks(4, _trainer_gloo_policies, cfg, token_path):
        assert rank["tp"] and rank["pp"] and not rank["tp"] & rank["pp"]  # one socket thread per group
        made_idle = rank["tp"] if mode == "idle" else set()
        # a thread left idle by an earlier test may exit while this one runs (its group torn down), so
        # "before" bounds what else may be idle rather than naming it exactly
        assert made_idle <= rank["during"]
        assert rank["during"] - made_idle <= rank["before"]  # nothing else went idle
        assert not rank["during"] & rank["pp"]  # the pipeline's p2p thread stays normal
        if rank["restorable"]:  # what this run made idle is normal again (an earlier test's leftovers may remain)
            assert rank["after"] <= rank["before"] and not rank["after"] & (made_idle - rank["before"])
        else:  # unprivileged: what went idle stays idle
            assert made_idle <= rank["after"] <= rank["during"]


def test_socket_threads_stay_normal_unless_a_recipe_asks_for_idle():
    """The idle class yields to every process on the machine, not only to the rank's compute thread: beside two
    busy processes an idled tp2 step ran at 0.07x (``benchmarks/results/bench_gloo_threads_loaded.md``)."""
    import inspect
    from pathlib import Path

    from modelpar import backends
    from modelpar.training.config import RECIPES, TrainerConfig

    assert TrainerConfig().gloo_threads == "normal"
    assert inspect.signature(backends.install).parameters["gloo_threads"].default == "normal"
    assert not [p for p in Path(RECIPES).rglob("*.yaml") if "gloo_threads: idle" in p.read_text()]
