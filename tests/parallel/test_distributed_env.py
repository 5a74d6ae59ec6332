"""Where a rank comes from: torchrun's and SLURM's environments, or arguments; and a wrong world size."""

import os
import re

import pytest

from modelpar.parallel.launch import LaunchError, launch
from modelpar.parallel.world import choose_backend, launch_env_from_environ


def test_torchrun_environment_is_read():
    env = launch_env_from_environ(
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    )
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (
        5, 8, 1, "10.0.0.1", 1234, "torchrun",
    )  # fmt: skip


def test_slurm_environment_is_read_and_needs_an_explicit_master_address():
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3"}
    with pytest.raises(RuntimeError, match="export MASTER_ADDR"):
        launch_env_from_environ(slurm)
    env = launch_env_from_environ({**slurm, "MASTER_ADDR": "node-0"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.source) == (3, 16, 3, "node-0", "slurm")


def test_no_launcher_means_local_arguments():
    assert launch_env_from_environ({}) is None
    assert choose_backend() == "gloo"  # no CUDA on this machine


def test_world_size_that_does_not_match_the_layout_is_one_line(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match="the recipe's layout needs 4 ranks but torchrun started 2") as info:
        launch(4, print)
    assert "\n" not in str(info.value)


def _abort() -> None:
    os.abort()  # what glibc does on a corrupted heap


def test_a_launched_rank_killed_by_a_signal_prints_its_python_stack(capfd):
    with pytest.raises(LaunchError, match=r"rank 0 died \(signal SIGABRT\)"):
        launch(1, _abort, timeout_s=60.0)
    err = capfd.readouterr().err
    assert re.search(r'test_distributed_env\.py", line \d+ in _abort', err), err[-2000:]
