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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

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


def fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gather_object(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """The complete-looking checkpoint directories under ``root`` (``step-NNNNNNNN``), oldest first; debris
    (``.tmp``), quarantined (``.corrupt``) and failed saves (``.failed``) are not among them."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP_NAME.fullmatch(p.name) and p.is_dir())


_STEP_NAME = re.compile(r"step-\d{8}")


def describe_os_error(exc: OSError) -> str:
    """``No space left on device (ENOSPC): path``, from an OSError."""
    code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    text = exc.strerror or str(exc)
    where = f": {exc.filename}" if exc.filename else ""
    return f"{text}{f' ({code})' if code else ''}{where}"


def region_key(region: Region) -> str:
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
