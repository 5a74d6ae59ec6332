"""trainer.ckpt_async=true: checkpoints written in the background hold what a synchronous save holds, each
save's stall and wait are in the metrics, and a rank killed while its writer runs leaves latest on the last
complete checkpoint, from which the run (restarted on its own) ends with the uninterrupted weights."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import final_weights, train
from tests.training.conftest import DP2_RUN

pytestmark = pytest.mark.slow

COMMON = DP2_RUN


def test_background_saves_equal_synchronous_ones_and_survive_a_kill_mid_write(tmp_path, straight_dp2):
    crashed, _ = train(
        tmp_path / "async", *COMMON, "trainer.ckpt_async=true", "trainer.max_restarts=1",
        "trainer.restart_backoff_s=0", faults="save_crash@1:2",
    )  # fmt: skip
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "restart 1 of 1 in 0 s after: rank 1 died (signal SIGKILL)" in crashed.stdout, crashed.stdout
    assert "resuming from" in crashed.stdout and "step-00000001" in crashed.stdout  # step 2 was never published
    a, b = straight_dp2, final_weights(tmp_path / "async", 4)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    reports = [json.loads(line).get("checkpoint") for line in (tmp_path / "async" / "metrics.jsonl").open()]
    published = [r for r in reports if r and "published" in r]
    assert published and all(r["stall_s"] >= 0 and r["wait_s"] >= 0 for r in published), reports
