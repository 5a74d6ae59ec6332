"""Silent data corruption: one flipped bit in one rank's activation is caught by rerunning the first
micro-batch, the rank is named, and honest steps rerun bit-exact under every schedule."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from modelpar.model.config import MoEConfig
from modelpar.pipeline.schedule import SCHEDULES, V_SCHEDULES, single_micro_batch
from modelpar.pipeline.simulate import check_schedule
from modelpar.testing import run_on_ranks
from modelpar.training.sdc import bit_checksum
from tests.helpers import TINY, make_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_checksum_sees_any_single_bit(dtype):
    x = torch.randn(257, dtype=torch.float64).to(dtype)
    base = bit_checksum(x)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    for position in (0, 100, 256):
        for bit in (0, 7, x.element_size() * 8 - 1):
            y = x.clone()
            y.view(ints)[position] ^= torch.tensor(1, dtype=ints) << bit
            assert bit_checksum(y) != base, (position, bit)
    assert bit_checksum(x.clone()) == base


@pytest.mark.parametrize(
    "name, pp", [(n, pp) for n in sorted(SCHEDULES) for pp in (1, 2, 3) if n != "interleaved" or pp >= 2]
)
def test_the_rerun_schedule_is_valid_for_every_schedule(name, pp):
    vpp = 2 if name in ("interleaved", *V_SCHEDULES) else 1
    schedule = single_micro_batch(name, pp, vpp)
    check_schedule(schedule)
    kinds = {a.kind.value for row in schedule for a in row if a.kind.is_compute}
    assert ("W" in kinds) == (name in ("zb-h1", *V_SCHEDULES))  # the split backward is replayed as it ran


@pytest.fixture(scope="module")
def token_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, TINY.vocab_size, size=4000, dtype=np.uint16))
    return str(path)


def _train(cfg, data_path: str, faults: str) -> tuple[list, list]:
    from modelpar.training.health import HealthError
    from modelpar.training.trainer import Trainer

    os.environ["MODELPAR_FAULTS"] = faults
    try:
        trainer = Trainer(cfg, data_path, None)
        skipped, losses = [], []
        while trainer.step < cfg.trainer.steps:
            try:
                m = trainer.train_step()
            except HealthError as exc:
                skipped.append(f"halted: {exc}")
                break
            skipped.append(m.skipped)
            losses.append(m.loss)
        return skipped, losses
    finally:
        del os.environ["MODELPAR_FAULTS"]


def _config(tmp_path, action="skip", **parallel):
    cfg = make_config(tmp_path, **parallel)
    return replace(cfg, trainer=replace(cfg.trainer, steps=3, sdc_check_every=1, sdc_action=action))


@pytest.mark.parametrize(
    "parallel, world, bad, where",
    [
        ({"tp": 2, "pp": 2}, 4, 1, "pp 0 tp 1 dp 0"),
        ({"tp": 2, "pp": 2, "sp": True}, 4, 2, "pp 1 tp 0 dp 0"),
        ({"pp": 2, "schedule": "zb-h1", "recompute": "full"}, 2, 0, "pp 0 tp 0 dp 0"),
        ({"pp": 2, "vpp": 2, "schedule": "interleaved", "microbatches": 2}, 2, 1, "pp 1 tp 0 dp 0"),
        ({"dp": 2, "zero": 1}, 2, 1, "pp 0 tp 0 dp 1"),
        # experts over ep2, the aux loss over the whole batch: the rerun takes the step's counts, not its own
        ({"dp": 2, "ep": 2, "microbatches": 2, "schedule": "gpipe", "moe": True}, 2, 1, "pp 0 tp 0 dp 1"),
    ],
    ids=["tp2-pp2", "tp2-pp2-sp", "pp2-zb-recompute", "pp2-interleaved", "dp2-zero1", "dp2-ep2-moe"],
)
def test_a_flipped_bit_is_named_with_its_rank_and_honest_steps_pass(parallel, world, bad, where, token_path, tmp_path):
    parallel = dict(parallel)
    zero = parallel.pop("zero", 0)
    moe = parallel.pop("moe", False)
    cfg = _config(tmp_path, **parallel)
    cfg = replace(cfg, optim=replace(cfg.optim, zero=zero))
    if moe:
        experts = MoEConfig(experts=4, top_k=2, ffn_hidden=24, aux_loss_coef=0.05, z_loss_coef=0.01)
        cfg = replace(cfg, model=replace(cfg.model, tie_embeddings=False, moe=experts))
    per_rank = run_on_ranks(world, _train, cfg, token_path, f"bitflip@{bad}:1", timeout_s=180)
    for skipped, _ in per_rank:
        assert skipped[0] is None and skipped[2] is None, skipped  # reruns of honest steps are bit-exact
        message = skipped[1]
        assert message and "silent data corruption at step 1" in message, skipped
        assert f"rank {bad} ({where})" in message, message
        assert message.count("computed a different") == 1, message  # only the corrupted rank is named


def test_sdc_halt_stops_every_rank_with_the_rank_named(token_path, tmp_path):
    cfg = _config(tmp_path, action="halt", tp=2)
    for skipped, _ in run_on_ranks(2, _train, cfg, token_path, "bitflip@0:1", timeout_s=120):
        assert skipped[0] is None and len(skipped) == 2, skipped  # every rank stops at the same step
        assert skipped[1].startswith("halted: silent data corruption at step 1"), skipped
        assert "rank 0 (pp 0 tp 0 dp 0)" in skipped[1] and "trainer.sdc_action=halt" in skipped[1]


def test_the_check_changes_no_result(token_path, tmp_path):
    """With the check on (and nothing corrupted), the losses equal a run without it, bit for bit."""
    base = make_config(tmp_path, pp=2, tp=2)
    with_check = _config(tmp_path, tp=2, pp=2)
    plain = run_on_ranks(
        4, _train, replace(base, trainer=replace(base.trainer, steps=3)), token_path, "", timeout_s=120
    )
    checked = run_on_ranks(4, _train, with_check, token_path, "", timeout_s=120)
    for (skip_a, loss_a), (skip_b, loss_b) in zip(plain, checked, strict=True):
        assert skip_a == skip_b == [None, None, None]
        assert loss_a == loss_b


def test_the_command_line_names_the_corrupted_rank_in_one_line(tmp_path):
    from tests.helpers import train

    proc, seconds = train(tmp_path, "trainer.steps=4", "trainer.sdc_check_every=2", faults="bitflip@3:1")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("modelpar-train: halted: HealthError: silent data corruption at step 1")
    assert "rank 3 (pp 1 tp 1 dp 0) computed a different" in lines[0], lines[0]
