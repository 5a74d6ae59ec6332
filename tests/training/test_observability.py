"""What a run leaves behind: metrics.jsonl, the timeline PNG, flight records; and bf16 compute on CPU."""

import json
from dataclasses import replace

import numpy as np
import pytest

from modelpar.testing import run_on_ranks
from tests.helpers import make_config


def fit(cfg, data_path):
    from modelpar.training.trainer import Trainer

    Trainer(cfg, data_path, None).fit()


def losses_of(cfg, data_path):
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    return [trainer.train_step().loss for _ in range(cfg.trainer.steps)]


def test_fit_writes_metrics_timeline_checkpoint_and_flight_records(token_path, tmp_path):
    cfg = make_config(tmp_path, tp=2, pp=2, microbatches=4)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=3, ckpt_every=3, timeline_step=2, check_every=1))
    run_on_ranks(4, fit, cfg, token_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"loss", "lr", "tokens_per_s", "grad_norm", "skipped", "stragglers", "drift"} <= rows[0].keys()
    assert rows[-1]["drift"] == []
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000003"
    flights = sorted((tmp_path / "flight").glob("rank-*.json"))
    assert len(flights) == 4
    record = json.loads(flights[3].read_text())
    assert record["where"] == "pp 1 tp 1 dp 0" and record["events"], record


def test_bf16_compute_on_fp32_master_weights_tracks_fp32(token_path, tmp_path):
    cfg = make_config(tmp_path, pp=2)
    bf16 = replace(cfg, trainer=replace(cfg.trainer, dtype="bf16"))
    (fp32_losses, _), (bf16_losses, _) = (run_on_ranks(2, losses_of, c, token_path) for c in (cfg, bf16))
    assert bf16_losses != fp32_losses  # the setting took effect
    np.testing.assert_allclose(bf16_losses, fp32_losses, rtol=2e-2)


def test_tensorboard_without_the_package_is_one_clear_error(token_path, tmp_path):
    pytest.importorskip("torch")
    try:
        import tensorboard  # noqa: F401

        pytest.skip("tensorboard is installed here")
    except ImportError:
        pass
    from modelpar.testing import RankError

    cfg = make_config(tmp_path)
    cfg = replace(cfg, trainer=replace(cfg.trainer, tensorboard=True))
    with pytest.raises(RankError, match="trainer.tensorboard=true needs the tensorboard package"):
        run_on_ranks(1, fit, cfg, token_path)
