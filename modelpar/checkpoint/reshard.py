"""Logical pieces of a rank's model and optimizer: what a checkpoint saves, and how any layout loads it back.

A rank holds regions of logical (HF-named, layout-free) tensors; ``model_pieces`` names them as ``Piece``s
for ``save_checkpoint``, and loading asks the checkpoint for exactly the regions the new layout holds, which
is all resharding is. The Adam moments are saved the same way, as ``<moment>/<tensor name>``, and Muon's
momentum buffer as ``momentum_buffer/<tensor name>``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from modelpar.checkpoint.store import Piece, load_pieces
from modelpar.model.layers import ShardInfo
from modelpar.model.transformer import ModelChunk
from modelpar.optim.fsdp import full_local, is_sharded, load_local, local
from modelpar.optim.param_info import ParamsWithInfo
from modelpar.optim.state import MOMENTS, moment_kinds, switch_error


def model_pieces(chunks: list[ModelChunk]) -> dict[Piece, torch.Tensor]:
    """This rank's regions of every logical tensor, for ``save_checkpoint``. Parameters sharded over dp
    (ZeRO-2/3) are gathered first (collective over dp x cp: every rank there holds the same pieces)."""
    whole: dict[int, torch.Tensor] = {}
    out = {}
    for piece, shard in _pieces_and_shards(chunks):
        if is_sharded(shard.param):
            if id(shard.param) not in whole:
                whole[id(shard.param)] = full_local(shard.param.detach())
            out[piece] = whole[id(shard.param)][shard.local_rows]
        else:
            out[piece] = shard.tensor
    return out


def optimizer_pieces(chunks: list[ModelChunk], optimizer) -> tuple[dict[Piece, torch.Tensor], float | None]:
    """This rank's regions of the Adam moments of every logical tensor, named ``<moment>/<tensor name>`` (the
    layout-free form of the optimizer state), and torch's AdamW step count; ``({}, None)`` before the first
    step or when parameters disagree on it. ``optimizer`` is a ``modelpar.optim.DataParallelOptimizer``;
    collective over dp under ZeRO-1 (the moments are gathered)."""
    gathered = optimizer.full_moments()
    if gathered is None:
        return {}, None
    state_of, step = gathered
    pieces = {}
    for piece, shard in _pieces_and_shards(chunks):
        state = state_of.get(id(shard.param))
        if not state:
            continue
        for kind in state:
            moment = state[kind].detach()[shard.local_rows]
            pieces[Piece(f"{kind}/{piece.name}", piece.global_shape, piece.region)] = moment
    return pieces, step


def _pieces_and_shards(chunks: list[ModelChunk]):
    for chunk in chunks:
        for name, shard in chunk.logical_shards().items():
            region = tuple(
                (sl.start or 0, n if sl.stop is None else sl.stop)
                for sl, n in zip(shard.index, shard.global_shape, strict=True)
            )
            yield Piece(name, tuple(shard.global_shape), region), shard


def _moment_regions(
    chunks: list[ModelChunk], muon: frozenset[int] | None = frozenset()
) -> dict[Piece, tuple[str, ShardInfo]]:
    """The moment regions to load: Adam's two of each tensor, Muon's buffer of those in ``muon`` (param ids;
    None: whichever of the two a checkpoint's ``index`` holds is decided by the caller)."""
    return {
        Piece(f"{kind}/{piece.name}", piece.global_shape, piece.region): (kind, shard)
        for piece, shard in _pieces_and_shards(chunks)
        if shard.param.requires_grad  # a MoE router's balancing bias has no optimizer state
        for kind in moment_kinds(id(shard.param) in muon)
    }


def load_optimizer_pieces(chunks: list[ModelChunk], ckpt: Path, index: dict) -> dict[Piece, torch.Tensor]:
    """The regions of the saved logical Adam moments (or Muon buffers) that ``chunks`` (this rank, any layout)
    hold: for each parameter, whichever the checkpoint has."""
    saved = index.get("optimizer_tensors", {})
    muon = frozenset(
        id(shard.param) for piece, shard in _pieces_and_shards(chunks) if f"momentum_buffer/{piece.name}" in saved
    )
    return load_pieces(ckpt, index, list(_moment_regions(chunks, muon)), table="optimizer_tensors")


def resharded_optimizer_state(
    chunks: list[ModelChunk],
    params: ParamsWithInfo,
    ckpt: Path,
    index: dict,
    step: float,
    muon: frozenset[int] = frozenset(),
) -> dict[str, torch.Tensor]:
    """This rank's optimizer state rebuilt from a checkpoint's logical moments (any layout that saved them),
    keyed as ``load_optimizer_state_tensors`` takes it: whole local parameters, which ZeRO-1 slices itself.
    ``muon``: the ids of the parameters Muon updates (their state is a momentum buffer); a checkpoint whose
    state of a tensor was kept by the other optimizer is refused in one line."""
    saved = index.get("optimizer_tensors", {})
    for piece, shard in _pieces_and_shards(chunks):
        is_muon = id(shard.param) in muon
        if f"{moment_kinds(not is_muon)[0]}/{piece.name}" in saved:
            raise switch_error(piece.name, saved_muon=not is_muon)
    wanted = _moment_regions(chunks, muon)
    loaded = load_pieces(ckpt, index, list(wanted), table="optimizer_tensors")
    moments: dict[tuple[str, int], torch.Tensor] = {}
    for key, (kind, shard) in wanted.items():
        full = moments.setdefault(
            (kind, id(shard.param)), torch.zeros(shard.param.shape, dtype=shard.param.dtype, device="cpu")
        )  # whole tp-local moments (a dp-sharded optimizer slices its own shard)
        full[shard.local_rows] = loaded[key].to(full.dtype)
    out = {}
    for param, info in params:
        kinds = moment_kinds(id(param) in muon)
        if (kinds[0], id(param)) in moments:
            for kind in kinds:
                out[f"{kind}/{info.name}"] = moments[kind, id(param)]
            if kinds == MOMENTS:  # torch's Muon keeps no step count
                out[f"step/{info.name}"] = torch.tensor(step, dtype=torch.float32)
    return out


def load_model_from_checkpoint(chunks: list[ModelChunk], ckpt: Path, index: dict) -> None:
    """Load every logical tensor region this rank holds, whatever layout wrote the checkpoint (into this
    rank's dp shard of each parameter under ZeRO-2/3)."""
    load_model_regions(chunks, lambda wanted: load_pieces(ckpt, index, wanted))


def load_model_regions(chunks: list[ModelChunk], read: Callable[[list[Piece]], dict[Piece, torch.Tensor]]) -> None:
    """Load every logical tensor region this rank holds from ``read(pieces)`` (a checkpoint's, or any other
    source of logical tensors), into this rank's dp shard of each parameter under ZeRO-2/3."""
    pieces = list(_pieces_and_shards(chunks))
    loaded = read([piece for piece, _ in pieces])
    whole: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
    with torch.no_grad():
        for piece, shard in pieces:
            if not is_sharded(shard.param):
                shard.tensor.copy_(loaded[piece])
                continue
            param, buffer = whole.setdefault(
                id(shard.param), (shard.param, torch.zeros(shard.param.shape, dtype=shard.param.dtype))
            )
            buffer[shard.local_rows] = loaded[piece]
        for param, buffer in whole.values():
            load_local(param.detach(), buffer.to(local(param).device))
