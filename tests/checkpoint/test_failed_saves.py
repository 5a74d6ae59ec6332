"""A checkpoint save that fails (disk full, I/O error) loses nothing: ``latest`` stays on the last good
checkpoint, the partial files move aside, every rank gets the same one-line error, and training goes on or
halts as configured. A save that cannot fit is refused before anything is written."""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from modelpar.checkpoint.save import CheckpointSaveError, save_checkpoint
from modelpar.checkpoint.store import CheckpointError, Piece, checkpoint_dirs, load_pieces, read_index, step_dir
from modelpar.testing import run_on_ranks
from tests.helpers import TINY, make_config


def _save(root: Path, step: int):
    pieces = {Piece.whole("w", (64, 64)): torch.ones(64, 64)}
    return save_checkpoint(root, step, pieces, {"rng": torch.zeros(4)}, {"layout": {}})


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    with pytest.raises(CheckpointSaveError, match=r"step 2 not saved: it needs 1\.0 MiB under .* only 0\.0 MiB"):
        _save(tmp_path, 2)
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]  # nothing written


def test_an_io_error_while_writing_leaves_latest_and_moves_the_partial_files_aside(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    import modelpar.checkpoint.save as store

    def full_disk(path, tensors):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(store, "_save_tensors", full_disk)
    with pytest.raises(CheckpointSaveError) as caught:
        _save(tmp_path, 2)
    message = str(caught.value)
    assert "\n" not in message and "rank 0: No space left on device (ENOSPC)" in message, message
    assert "latest still names the previous checkpoint" in message
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert (tmp_path / "step-00000002.failed").is_dir() and not (tmp_path / "step-00000002.tmp").exists()
    monkeypatch.undo()
    with pytest.raises(CheckpointSaveError):  # a second failure of the same step is kept beside the first
        monkeypatch.setattr(store, "_save_tensors", full_disk)
        _save(tmp_path, 2)
    monkeypatch.undo()
    assert (tmp_path / "step-00000002.failed-2").is_dir()
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step-00000001"]
    _save(tmp_path, 2)  # the disk has room again: the step saves normally
    assert (tmp_path / "latest").read_text() == "step-00000002"
    read_index(tmp_path / "step-00000002")


def test_an_existing_checkpoint_is_never_overwritten(tmp_path):
    _save(tmp_path, 3)
    with pytest.raises(CheckpointError, match="already exists; refusing to overwrite"):
        _save(tmp_path, 3)


@pytest.fixture(scope="module")
def token_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, TINY.vocab_size, size=4000, dtype=np.uint16))
    return str(path)


def _fit(cfg, data_path: str, faults: str) -> str | None:
    from modelpar.training.trainer import Trainer

    os.environ["MODELPAR_FAULTS"] = faults
    try:
        Trainer(cfg, data_path, None).fit()
        return None
    except CheckpointSaveError as exc:
        return str(exc)
    finally:
        del os.environ["MODELPAR_FAULTS"]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    index = read_index(ckpt)
    wanted = [Piece.whole(name, tuple(t["global_shape"])) for name, t in index["tensors"].items()]
    return {p.name: t for p, t in load_pieces(ckpt, index, wanted).items()}


def _config(out_dir: Path, action: str):
    cfg = make_config(out_dir, tp=2, pp=2)
    trainer = replace(cfg.trainer, steps=6, ckpt_every=2, keep_last=0, save_error=action, out_dir=str(out_dir))
    return replace(cfg, trainer=trainer)


def test_a_failed_save_on_one_rank_continues_and_loses_nothing(token_path, tmp_path, capfd):
    straight = run_on_ranks(4, _fit, _config(tmp_path / "straight", "continue"), token_path, "", timeout_s=180)
    assert straight == [None] * 4
    failing = run_on_ranks(
        4, _fit, _config(tmp_path / "failing", "continue"), token_path, "save_error@2:4", timeout_s=180
    )
    assert failing == [None] * 4  # training went on
    root = tmp_path / "failing" / "checkpoints"
    assert [p.name for p in checkpoint_dirs(root)] == ["step-00000002", "step-00000006"]
    assert (root / "step-00000004.failed").is_dir()
    a, b = _weights(step_dir(tmp_path / "straight" / "checkpoints", 6)), _weights(step_dir(root, 6))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_failed_save_halts_when_configured_with_one_message_everywhere(token_path, tmp_path):
    messages = run_on_ranks(4, _fit, _config(tmp_path, "halt"), token_path, "save_error@1:4", timeout_s=180)
    assert len(set(messages)) == 1, messages  # the same verdict on every rank
    message = messages[0]
    assert "checkpoint of step 4 not saved (rank 1: No space left on device (fault save_error) (ENOSPC)" in message
    assert message.endswith("halting (trainer.save_error=halt)") and "\n" not in message
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step-00000002"
    assert (root / "step-00000004.failed").is_dir()
