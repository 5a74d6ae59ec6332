"""Resuming on what is left (trainer.elastic): a run that loses ranks continues on the world that remains, with
dp re-chosen and the global batch and sample order kept, and its losses stay those of the uninterrupted run."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from modelpar.testing import run_on_ranks
from modelpar.training.config import RecipeError
from modelpar.training.elastic import available_world, elastic_config
from tests.helpers import assemble, final_weights, make_config, train, train_and_collect
from tests.training.conftest import DP2_RUN


def _elastic(cfg, **trainer):
    return replace(cfg, trainer=replace(cfg.trainer, elastic=True, **trainer))


def test_dp4_on_two_ranks_becomes_dp2_with_the_same_micro_batch_size(tmp_path):
    cfg, note = elastic_config(_elastic(make_config(tmp_path, dp=4)), 2)  # 8 sequences: 2 micro-batches of 1
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp, p.microbatches, cfg.data.global_batch) == (1, 1, 2, 4, 8)
    assert note == (
        "elastic: 2 ranks available; layout tp1-pp1-dp4 -> tp1-pp1-dp2, micro-batches 2 -> 4, global batch 8 kept"
    )


def test_tp2_pp2_dp2_on_four_ranks_keeps_tp_and_pp(tmp_path):
    cfg, _ = elastic_config(_elastic(make_config(tmp_path, tp=2, pp=2, dp=2)), 4)
    assert str(cfg.parallel.layout()) == "tp2-pp2-dp1" and cfg.parallel.microbatches == 4


def test_a_world_whose_dp_would_not_divide_the_batch_leaves_a_rank_idle(tmp_path):
    cfg, note = elastic_config(_elastic(make_config(tmp_path, dp=4)), 3)  # dp3 does not divide 8 sequences
    assert cfg.parallel.dp == 2 and "using 2 of them (1 idle)" in note


def test_ep_that_no_longer_divides_dp_is_narrowed(tmp_path):
    cfg = make_config(tmp_path, dp=4, ep=4)
    cfg = replace(cfg, model=replace(cfg.model, moe=replace(cfg.model.moe, experts=4, top_k=2)))
    new, _ = elastic_config(_elastic(cfg), 2)
    assert (new.parallel.dp, new.parallel.ep) == (2, 2)


def test_a_world_smaller_than_tp_x_pp_is_refused_in_one_line(tmp_path):
    with pytest.raises(RecipeError, match=r"no layout keeps tp=2 x pp=2 x cp=1 \(4 ranks a replica\) on the 3") as e:
        elastic_config(_elastic(make_config(tmp_path, tp=2, pp=2)), 3)
    assert "\n" not in str(e.value)


def test_without_elastic_another_world_is_refused_naming_the_switch(tmp_path):
    cfg = make_config(tmp_path, dp=4)
    assert available_world(cfg) == 4
    with pytest.raises(RecipeError, match="1 rank\\(s\\) of the job are lost, leaving 3 ranks.*trainer.elastic=true"):
        available_world(cfg, lost=1)
    with pytest.raises(RecipeError, match="trainer.world=2, leaving 2 ranks"):
        available_world(replace(cfg, trainer=replace(cfg.trainer, world=2)))
    assert available_world(_elastic(cfg, world=2), lost=1) == 1


# -- the same function on fewer ranks: saved at step 2 of 4 on the recipe's layout, resumed on the smaller world


def _resumed_on(world, source, token_path, tmp_path):
    """The uninterrupted run of ``source`` (4 steps, saved at 2) and the run resumed at step 2 on ``world``."""
    source = dict(source)
    moe = source.pop("moe", None)
    cfg = make_config(tmp_path / "a", **source)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=4))
    if moe is not None:
        cfg = replace(cfg, model=replace(cfg.model, moe=replace(cfg.model.moe, **moe)))
    straight = run_on_ranks(cfg.parallel.layout().world_size, train_and_collect, cfg, token_path, None, (2,))
    smaller, _ = elastic_config(_elastic(cfg, out_dir=str(tmp_path / "b")), world)
    assert smaller.parallel.layout().world_size == world
    ckpt = str(tmp_path / "a" / "checkpoints" / "step-00000002")
    return straight, run_on_ranks(world, train_and_collect, smaller, token_path, ckpt)


@pytest.mark.parametrize(
    "source, world",
    [
        (dict(dp=4), 2),
        (dict(tp=2, dp=2), 2),
        # experts over ep2 stay ep2; dropless routing and the sequence-wise balance loss see the same tokens
        (dict(dp=4, ep=2, moe=dict(experts=4, top_k=2, aux_loss_coef=0.01, aux_loss_scope="sequence")), 2),
        pytest.param(
            dict(tp=2, pp=2, dp=2),
            4,
            marks=pytest.mark.skipif(
                not os.environ.get("MODELPAR_TEST_EIGHT_RANKS"),
                reason="8 ranks: opt in with MODELPAR_TEST_EIGHT_RANKS=1 (too heavy for the 2-core suite)",
            ),
        ),
    ],
    ids=["dp4-to-dp2", "tp2dp2-to-tp2", "moe-dp4ep2-to-dp2ep2", "tp2pp2dp2-to-tp2pp2"],
)
def test_resumed_on_fewer_ranks_the_losses_are_the_uninterrupted_runs(token_path, tmp_path, source, world):
    straight, resumed = _resumed_on(world, source, token_path, tmp_path)
    losses = straight[0][0]
    assert len(losses) == 4 and all(np.isfinite(losses).all() for losses, _ in straight)
    for mine, _ in resumed:
        np.testing.assert_allclose(mine, losses[2:], rtol=1e-5)
    after, before = assemble(resumed), assemble(straight)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=1e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_a_lost_rank_restarts_the_job_on_the_ranks_left_from_the_newest_checkpoint(tmp_path, straight_dp2):
    overrides = ("trainer.max_restarts=1", "trainer.restart_backoff_s=0", "trainer.elastic=true")
    proc, _ = train(tmp_path, *DP2_RUN, *overrides, faults="lose@1:2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "modelpar-train: restart 1 of 1 in 0 s after: rank 1 died (signal SIGKILL)" in out
    assert "elastic: 1 ranks available; layout tp1-pp1-dp2 -> tp1-pp1-dp1, micro-batches 1 -> 2" in out
    assert "resuming from" in out and "step-00000002" in out
    assert os.listdir(tmp_path / "flight" / "lost") == ["lose@1:2"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [3, 4]
    weights = final_weights(tmp_path, 4)
    assert weights.keys() == straight_dp2.keys()
    for name, tensor in straight_dp2.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")
