"""Checkpoint store: any layout reads any other's pieces; damage is detected and named."""

import json

import pytest
import torch

from modelpar.checkpoint.save import save_checkpoint
from modelpar.checkpoint.store import (
    CheckpointError,
    Piece,
    latest_checkpoint,
    load_pieces,
    load_rank_state,
    read_index,
    step_dir,
)
from modelpar.testing import run_on_ranks

FULL = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
NORM = torch.arange(5, dtype=torch.float32)


def _split(rank: int, world: int, dim: int) -> Piece:
    size = FULL.shape[dim] // world
    region = [(0, n) for n in FULL.shape]
    region[dim] = (rank * size, (rank + 1) * size)
    return Piece("w", tuple(FULL.shape), tuple(region))


def _local(piece: Piece) -> torch.Tensor:
    return FULL[tuple(slice(a, b) for a, b in piece.region)].clone()


def _save_split(root, step, keep_last=0):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    piece = _split(rank, world, dim=0)
    model = {piece: _local(piece), Piece.whole("norm", (5,)): NORM.clone()}  # norm replicated on every rank
    state = {"exp_avg": torch.full((2,), float(rank))}
    return str(save_checkpoint(root, step, model, state, {"layout": {"tp": world}}, keep_last=keep_last))


def test_two_rank_save_loads_into_one_and_three_way_splits(tmp_path):
    (path,) = set(run_on_ranks(2, _save_split, tmp_path, 10))
    index = read_index(path)
    assert len(index["tensors"]["norm"]["pieces"]) == 1, "a replicated tensor is written once"
    whole = load_pieces(path, index, [Piece.whole("w", (6, 5))])
    assert torch.equal(next(iter(whole.values())), FULL)
    for r in range(3):
        cols = Piece("w", (6, 5), ((0, 6), (r * 2, min(5, r * 2 + 2))))
        got = load_pieces(path, index, [cols])[cols]
        assert torch.equal(got, FULL[:, r * 2 : r * 2 + 2])
    assert torch.equal(load_rank_state(path, 1)["exp_avg"], torch.ones(2))
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 10)


def test_keep_last_prunes_old_checkpoints_and_never_overwrites(tmp_path):
    for step in (1, 2, 3):
        run_on_ranks(2, _save_split, tmp_path, step, 2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
    with pytest.raises(Exception, match="refusing to overwrite"):
        run_on_ranks(2, _save_split, tmp_path, 3)


def _saved(tmp_path):
    (path,) = set(run_on_ranks(2, _save_split, tmp_path, 5))
    return step_dir(tmp_path, 5)


def test_flipped_byte_is_named(tmp_path):
    ckpt = _saved(tmp_path)
    target = ckpt / "model-00001.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model-00001.safetensors fails its SHA-256 check"):
        read_index(ckpt)


def test_missing_extra_and_truncated_shards_are_named(tmp_path):
    ckpt = _saved(tmp_path)
    shard = ckpt / "rank-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="rank-00001.safetensors has .* bytes, expected .*truncated"):
        read_index(ckpt)
    shard.unlink()
    with pytest.raises(CheckpointError, match="rank-00001.safetensors is missing"):
        read_index(ckpt)
    shard.write_bytes(data)
    (ckpt / "model-00009.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match="model-00009.safetensors is not listed"):
        read_index(ckpt)


def test_crash_during_save_leaves_latest_on_the_last_complete_checkpoint(tmp_path):
    ckpt = _saved(tmp_path)
    half_written = step_dir(tmp_path, 6).with_name("step-00000006.tmp")
    half_written.mkdir()
    (half_written / "model-00000.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == ckpt
    run_on_ranks(2, _save_split, tmp_path, 6)  # a later save replaces the debris
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 6)


def test_index_that_is_not_json_is_named(tmp_path):
    ckpt = _saved(tmp_path)
    (ckpt / "index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json is not valid JSON"):
        read_index(ckpt)


def test_shape_mismatch_is_named(tmp_path):
    ckpt = _saved(tmp_path)
    index = read_index(ckpt)
    with pytest.raises(CheckpointError, match=r"w: checkpoint shape \(6, 5\) != model shape \(6, 4\)"):
        load_pieces(ckpt, index, [Piece.whole("w", (6, 4))])
    assert json.loads((ckpt / "index.json").read_text())["step"] == 5
