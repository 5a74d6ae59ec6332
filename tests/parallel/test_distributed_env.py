"""Where a rank comes from: torchrun's and SLURM's environments, or arguments; and a wrong world size."""

import os
import re
import socket

import pytest

from modelpar.parallel.launch import LaunchError, launch, peer_lost
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


GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8338: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. "
    "Check the logs of the remote worker for the root cause."
)


def _peer_gone() -> None:
    raise RuntimeError(GLOO_PEER_GONE)  # what a survivor's collective raises when torchrun's other worker dies


def _own_bug() -> None:
    raise RuntimeError("shape mismatch in this rank's own code")


def _one_rank_torchrun(monkeypatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(port))
    for key in ("TORCH_FR_BUFFER_SIZE", "GLOO_SOCKET_IFNAME"):  # what init_distributed sets here: unset again after
        monkeypatch.delenv(key, raising=False)


def test_under_torchrun_a_rank_whose_peer_went_away_says_so_in_one_line(monkeypatch, tmp_path):
    _one_rank_torchrun(monkeypatch)
    log = tmp_path / "failure.log"
    with pytest.raises(LaunchError) as info:
        launch(1, _peer_gone, timeout_s=30.0, log_path=str(log))
    assert str(info.value) == (
        "rank 0 lost a peer in a collective (Read error [127.0.0.1]:8338: Connection reset by peer): another rank "
        f"of the job died, hung or was stopped, and its own output and torchrun's name it; its traceback: {log}"
    )
    assert "in _peer_gone" in log.read_text()  # the traceback is kept, beside the run
    with pytest.raises(RuntimeError, match="shape mismatch") as info:  # anything else is this rank's own news
        launch(1, _own_bug, timeout_s=30.0, log_path=str(log))
    assert not isinstance(info.value, LaunchError)


def test_what_counts_as_a_peer_gone():
    assert peer_lost(RuntimeError(GLOO_PEER_GONE)) == "Read error [127.0.0.1]:8338: Connection reset by peer"
    assert peer_lost(RuntimeError("[pair.cc:598] Connection closed by peer [127.0.0.1]:27052")) == (
        "Connection closed by peer [127.0.0.1]:27052"
    )
    assert peer_lost(RuntimeError("Timed out waiting 30000ms for recv operation to complete")) is not None
    assert peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert peer_lost(ValueError("Connection reset by peer")) is None  # not a collective's error
