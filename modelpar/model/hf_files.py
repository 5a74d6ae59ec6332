"""The weight files of a Hugging Face model directory: one ``model.safetensors``, or shards
``model-0000k-of-0000n.safetensors`` named by ``model.safetensors.index.json`` (``{"metadata": {"total_size"},
"weight_map": {tensor: shard}}``), read and written the way transformers' ``save_pretrained`` and
``from_pretrained`` do.

A directory is checked as a whole when opened, before any tensor is read: a shard the index names that is
missing, a shard file the index does not name, a tensor the index places in a file that does not hold it, a
truncated file: each is one line naming it. Writing splits the tensors, in order, into shards of at most
``max_shard_size`` bytes (a single tensor larger than that gets a shard of its own, as transformers does).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from modelpar.model.safetensors_io import SafetensorsFileError, TensorReader, TensorWriter

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
DEFAULT_MAX_SHARD = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class HFFilesError(ValueError):
    """A Hugging Face directory whose weight files cannot be used; one line naming the file and the problem."""

    one_line = True


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (transformers' units: KB/MB/GB decimal, KiB/MiB/GiB binary); an int is bytes."""
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).upper() if match else None
        if unit not in _UNITS:
            raise ValueError(f"max shard size {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"max shard size {text!r} must be positive")
    return size


def shard_name(k: int, n: int) -> str:
    """transformers' name of shard ``k`` (1-based) of ``n``."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


class HFWeights:
    """The tensors of a Hugging Face directory, wherever its index puts them.

    ``keys()``; ``get_slice(key)`` (safetensors' lazy slice, for a rank reading only its rows);
    ``get_tensor(key)``; ``reader(key)``: the ``TensorReader`` of the file holding ``key`` (plain reads, for
    streaming conversion). Use as a context manager: open files are closed on exit.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.where: dict[str, str] = {}  # tensor -> file name
        self._readers: dict[str, TensorReader] = {}
        self._handles: dict[str, object] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        index = self.path / INDEX_FILE
        if not self.path.is_dir():
            raise HFFilesError(f"{self.path} is not a directory")
        if index.exists():
            self._open_sharded(index)
        elif (self.path / SINGLE_FILE).exists():
            reader = self._reader_of(SINGLE_FILE)
            self.where = dict.fromkeys(reader.keys(), SINGLE_FILE)
        else:
            raise HFFilesError(
                f"{self.path} has neither {SINGLE_FILE} nor {INDEX_FILE}; point at a Hugging Face model directory"
            )

    def _open_sharded(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise HFFilesError(f"{index} is not a safetensors index (JSON with a weight_map); it is damaged") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
                raise HFFilesError(f"{index} names file {name!r:.80}; only files inside the directory are read")
            if not (self.path / name).exists():
                raise HFFilesError(f"{self.path / name} is missing (named by {INDEX_FILE}); download it again")
        counts = {int(m.group(2)) for name in files if (m := SHARD_NAME.fullmatch(name))}
        for extra in sorted(self.path.glob("model-*-of-*.safetensors")):
            if extra.name not in files:
                raise HFFilesError(
                    f"{extra} is not named by {INDEX_FILE} (from another download?); remove it or restore the index"
                )
        for name in files:
            m = SHARD_NAME.fullmatch(name)
            if m and (int(m.group(1)) > int(m.group(2)) or len(counts) > 1):
                raise HFFilesError(f"{self.path / name}: its name does not fit the other shards of {INDEX_FILE}")
        for name in files:
            held = set(self._reader_of(name).keys())
            for tensor, file in weight_map.items():
                if file == name and tensor not in held:
                    holder = next((f for f in files if tensor in self._reader_of(f).keys()), None)
                    found = f" (it is in {holder})" if holder else ""
                    raise HFFilesError(f"{INDEX_FILE} places {tensor} in {name}, which does not hold it{found}")
        self.where = dict(weight_map)

    def _reader_of(self, name: str) -> TensorReader:
        if name not in self._readers:
            try:
                self._readers[name] = TensorReader(self.path / name)
            except SafetensorsFileError as exc:
                raise HFFilesError(str(exc)) from None
        return self._readers[name]

    def keys(self) -> list[str]:
        return list(self.where)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def reader(self, key: str) -> TensorReader:
        return self._reader_of(self.where[key])

    def file_of(self, key: str) -> str:
        return self.where[key]

    def get_slice(self, key: str):
        name = self.where[key]
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.path / name), framework="pt")
        return self._handles[name].get_slice(key)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.reader(key).read(key)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._handles.clear()

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensors (in order) grouped into consecutive shards of at most ``max_bytes`` each (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def write_hf_weights(
    path: str | Path,
    entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    value_of: Callable[[str], torch.Tensor],
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
) -> list[str]:
    """Write the tensors ``entries`` declares (HF key -> dtype, shape), each produced in turn by ``value_of(key)``,
    as ``model.safetensors`` or as shards plus ``model.safetensors.index.json``; returns the files written.
    Only one tensor is held at a time."""
    path = Path(path)
    sizes = {key: math.prod(shape) * dtype.itemsize for key, (dtype, shape) in entries.items()}
    shards = plan_shards(sizes, parse_size(max_shard_size))
    names = [SINGLE_FILE] if len(shards) == 1 else [shard_name(k + 1, len(shards)) for k in range(len(shards))]
    for name, keys in zip(names, shards, strict=True):
        writer = TensorWriter(path / name, {k: entries[k] for k in keys}, metadata={"format": "pt"}, hashed=False)
        for key in keys:
            writer.write(key, value_of(key))
        writer.close()
    if len(shards) > 1:
        weight_map = {key: name for name, keys in zip(names, shards, strict=True) for key in keys}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return [*names, INDEX_FILE]
    return names


def weight_files(path: str | Path) -> Iterable[Path]:
    """The weight files of a directory ``write_hf_weights`` wrote (for signing or copying them)."""
    path = Path(path)
    return sorted(p for p in path.iterdir() if p.name == SINGLE_FILE or SHARD_NAME.fullmatch(p.name))
