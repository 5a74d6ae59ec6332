"""Restarts without a person: a failed local job starts again from its newest verified checkpoint, and the
run ends where the uninterrupted run ends, bit for bit; under torchrun, --max-restarts does the same."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from modelpar.parallel.launch import LaunchError
from modelpar.training.config import RecipeError, TrainConfig, TrainerConfig, validate
from modelpar.training.restart import RestartPolicy, run_with_restarts
from tests.helpers import SMALL, final_weights, train
from tests.training.conftest import DP2_RUN

COMMON = DP2_RUN


def test_each_failure_is_one_line_then_a_doubling_wait_then_another_attempt(tmp_path):
    said, slept, attempts = [], [], []

    def attempt(n):
        attempts.append(n)
        if n < 2:
            raise LaunchError(n, f"rank {n} died (signal SIGKILL); the other ranks were stopped\nmore detail")

    restarts = run_with_restarts(attempt, RestartPolicy(3, 0.5), tmp_path / "r.jsonl", said.append, slept.append)
    assert (restarts, attempts, slept) == (2, [0, 1, 2], [0.5, 1.0])
    assert said == [
        "modelpar-train: restart 1 of 3 in 0.5 s after: rank 0 died (signal SIGKILL); the other ranks were stopped",
        "modelpar-train: restart 2 of 3 in 1 s after: rank 1 died (signal SIGKILL); the other ranks were stopped",
    ]
    log = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [entry["rank"] for entry in log] == [0, 1]


def test_a_timeout_names_the_hung_rank_first_and_a_death_its_own_line():
    from modelpar.training.restart import cause_of

    timed_out = LaunchError(
        1,
        "rank 1 failed: RuntimeError: pipeline rank 0 stuck in 0SEND_F1: Timed out waiting 10000ms\nTraceback ...\n"
        "rank 3 (pp 1 tp 1 dp 0) stuck in 1F0 at step 300 (no progress for 11 s)\n  rank   0: step 300, in ...",
    )
    assert cause_of(timed_out, width=40) == (
        "rank 3 (pp 1 tp 1 dp 0) stuck in 1F0 at step 300 (no progress for 11 s); "
        "rank 1 failed: RuntimeError: pipeline..."
    )
    died = LaunchError(2, "rank 2 died (signal SIGKILL); the other ranks were stopped\nrank 3 (pp 1) stuck in idle")
    assert cause_of(died) == "rank 2 died (signal SIGKILL); the other ranks were stopped"


def test_the_last_failure_is_raised_when_no_restart_is_left(tmp_path):
    def attempt(n):
        raise LaunchError(0, f"halted: attempt {n}")

    with pytest.raises(LaunchError, match="attempt 1"):
        run_with_restarts(attempt, RestartPolicy(1, 0.0), tmp_path / "r.jsonl", lambda _: None, lambda _: None)


def test_restarts_need_resume_auto():
    cfg = TrainConfig(trainer=TrainerConfig(max_restarts=2, resume="never"))
    with pytest.raises(RecipeError, match="use trainer.resume=auto"):
        validate(cfg)


@pytest.fixture(scope="module")
def straight(straight_dp2):
    return straight_dp2


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_a_job_killed_at_three_steps_finishes_on_its_own_with_the_uninterrupted_weights(tmp_path, straight):
    faults = "kill@1:1,kill@0:2,kill@1:3"
    proc, _ = train(tmp_path, *COMMON, "trainer.max_restarts=3", "trainer.restart_backoff_s=0", faults=faults)
    assert proc.returncode == 0, proc.stderr[-3000:]
    restarts = [line for line in proc.stdout.splitlines() if "modelpar-train: restart" in line]
    assert [line.split(" after: ")[1].split(" (")[0] for line in restarts] == [
        "rank 1 died",
        "rank 0 died",
        "rank 1 died",
    ]
    assert len((tmp_path / "restarts.jsonl").read_text().splitlines()) == 3
    _assert_same_weights(final_weights(tmp_path, 4), straight)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="no torchrun")
def test_torchrun_max_restarts_resumes_each_new_worker_from_the_newest_checkpoint(tmp_path, straight):
    env = dict(
        os.environ,
        MODELPAR_FAULTS="kill@1:2,kill@0:3",
        MODELPAR_FAULTS_FIRED=str(tmp_path / "fired"),  # what the local launcher sets; torchrun does not
    )
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [
        torchrun, "--nnodes=1", "--nproc-per-node=2", "--max-restarts=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.5", "-m", "modelpar.cli.train",
        *SMALL, *COMMON, f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert sorted(os.listdir(tmp_path / "fired")) == ["kill@0:3", "kill@1:2"]
    # the survivor of each kill says so in one line; its traceback goes beside the run, not to the terminal
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[-3000:]
    for line in proc.stderr.splitlines():
        assert "lost a peer" not in line or line.startswith("modelpar-train: rank "), line
    _assert_same_weights(final_weights(tmp_path, 4), straight)
