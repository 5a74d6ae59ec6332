"""A poisoned or faulty dp replica is named (rank, coordinates, statistic), and every rank acts alike."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from modelpar.testing import run_on_ranks
from tests.helpers import make_config


@pytest.fixture(scope="module")
def token_path(tmp_path_factory):
    """Text with structure (a repeated phrase, a few random ids): honest replicas' gradients agree."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids = np.tile(np.arange(7, dtype=np.uint16) * 5, 600)
    noise = rng.random(ids.size) < 0.05
    ids[noise] = rng.integers(0, 61, size=int(noise.sum()), dtype=np.uint16)
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, ids)
    return str(path)


def _train_with_fault(cfg, data_path: str, faults: str) -> list:
    from modelpar.training.health import HealthError
    from modelpar.training.trainer import Trainer

    os.environ["MODELPAR_FAULTS"] = faults
    try:
        trainer = Trainer(cfg, data_path, None)
        out = []
        while trainer.step < cfg.trainer.steps:
            try:
                out.append(trainer.train_step().skipped)
            except HealthError as exc:
                out.append(f"halted: {exc}")
                break
        return out
    finally:
        del os.environ["MODELPAR_FAULTS"]


@pytest.mark.parametrize(
    "faults, statistic",
    [("grad_flip@2:1", "cosine -"), ("grad_scale@1:1:100", "x the median")],
    ids=["flipped", "scaled"],
)
def test_a_poisoned_replica_is_named_and_its_step_skipped_everywhere(faults, statistic, token_path, tmp_path):
    cfg = make_config(tmp_path, dp=4, microbatches=1)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=3, grad_outlier_action="skip"))
    bad = int(faults.split("@")[1].split(":")[0])
    per_rank = run_on_ranks(4, _train_with_fault, cfg, token_path, faults, timeout_s=120)
    for skipped in per_rank:
        assert skipped[0] is None and skipped[2] is None, skipped  # honest steps pass
        assert f"rank {bad} (pp 0 tp 0 dp {bad})" in skipped[1] and statistic in skipped[1], skipped[1]
        assert skipped[1].count("rank ") == 1  # only the poisoned one is named
    assert len({tuple(s) for s in per_rank}) == 1  # the same decision on every rank


def test_halt_stops_every_rank_with_the_same_line(token_path, tmp_path):
    cfg = make_config(tmp_path, dp=4, microbatches=1)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=3, grad_outlier_action="halt"))
    per_rank = run_on_ranks(4, _train_with_fault, cfg, token_path, "grad_flip@3:1", timeout_s=120)
    assert all(r[-1].startswith("halted: gradient outlier at step 2: rank 3") for r in per_rank), per_rank
    events = [json.loads(e) for e in (Path(cfg.trainer.out_dir) / "security.jsonl").read_text().splitlines()]
    assert [(e["event"], e["rank"]) for e in events] == [("poisoned-replica", 3)]  # recorded once, by rank 0
    assert events[0]["line"].startswith("gradient outlier at step 2: rank 3")
