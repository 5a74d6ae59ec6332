"""Writing a checkpoint: which rank writes which piece, the free-space check, the files, and publishing the
index with ``latest`` moved last. A save runs in three phases (``prepare_save``, ``PendingSave.write``,
``PendingSave.finish``), so that the writing may happen in the background while training goes on
(``modelpar.checkpoint.async_save``); ``save_checkpoint`` runs them one after another."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modelpar.checkpoint.store import (
    FORMAT,
    INDEX,
    LATEST,
    CheckpointError,
    Piece,
    Region,
    checkpoint_dirs,
    describe_os_error,
    fsync_dir,
    fsync_write,
    gather_object,
    region_key,
    step_dir,
    this_rank,
)
from modelpar.checkpoint.tensor_file import write_tensors


def _save_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    tmp = path.with_name(path.name + ".partial")
    written = write_tensors(tmp, tensors)  # hashed as written: the file is not read back
    os.replace(tmp, path)
    return written


def save_checkpoint(
    root: str | Path,
    step: int,
    model: Mapping[Piece, torch.Tensor],
    rank_state: Mapping[str, torch.Tensor],
    meta: dict[str, Any],
    keep_last: int = 0,
    optimizer: Mapping[Piece, torch.Tensor] | None = None,
    sign: Callable[[Path], None] | None = None,
) -> Path:
    """Collectively save one checkpoint (every rank of the world calls this with its own pieces).

    ``model``: this rank's regions of logical tensors (pieces held by several ranks are written once, by the
    lowest rank). ``rank_state``: per-rank tensors (optimizer, RNG). ``meta``: JSON-able job state (layout,
    data position, config) recorded in the index. ``optimizer``: optional logical pieces of optimizer state
    (e.g. ``exp_avg/<tensor name>``), written like the model's into ``optim-*.safetensors`` and listed under
    ``optimizer_tensors`` in the index, so that another layout can rebuild its own state from them. Returns
    the checkpoint directory. ``sign(directory)`` signs the written index before the checkpoint is published
    (``modelpar.checkpoint.signing``).

    A save that fails on any rank (disk full, I/O error) raises ``CheckpointSaveError`` on every rank, with
    the same message: ``latest`` still names the previous checkpoint and what was written is moved aside to
    ``step-NNNNNNNN.failed``. Before writing, the bytes every rank will write are checked against the free
    space under ``root``; a save that cannot fit is refused the same way, having written nothing.
    """
    save = prepare_save(root, step, model, rank_state, meta, keep_last, optimizer, sign)
    save.write()
    return save.finish()


@dataclass
class PendingSave:
    """One checkpoint between its three phases: ``prepare_save`` (collective: ownership, free space, the
    temporary directory), ``write`` (this rank's files, no collective: a background thread may run it) and
    ``finish`` (collective: every rank's outcome gathered, rank 0 publishes the index and moves ``latest``)."""

    root: Path
    step: int
    mine: dict[Piece, torch.Tensor]
    mine_optim: dict[Piece, torch.Tensor]
    rank_state: Mapping[str, torch.Tensor]
    meta: dict[str, Any]
    keep_last: int
    shapes: dict[str, list[int]]
    optim_shapes: dict[str, list[int]]
    sign: Callable[[Path], None] | None
    files: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    optim_tensors: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    error: str | None = None

    @property
    def final(self) -> Path:
        return step_dir(self.root, self.step)

    @property
    def tmp(self) -> Path:
        return self.final.with_name(self.final.name + ".tmp")

    def write(self) -> None:
        """Write this rank's files into the temporary directory; an I/O error is kept for ``finish``."""
        rank = this_rank()
        try:
            self.tensors = _write_owned(self.tmp, f"model-{rank:05d}.safetensors", self.mine, self.files)
            self.optim_tensors = _write_owned(self.tmp, f"optim-{rank:05d}.safetensors", self.mine_optim, self.files)
            rank_file = f"rank-{rank:05d}.safetensors"
            self.files[rank_file] = _save_tensors(self.tmp / rank_file, dict(self.rank_state))
        except OSError as exc:
            self.error = f"rank {rank}: {describe_os_error(exc)}"

    def finish(self) -> Path:
        """Collective: publish the checkpoint, or raise the same ``CheckpointSaveError`` on every rank."""
        rank, final, step = this_rank(), self.final, self.step
        outcome = (self.files, self.tensors, self.shapes, self.optim_tensors, self.optim_shapes, self.error)
        gathered = gather_object(outcome)
        errors = [g[5] for g in gathered if g[5] is not None]
        if not errors and rank == 0:
            try:
                _publish(self.root, self.tmp, final, step, self.meta, gathered, self.sign)
            except OSError as exc:
                errors = [f"rank 0: {describe_os_error(exc)}"]
        if rank == 0 and errors:
            _move_aside(self.root, self.tmp, final)
        errors = gather_object(errors)[0]  # rank 0's view, which includes everyone's
        if errors:
            aside = final.with_name(final.name + ".failed")
            raise CheckpointSaveError(
                f"checkpoint of step {step} not saved ({'; '.join(errors)}); {LATEST} still names the previous "
                f"checkpoint, the partial files are under {aside.name}*"
            )
        if rank == 0 and self.keep_last > 0:
            for old in checkpoint_dirs(self.root)[: -self.keep_last]:
                try:
                    shutil.rmtree(old)
                except OSError as exc:  # the new checkpoint is complete; an old one left behind loses nothing
                    print(f"modelpar: could not remove old checkpoint {old}: {describe_os_error(exc)}", flush=True)
        return final


def prepare_save(
    root: str | Path,
    step: int,
    model: Mapping[Piece, torch.Tensor],
    rank_state: Mapping[str, torch.Tensor],
    meta: dict[str, Any],
    keep_last: int = 0,
    optimizer: Mapping[Piece, torch.Tensor] | None = None,
    sign: Callable[[Path], None] | None = None,
) -> PendingSave:
    """Collective: decide which pieces this rank writes, check the free space for every rank's bytes and
    create the temporary directory; raise on every rank alike when the save cannot start."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = this_rank()
    mine = _owned(model)
    mine_optim = _owned(optimizer or {})
    needs = gather_object(_bytes(mine) + _bytes(mine_optim) + _bytes(rank_state))
    problem = None
    if rank == 0:
        if (final / INDEX).exists():
            problem = f"{final} already exists; refusing to overwrite a complete checkpoint"
        else:
            problem = _free_space_problem(root, step, sum(needs))
        if problem is None:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed: never pointed at
                tmp.mkdir(parents=True)
            except OSError as exc:
                problem = f"cannot create {tmp}: {describe_os_error(exc)}"
    problem = gather_object(problem)[0]
    if problem is not None:
        kind = CheckpointError if problem.endswith("a complete checkpoint") else CheckpointSaveError
        raise kind(f"checkpoint of step {step} not saved: {problem}" if kind is CheckpointSaveError else problem)
    return PendingSave(
        root, step, mine, mine_optim, rank_state, meta, keep_last,
        shapes={p.name: list(p.global_shape) for p in model},
        optim_shapes={p.name: list(p.global_shape) for p in optimizer or {}},
        sign=sign,
    )  # fmt: skip


class CheckpointSaveError(CheckpointError):
    """A save that failed or could not fit; raised on every rank with one message, nothing earlier lost."""

    one_line = True  # the launcher reports the message alone


def _publish(root: Path, tmp: Path, final: Path, step: int, meta: dict, gathered: list, sign) -> None:
    """Rank 0: write (and sign) the index, move the directory into place, then point ``latest`` at it."""
    index = {"format": FORMAT, "step": step, **meta, "files": {}, "tensors": {}}
    if any(g[4] for g in gathered):
        index["optimizer_tensors"] = {}
    for files_r, tensors_r, shapes_r, optim_r, optim_shapes_r, _ in gathered:
        index["files"].update(files_r)
        for table, entries_r, shapes_of in (
            ("tensors", tensors_r, shapes_r),
            ("optimizer_tensors", optim_r, optim_shapes_r),
        ):
            for name, shape in shapes_of.items():
                index[table].setdefault(name, {"global_shape": shape, "pieces": []})
            for name, entries in entries_r.items():
                index[table][name]["pieces"].extend(entries)
    fsync_write(tmp / INDEX, json.dumps(index, indent=1, sort_keys=True).encode())
    if sign is not None:
        sign(tmp)
    fsync_dir(tmp)
    os.replace(tmp, final)
    fsync_dir(root)
    fsync_write(root / LATEST, final.name.encode())  # moved last: it only ever names complete checkpoints
    fsync_dir(root)


def _move_aside(root: Path, tmp: Path, final: Path) -> None:
    """Rank 0, after a failed save: whatever was written (``.tmp``, or a directory ``latest`` never named)
    goes to ``step-N.failed`` (``.failed-2``... if taken); ``latest`` is untouched."""
    pointed = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
    for written in (tmp, final):
        if not written.exists() or written.name == pointed:
            continue
        aside = final.with_name(final.name + ".failed")
        n = 1
        while aside.exists():
            n += 1
            aside = final.with_name(f"{final.name}.failed-{n}")
        try:
            written.rename(aside)
        except OSError:
            shutil.rmtree(written, ignore_errors=True)  # cannot even rename: at least it is never loaded


def _free_space_problem(root: Path, step: int, need: int) -> str | None:
    """None when ``need`` bytes (plus 1% and 1 MiB for the index) fit under ``root``, else why not."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return None  # nothing to measure with: the write itself will tell
    want = int(need * 1.01) + (1 << 20)
    if free >= want:
        return None
    return (
        f"it needs {want / 2**20:.1f} MiB under {root} but only {free / 2**20:.1f} MiB are free; free some space "
        "or point trainer.out_dir at a larger disk"
    )


def _bytes(tensors) -> int:
    values = tensors.values() if isinstance(tensors, Mapping) else tensors
    return sum(t.numel() * t.element_size() for t in values)


def _owned(pieces: Mapping[Piece, torch.Tensor]) -> dict[Piece, torch.Tensor]:
    """The pieces this rank writes: a region held by several ranks is written by the lowest. Collective:
    every rank calls it, with or without pieces."""
    claims = gather_object([(p.name, p.global_shape, p.region) for p in pieces])
    owner: dict[tuple[str, Region], int] = {}
    for r, claimed in enumerate(claims):
        for name, _, region in claimed:
            owner.setdefault((name, tuple(map(tuple, region))), r)
    rank = this_rank()
    return {p: t for p, t in pieces.items() if owner[(p.name, p.region)] == rank}


def _write_owned(
    tmp: Path, file: str, mine: Mapping[Piece, torch.Tensor], files: dict[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    """Write this rank's pieces into ``file`` (none: no file); return the index entries per tensor name."""
    keys = {f"{p.name}@{region_key(p.region)}": t for p, t in mine.items()}
    if keys:
        files[file] = _save_tensors(tmp / file, keys)
    entries: dict[str, list[dict[str, Any]]] = {}
    for p in mine:
        entry = {"file": file, "key": f"{p.name}@{region_key(p.region)}", "region": [list(r) for r in p.region]}
        entries.setdefault(p.name, []).append(entry)
    return entries
