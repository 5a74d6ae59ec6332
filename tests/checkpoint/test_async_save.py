"""Asynchronous checkpoints: the files hold the values of the snapshot, whatever training does to the tensors
while the writer runs, byte for byte what a synchronous save writes; a writer's failure surfaces at the finish
as the one-line save error with ``latest`` untouched."""

from __future__ import annotations

import errno
import json

import pytest
import torch

import modelpar.checkpoint.save as save_module
from modelpar.checkpoint.async_save import AsyncCheckpointer
from modelpar.checkpoint.save import CheckpointSaveError, prepare_save, save_checkpoint
from modelpar.checkpoint.store import Piece, load_pieces, read_index, step_dir


def _state(value: float):
    weight = torch.full((6, 4), value)
    pieces = {Piece.whole("layers.0.w", (6, 4)): weight}
    return weight, pieces, {"rng": torch.arange(4.0)}


def test_the_files_hold_the_snapshot_byte_for_byte_what_a_synchronous_save_writes(tmp_path):
    weight, pieces, rank_state = _state(1.5)
    save_checkpoint(tmp_path / "sync", 3, pieces, rank_state, {"layout": {}})
    writer = AsyncCheckpointer()
    writer.start(prepare_save(tmp_path / "async", 3, pieces, rank_state, {"layout": {}}))
    assert writer.in_flight == 3
    writer.wait_snapshot()  # the fence before the next optimizer step
    weight.add_(100.0)  # the next optimizer step, while the writer runs
    path, _ = writer.finish()
    assert writer.in_flight is None and (tmp_path / "async" / "latest").read_text() == path.name
    sync, fresh = read_index(step_dir(tmp_path / "sync", 3)), read_index(path)
    assert json.dumps(sync["files"], sort_keys=True) == json.dumps(fresh["files"], sort_keys=True)  # same SHA-256s
    loaded = load_pieces(path, fresh, [Piece.whole("layers.0.w", (6, 4))])
    assert torch.equal(next(iter(loaded.values())), torch.full((6, 4), 1.5))


def test_a_failed_background_write_is_the_one_line_save_error_and_latest_stays(tmp_path, monkeypatch):
    weight, pieces, rank_state = _state(1.0)
    save_checkpoint(tmp_path, 1, pieces, rank_state, {"layout": {}})

    def full_disk(path, tensors):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(save_module, "_save_tensors", full_disk)
    writer = AsyncCheckpointer()
    writer.start(prepare_save(tmp_path, 2, pieces, rank_state, {"layout": {}}))
    with pytest.raises(CheckpointSaveError) as caught:
        writer.finish()
    assert "\n" not in str(caught.value) and "No space left on device (ENOSPC)" in str(caught.value)
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert (tmp_path / "step-00000002.failed").is_dir()


def test_a_second_start_while_one_is_in_flight_is_refused(tmp_path):
    _, pieces, rank_state = _state(1.0)
    writer = AsyncCheckpointer()
    writer.start(prepare_save(tmp_path, 1, pieces, rank_state, {"layout": {}}))
    with pytest.raises(RuntimeError, match="still in flight"):
        writer.start(prepare_save(tmp_path, 2, pieces, rank_state, {"layout": {}}))
    writer.finish()


def test_the_fence_holds_the_update_until_the_copy_is_made_and_buffers_are_kept_for_the_next_save(
    tmp_path, monkeypatch
):
    import time

    weight, pieces, rank_state = _state(2.0)
    writer = AsyncCheckpointer()
    stage = AsyncCheckpointer._stage

    def slow_stage(self, *args):
        time.sleep(0.3)  # a copy that is still running when the next step wants to update
        return stage(self, *args)

    monkeypatch.setattr(AsyncCheckpointer, "_stage", slow_stage)
    blocking = writer.start(prepare_save(tmp_path, 1, pieces, rank_state, {"layout": {}}))
    assert blocking < 0.3  # the copy is the writer's, not the save call's
    assert writer.wait_snapshot() > 0.2
    weight.add_(100.0)
    first, _ = writer.finish()
    buffers = dict(writer._staging)
    assert writer.staged_bytes == weight.numel() * 4
    writer.start(prepare_save(tmp_path, 2, pieces, rank_state, {"layout": {}}))
    writer.wait_snapshot()
    second, _ = writer.finish()
    assert all(writer._staging[k] is v for k, v in buffers.items())  # the same host buffers, not new ones
    for path, value in ((first, 2.0), (second, 102.0)):
        loaded = load_pieces(path, read_index(path), [Piece.whole("layers.0.w", (6, 4))])
        assert torch.equal(next(iter(loaded.values())), torch.full((6, 4), value))
