"""Failures are caught, named and survived: hangs, killed ranks, damaged checkpoints, stragglers, drift, NaNs."""

import json
import os
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from modelpar.testing import RankError, run_on_ranks
from tests.helpers import TINY, final_weights, make_config, train

pytestmark = pytest.mark.slow


def test_a_rank_that_sleeps_forever_is_named_within_the_timeout(tmp_path):
    timeout_s = 5
    # native collectives: gloo's recorder logs collectives, not the point-to-point exchange the CPU backend uses
    overrides = ["trainer.steps=4", f"trainer.timeout_s={timeout_s}", "parallel.collectives=native"]
    proc, _ = train(tmp_path, *overrides, faults="sleep@1:1")
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "rank 1 (pp 0 tp 1 dp 0) stuck in 0F0 at step 1" in proc.stderr, proc.stderr[-2000:]
    # torch's recorder, dumped by every stalled rank, names the tensor-parallel all-reduce rank 1 never joined
    assert "torch flight recorder: group tp (ranks 0, 1): collective #" in proc.stderr, proc.stderr[-2000:]
    assert "all_reduce of [[2, 32, 32]] was issued by rank 0, not by rank 1" in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "flight" / "torch").iterdir()) == [f"rank_{r}" for r in range(4)]
    record = json.loads((tmp_path / "flight" / "rank-00001.json").read_text())
    assert record["current"]["action"] == "0F0"
    assert ended - record["current"]["since"] < timeout_s + 30


def test_sigkilled_rank_then_resume_auto_equals_the_uninterrupted_run(tmp_path):
    # two ranks keep it cheap (a 4-rank layout's stuck rank is test_frozen_rank.py's): the last stage dies
    common = ["parallel=pp2", "trainer.steps=4", "trainer.ckpt_every=2", "trainer.timeout_s=20"]
    straight, _ = train(tmp_path / "straight", *common)
    assert straight.returncode == 0, straight.stderr[-2000:]
    crashed, seconds = train(tmp_path / "crash", *common, faults="kill@1:3")
    assert crashed.returncode == 1 and "rank 1 died (signal SIGKILL)" in crashed.stderr, crashed.stderr[-2000:]
    assert seconds < 20 + 60
    resumed, _ = train(tmp_path / "crash", *common, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and "step-00000002" in resumed.stdout
    a, b = final_weights(tmp_path / "straight", 4), final_weights(tmp_path / "crash", 4)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_kill_during_save_and_flipped_byte_resume_from_the_last_good_checkpoint(tmp_path):
    common = ["parallel=pp2", "trainer.steps=6", "trainer.ckpt_every=2", "trainer.keep_last=0"]
    crashed, _ = train(tmp_path, *common, faults="save_crash@0:4")  # dies while writing step 4
    assert crashed.returncode == 1
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step-00000002"
    assert (root / "step-00000004.tmp").is_dir()
    shard = root / "step-00000002" / "model-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    resumed, _ = train(tmp_path, *common, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "ignoring" in resumed.stderr and "step-00000004.tmp" in resumed.stderr
    assert "skipping step-00000002" in resumed.stderr and "model-00001.safetensors fails its SHA-256" in resumed.stderr
    assert (root / "step-00000002.corrupt").is_dir()  # moved aside, not deleted
    events = [json.loads(e) for e in (tmp_path / "security.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["tampered-checkpoint"] and "step-00000002" in events[0]["line"]
    assert (root / "latest").read_text() == "step-00000006"
    assert "resuming from" not in resumed.stdout  # nothing good was left: it started over, without losing files


# -- in-process checks on emulated ranks --------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, TINY.vocab_size, size=4000, dtype=np.uint16))
    return str(path)


def run_with_faults(cfg, data_path, faults: str, steps: int):
    os.environ["MODELPAR_FAULTS"] = faults
    try:
        from modelpar.training.trainer import Trainer

        trainer = Trainer(cfg, data_path, None)
        before = [p.detach().clone() for p, _ in trainer.model.params]
        out = []
        for _ in range(steps):
            m = trainer.train_step()
            out.append((m.step, m.loss, m.skipped, m.skipped_total, m.stragglers, m.drift))
            if m.step == 2:
                after_skip = [p.detach().clone() for p, _ in trainer.model.params]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after_skip, strict=True))
        return out, unchanged
    finally:
        os.environ.pop("MODELPAR_FAULTS")


def checked(cfg, **trainer):
    return replace(cfg, trainer=replace(cfg.trainer, **trainer))


def test_injected_delay_is_reported_as_a_straggler(token_path, tmp_path):
    cfg = checked(make_config(tmp_path, dp=2), check_every=2, straggler_factor=2.0)
    results = run_with_faults_safe(2, cfg, token_path, "delay@1:0:0.2", 2)
    for out, _ in results:
        assert out[1][4] == [1], out


def run_with_faults_safe(world, cfg, token_path, faults, steps):
    return run_on_ranks(world, run_with_faults, cfg, token_path, faults, steps, timeout_s=120)


def test_perturbed_replica_is_reported_as_drift_naming_rank_and_parameter(token_path, tmp_path):
    cfg = checked(make_config(tmp_path, dp=2), check_every=2)
    results = run_with_faults_safe(2, cfg, token_path, "perturb@1:1", 2)
    drift = results[0][0][1][5]
    assert drift and "rank(s) [1]" in drift[0] and "embed_tokens" in drift[0], drift


def test_drift_halts_when_configured(token_path, tmp_path):
    cfg = checked(make_config(tmp_path, dp=2), check_every=2, drift_action="halt")
    with pytest.raises(RankError, match="replica drift at step 2.*halting"):
        run_with_faults_safe(2, cfg, token_path, "perturb@1:1", 2)


def test_injected_nan_skips_the_step_on_every_rank(token_path, tmp_path):
    cfg = make_config(tmp_path, tp=2, pp=2)
    for out, unchanged in run_with_faults_safe(4, cfg, token_path, "nan@0:0,nan@0:1", 3):
        assert [o[2] is not None for o in out] == [True, True, False]
        assert "non-finite loss" in out[0][2] and out[-1][3] == 2
        assert unchanged, "a skipped step must not change any parameter"


def test_injected_nan_halts_when_configured(token_path, tmp_path):
    cfg = checked(make_config(tmp_path, tp=2), nonfinite="halt")
    with pytest.raises(RankError, match="step 1: non-finite loss nan.*halting"):
        run_with_faults_safe(2, cfg, token_path, "nan@0:1", 3)
