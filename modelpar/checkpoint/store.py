"""Sharded checkpoints: safetensors files plus one JSON index, written atomically, verified on load.

On disk::

    checkpoints/
      step-00000050/
        model-00000.safetensors     pieces of logical tensors this rank owns (global rank in the name)
        rank-00000.safetensors      this rank's optimizer state and RNG state
        index.json                  layout, step, data position, each logical tensor's global shape and
                                    pieces (file, key, region), SHA-256 and size of every file
      latest                        name of the newest complete checkpoint; moved last

A logical tensor is one tensor of the single-device model (``layers.3.self_attn.q_proj.weight``). Each rank
holds a region of it (a slice per dimension); any layout can load any checkpoint by reading the regions it
needs, which is all resharding is. Only safetensors and JSON are ever read: loading cannot run code.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from modelpar.checkpoint.schema import IndexSchemaError, check_file_name, check_index

FORMAT = "modelpar-checkpoint/1"
INDEX = "index.json"
LATEST = "latest"

Region = tuple[tuple[int, int], ...]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the file and the problem."""

    one_line = True  # raised in a rank too: the launcher reports the message alone, never a traceback


@dataclass(frozen=True)
class Piece:
    """A region of a logical tensor: ``region[d] = (start, stop)`` along each dimension of ``global_shape``."""

    name: str
    global_shape: tuple[int, ...]
    region: Region

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.region)

    @staticmethod
    def whole(name: str, shape: tuple[int, ...]) -> Piece:
        return Piece(name, tuple(shape), tuple((0, n) for n in shape))


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` points at, or None when there is none yet."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    target = Path(root) / pointer.read_text().strip()
    if not (target / INDEX).exists():
        raise CheckpointError(f"{pointer} points at {target.name}, which has no {INDEX}; the checkpoint is incomplete")
    return target


def resolve_checkpoint(path: str | Path) -> Path:
    """A ``step-*`` directory as given, or the one a checkpoints root's ``latest`` names."""
    path = Path(path)
    if (path / "index.json").exists():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"{path} is neither a checkpoint (no index.json) nor a directory with a 'latest' pointer")
    return found


# -- writing -----------------------------------------------------------------------------------------------


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    tmp = path.with_name(path.name + ".partial")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """The complete-looking checkpoint directories under ``root`` (``step-NNNNNNNN``), oldest first; debris
    (``.tmp``), quarantined (``.corrupt``) and failed saves (``.failed``) are not among them."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP_NAME.fullmatch(p.name) and p.is_dir())


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
    root = Path(root)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = _rank()
    mine = _owned(model)
    mine_optim = _owned(optimizer or {})
    needs = _gather(_bytes(mine) + _bytes(mine_optim) + _bytes(rank_state))
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
                problem = f"cannot create {tmp}: {_describe(exc)}"
    problem = _gather(problem)[0]
    if problem is not None:
        kind = CheckpointError if problem.endswith("a complete checkpoint") else CheckpointSaveError
        raise kind(f"checkpoint of step {step} not saved: {problem}" if kind is CheckpointSaveError else problem)

    files: dict[str, Any] = {}
    tensors: dict[str, list[dict[str, Any]]] = {}
    optim_tensors: dict[str, list[dict[str, Any]]] = {}
    error = None
    try:
        tensors = _write_owned(tmp, f"model-{rank:05d}.safetensors", mine, files)
        optim_tensors = _write_owned(tmp, f"optim-{rank:05d}.safetensors", mine_optim, files)
        rank_file = f"rank-{rank:05d}.safetensors"
        files[rank_file] = _save_tensors(tmp / rank_file, dict(rank_state))
    except OSError as exc:
        error = f"rank {rank}: {_describe(exc)}"

    shapes = {p.name: list(p.global_shape) for p in model}
    optim_shapes = {p.name: list(p.global_shape) for p in optimizer or {}}
    gathered = _gather((files, tensors, shapes, optim_tensors, optim_shapes, error))
    errors = [g[5] for g in gathered if g[5] is not None]
    if not errors and rank == 0:
        try:
            _publish(root, tmp, final, step, meta, gathered, sign)
        except OSError as exc:
            errors = [f"rank 0: {_describe(exc)}"]
    if rank == 0 and errors:
        _move_aside(root, tmp, final)
    errors = _gather(errors)[0]  # rank 0's view, which includes everyone's
    if errors:
        aside = final.with_name(final.name + ".failed")
        raise CheckpointSaveError(
            f"checkpoint of step {step} not saved ({'; '.join(errors)}); {LATEST} still names the previous "
            f"checkpoint, the partial files are under {aside.name}*"
        )
    if rank == 0 and keep_last > 0:
        for old in checkpoint_dirs(root)[:-keep_last]:
            try:
                shutil.rmtree(old)
            except OSError as exc:  # the new checkpoint is complete; an old one left behind loses nothing
                print(f"modelpar: could not remove old checkpoint {old}: {_describe(exc)}", flush=True)
    return final


_STEP_NAME = re.compile(r"step-\d{8}")


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
    _fsync_write(tmp / INDEX, json.dumps(index, indent=1, sort_keys=True).encode())
    if sign is not None:
        sign(tmp)
    _fsync_dir(tmp)
    os.replace(tmp, final)
    _fsync_dir(root)
    _fsync_write(root / LATEST, final.name.encode())  # moved last: it only ever names complete checkpoints
    _fsync_dir(root)


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


def _describe(exc: OSError) -> str:
    """``No space left on device (ENOSPC): path``, from an OSError."""
    code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    text = exc.strerror or str(exc)
    where = f": {exc.filename}" if exc.filename else ""
    return f"{text}{f' ({code})' if code else ''}{where}"


def _bytes(tensors) -> int:
    values = tensors.values() if isinstance(tensors, Mapping) else tensors
    return sum(t.numel() * t.element_size() for t in values)


def _owned(pieces: Mapping[Piece, torch.Tensor]) -> dict[Piece, torch.Tensor]:
    """The pieces this rank writes: a region held by several ranks is written by the lowest. Collective:
    every rank calls it, with or without pieces."""
    claims = _gather([(p.name, p.global_shape, p.region) for p in pieces])
    owner: dict[tuple[str, Region], int] = {}
    for r, claimed in enumerate(claims):
        for name, _, region in claimed:
            owner.setdefault((name, tuple(map(tuple, region))), r)
    rank = _rank()
    return {p: t for p, t in pieces.items() if owner[(p.name, p.region)] == rank}


def _write_owned(
    tmp: Path, file: str, mine: Mapping[Piece, torch.Tensor], files: dict[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    """Write this rank's pieces into ``file`` (none: no file); return the index entries per tensor name."""
    keys = {f"{p.name}@{_region_key(p.region)}": t for p, t in mine.items()}
    if keys:
        files[file] = _save_tensors(tmp / file, keys)
    entries: dict[str, list[dict[str, Any]]] = {}
    for p in mine:
        entry = {"file": file, "key": f"{p.name}@{_region_key(p.region)}", "region": [list(r) for r in p.region]}
        entries.setdefault(p.name, []).append(entry)
    return entries


def _region_key(region: Region) -> str:
    return ",".join(f"{a}:{b}" for a, b in region)


# -- reading -----------------------------------------------------------------------------------------------


def read_index(ckpt: str | Path, verify: bool = True) -> dict[str, Any]:
    """Read ``index.json``; with ``verify``, check every file's SHA-256 and that no file is missing or extra."""
    ckpt = Path(ckpt)
    path = ckpt / INDEX
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt} is not a checkpoint directory")
    if not path.exists():
        raise CheckpointError(f"{path} is missing: {ckpt} is not a complete checkpoint")
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(f"{path} has format {found!r:.80}; expected {FORMAT!r}")
    try:
        check_index(index)
    except IndexSchemaError as exc:
        raise CheckpointError(f"{path}: {exc}; the index is damaged or was edited") from None
    if verify:
        verify_files(ckpt, index)
    return index


def verify_files(ckpt: Path, index: dict[str, Any]) -> None:
    """Every listed file present with its recorded size and SHA-256; no unlisted safetensors file."""
    listed = index["files"]
    present = {p.name for p in ckpt.iterdir() if p.suffix == ".safetensors"}
    extra = sorted(present - set(listed))
    if extra:
        raise CheckpointError(f"{ckpt / extra[0]} is not listed in {INDEX}; remove it or use the matching checkpoint")
    for name, info in sorted(listed.items()):
        path = ckpt / name
        if not path.exists():
            raise CheckpointError(f"{path} is missing (listed in {INDEX}); the checkpoint is incomplete")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"{path} has {size} bytes, expected {info['bytes']}: the file is truncated or damaged"
            )
        if sha256_file(path) != info["sha256"]:
            raise CheckpointError(f"{path} fails its SHA-256 check: the file is damaged or was modified")


def load_pieces(
    ckpt: str | Path, index: dict[str, Any], wanted: list[Piece], table: str = "tensors"
) -> dict[Piece, torch.Tensor]:
    """Assemble each wanted region of a logical tensor from the pieces on disk (any saved layout); ``table``
    names the index's table: ``tensors`` (the model) or ``optimizer_tensors``."""
    ckpt = Path(ckpt)
    out: dict[Piece, torch.Tensor] = {}
    handles: dict[str, Any] = {}
    try:
        for want in wanted:
            entry = index.get(table, {}).get(want.name)
            if entry is None:
                raise CheckpointError(f"{ckpt} has no tensor {want.name!r}; was it saved from a different model?")
            if tuple(entry["global_shape"]) != tuple(want.global_shape):
                raise CheckpointError(
                    f"{want.name}: checkpoint shape {tuple(entry['global_shape'])} != model shape {want.global_shape}"
                )
            result = None
            covered = 0
            for piece in entry["pieces"]:
                region = [tuple(r) for r in piece["region"]]
                overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, want.region, strict=True)]
                if any(lo >= hi for lo, hi in overlap):
                    continue
                src = _open_slice(ckpt, piece, handles, region)
                src_index = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, region, strict=True))
                chunk = src[src_index]
                if result is None:
                    result = torch.empty(want.shape, dtype=chunk.dtype)
                dst_index = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, want.region, strict=True))
                result[dst_index] = chunk
                covered += chunk.numel()
            expected = 1
            for n in want.shape:
                expected *= n
            if result is None or covered != expected:
                raise CheckpointError(f"{ckpt}: the pieces of {want.name} do not cover region {want.region}")
            out[want] = result
    finally:
        handles.clear()
    return out


_LOADABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _open_slice(ckpt: Path, piece: dict, handles: dict, region: list[tuple[int, int]]):
    """The safetensors slice a piece names, checked to hold floating values of the region's shape."""
    path = ckpt / check_file_name(piece["file"], "piece")
    try:
        if piece["file"] not in handles:
            handles[piece["file"]] = safe_open(str(path), framework="pt")
        src = handles[piece["file"]].get_slice(piece["key"])
        shape, dtype = tuple(src.get_shape()), src.get_dtype()
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise CheckpointError(f"{path}: cannot read {piece['key']!r:.80} ({reason}); the file is damaged") from None
    want = tuple(b - a for a, b in region)
    if shape != want:
        raise CheckpointError(f"{path}: {piece['key']!r:.80} has shape {shape}, its region {want}; damaged index")
    if _SAFETENSORS_DTYPES.get(dtype) not in _LOADABLE:
        raise CheckpointError(f"{path}: {piece['key']!r:.80} holds {dtype} values; weights are floating point")
    return src


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def load_rank_state(ckpt: str | Path, rank: int) -> dict[str, torch.Tensor]:
    """This rank's optimizer and RNG tensors (the same layout must be resumed for these)."""
    path = Path(ckpt) / f"rank-{rank:05d}.safetensors"
    if not path.exists():
        raise CheckpointError(f"{path} is missing; the checkpoint was saved by a different world size")
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}
