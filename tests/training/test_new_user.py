"""Paths a new user meets first: a missing GPU, a plain token file, torchrun's banner, a resume's hashing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from modelpar.testing import run_on_ranks
from modelpar.training.config import RecipeError, validate
from modelpar.training.preflight import check_device
from tests import warm_cli
from tests.helpers import SMALL, make_config, train_and_collect

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_requested_without_one_is_a_single_line(tmp_path):
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", "trainer.device=cuda", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "trainer.device=cuda but no CUDA device is visible" in lines[0]


def test_exchange_collectives_are_refused_for_gpu_ranks(monkeypatch, tmp_path):
    cfg = make_config(tmp_path)
    cfg = replace(cfg, parallel=replace(cfg.parallel, collectives="exchange"))
    check_device(cfg)  # CPU ranks: fine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RecipeError, match="parallel.collectives=exchange runs on gloo"):
        check_device(replace(cfg, trainer=replace(cfg.trainer, device="auto")))


@pytest.mark.slow
def test_training_on_a_plain_token_file_exits_zero_without_a_sample(tmp_path):
    tokens = tmp_path / "mine.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, size=20000, dtype=np.uint16))
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", *[o for o in SMALL if "sample_tokens" not in o],
         f"data.path={tokens}", "trainer.steps=2", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "modelpar-train: no sample" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_under_torchrun_the_banner_is_printed_once(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with socket.socket() as s:  # a free port for torchrun's store (0 is not passed on to the ranks)
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port,
         "-m", "modelpar.cli.train", *SMALL, "parallel=pp2", "trainer.steps=2", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    banners = [line for line in proc.stdout.splitlines() if " on tp1-pp2-dp1 (2 ranks)" in line]
    assert len(banners) == 1, proc.stdout


def _hashes_while_resuming(cfg, data_path: str, ckpt: str) -> int:
    from modelpar.checkpoint import store
    from modelpar.training.trainer import Trainer

    hashed = []
    real = store.sha256_file
    store.sha256_file = lambda path: hashed.append(path) or real(path)
    try:
        Trainer(cfg, data_path, ckpt)
    finally:
        store.sha256_file = real
    return len(hashed)


def test_a_resume_hashes_the_checkpoint_once_on_rank_0(token_path, tmp_path):
    cfg = make_config(tmp_path, pp=2)
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=1))
    run_on_ranks(2, train_and_collect, cfg, token_path, None, (1,))
    ckpt = str(tmp_path / "checkpoints" / "step-00000001")
    files = len(list(Path(ckpt).glob("*.safetensors")))
    assert run_on_ranks(2, _hashes_while_resuming, cfg, token_path, ckpt) == [files, 0]


def test_the_expert_parallel_hint_lists_only_values_every_check_accepts(tmp_path):
    cfg = make_config(tmp_path, dp=2, ep=2, microbatches=1)
    cfg = replace(cfg, model=replace(cfg.model, moe=replace(cfg.model.moe, experts=3)))
    with pytest.raises(RecipeError, match=r"try ep in \[1\]$"):
        validate(cfg)
    for ep in (1, 3):
        cfg = replace(cfg, parallel=replace(cfg.parallel, ep=ep))
        if ep == 1:
            validate(cfg)
        else:
            with pytest.raises(RecipeError, match="must divide model.moe.experts=3 and dp x cp = 2"):
                validate(cfg)
