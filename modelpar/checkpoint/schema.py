"""What a checkpoint's ``index.json`` may contain, checked before any of it is used.

The SHA-256 of every file lives in the index, so a damaged data file is caught by its hash; the index itself
is only protected by a signature when a key is configured. Without one, whoever can write the directory can
write any JSON, so every field a reader touches is checked here: types, ranges, file names (a plain
``name.safetensors`` inside the checkpoint: no separators, no ``..``, so nothing outside it is ever opened),
pieces that name a listed file and a region inside their tensor's shape, and shapes no file could hold.
A failure is a ``CheckpointError`` naming the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import Any

from modelpar.parallel.layout import ParallelLayout

FILE_NAME = re.compile(r"[A-Za-z0-9_-]+\.safetensors")
SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_DIMS = 8
MAX_DIM = 2**40  # far beyond any real tensor dimension; keeps every product exact in Python ints
LAYOUT_FIELDS = tuple(f.name for f in fields(ParallelLayout))


class IndexSchemaError(ValueError):
    """One field of an index is not what a checkpoint can hold (converted to ``CheckpointError``)."""


def _int(value: Any, where: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise IndexSchemaError(f"{where} is {value!r:.60}, not an integer")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise IndexSchemaError(f"{where}={value} must be {bound}")
    return value


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise IndexSchemaError(f"{where} is {type(value).__name__}, not an object")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise IndexSchemaError(f"{where} is {type(value).__name__}, not a list")
    return value


def check_file_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not FILE_NAME.fullmatch(name):
        raise IndexSchemaError(
            f"{where} names file {name!r:.80}; only plain NAME.safetensors files inside the checkpoint are allowed"
        )
    return name


def _check_files(files: Any) -> dict[str, int]:
    sizes = {}
    for name, info in _dict(files, "files").items():
        check_file_name(name, "files")
        info = _dict(info, f"files[{name}]")
        sizes[name] = _int(info.get("bytes"), f"files[{name}].bytes")
        digest = info.get("sha256")
        if not isinstance(digest, str) or not SHA256.fullmatch(digest):
            raise IndexSchemaError(f"files[{name}].sha256 is {digest!r:.80}, not a SHA-256 hex digest")
    return sizes


def _check_table(table: Any, name: str, sizes: dict[str, int]) -> None:
    for tensor, entry in _dict(table, name).items():
        where = f"{name}[{tensor!r:.60}]"
        if not isinstance(tensor, str) or not tensor:
            raise IndexSchemaError(f"{where}: tensor names are non-empty strings")
        entry = _dict(entry, where)
        shape = _list(entry.get("global_shape"), f"{where}.global_shape")
        if len(shape) > MAX_DIMS:
            raise IndexSchemaError(f"{where}.global_shape has {len(shape)} dimensions; at most {MAX_DIMS}")
        for d, n in enumerate(shape):
            _int(n, f"{where}.global_shape[{d}]", 0, MAX_DIM)
        covered = 0
        for k, piece in enumerate(_list(entry.get("pieces"), f"{where}.pieces")):
            at = f"{where}.pieces[{k}]"
            piece = _dict(piece, at)
            file = check_file_name(piece.get("file"), f"{at}.file")
            if file not in sizes:
                raise IndexSchemaError(f"{at}.file {file!r} is not among the index's files")
            if not isinstance(piece.get("key"), str):
                raise IndexSchemaError(f"{at}.key is {piece.get('key')!r:.60}, not a string")
            region = _list(piece.get("region"), f"{at}.region")
            if len(region) != len(shape):
                raise IndexSchemaError(f"{at}.region has {len(region)} dimensions, the tensor {len(shape)}")
            lengths = []
            for d, span in enumerate(region):
                span = _list(span, f"{at}.region[{d}]")
                if len(span) != 2:
                    raise IndexSchemaError(f"{at}.region[{d}] is {span!r:.60}, not [start, stop]")
                start = _int(span[0], f"{at}.region[{d}][0]", 0, shape[d])
                stop = _int(span[1], f"{at}.region[{d}][1]", start, shape[d])
                lengths.append(stop - start)
            if math.prod(lengths) > sizes[file]:  # at least a byte per value: no file this size holds it
                raise IndexSchemaError(
                    f"{at}.region holds {math.prod(lengths)} values but {file} has only {sizes[file]} bytes"
                )
            covered += math.prod(lengths)
        if covered < math.prod(shape):  # so a shape is never larger than the files that hold it
            raise IndexSchemaError(f"{where}: its pieces hold {covered} of its {math.prod(shape)} values")


def check_index(index: Any) -> None:
    """Raise ``IndexSchemaError`` naming the first field a reader could not safely use."""
    index = _dict(index, "the index")
    _int(index.get("step"), "step")
    sizes = _check_files(index.get("files"))
    _check_table(index.get("tensors"), "tensors", sizes)
    if "optimizer_tensors" in index:
        _check_table(index["optimizer_tensors"], "optimizer_tensors", sizes)
    if "optimizer_step" in index:
        step = index["optimizer_step"]
        if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step) or step < 0:
            raise IndexSchemaError(f"optimizer_step is {step!r:.60}, not a finite count >= 0")
    layout = _dict(index.get("layout", {}), "layout")
    for key, value in layout.items():
        if key not in LAYOUT_FIELDS:
            raise IndexSchemaError(f"layout.{key!s:.40} is not a layout field ({', '.join(LAYOUT_FIELDS)})")
        _int(value, f"layout.{key}", 1, 2**20)
    if "world_size" in index:
        _int(index["world_size"], "world_size", 1, 2**24)
    for section in ("model", "parallel"):  # read into dataclasses field by field, which check their values
        if section in index:
            _dict(index[section], section)
    sampler = index.get("sampler")
    if sampler is not None:
        _dict(sampler, "sampler")  # the sampler's own load_state_dict checks what it reads
