"""Fixtures the training tests share."""

import pytest

from tests.helpers import final_weights, train

# A two-rank job that checkpoints every step: what the restart and background-save tests kill and resume.
DP2_RUN = ["parallel=single", "parallel.dp=2", "trainer.steps=4", "trainer.ckpt_every=1", "trainer.timeout_s=30"]


@pytest.fixture(scope="session")
def straight_dp2(tmp_path_factory):
    """The final weights of ``DP2_RUN`` uninterrupted (run once for every test that compares with it)."""
    run = tmp_path_factory.mktemp("straight")
    proc, _ = train(run, *DP2_RUN)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return final_weights(run, 4)
