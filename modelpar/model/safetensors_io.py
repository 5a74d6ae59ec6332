"""safetensors files read and written one tensor at a time, with memory bounded by the tensor at hand.

The format: an 8-byte little-endian header length, a JSON header (``{name: {"dtype", "shape", "data_offsets"}}``
plus an optional ``__metadata__`` of strings) padded with spaces to a multiple of 8, then the tensors' bytes.
``TensorReader`` checks a header against the file's size (a truncated file is named before anything is read)
and reads any tensor, or a run of rows of it, with ``readinto`` straight into a tensor's memory: no mapping
of the file stays resident. ``TensorWriter`` writes the header of tensors declared up front, then takes each
tensor's bytes in turn (hashing them with SHA-256 as written when asked), so a converter never holds more
than the tensor it is converting.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
CHUNK = 4 << 20  # bytes written (and hashed) at a time
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class SafetensorsFileError(ValueError):
    """A file that is not a complete safetensors file; the message names it and what is wrong."""


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (contiguous, on the CPU), without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class TensorReader:
    """The tensors of one safetensors file, read on demand with plain reads (no memory map)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "rb")
        try:
            self.header, self.metadata, self.data_start = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> tuple[dict, dict, int]:
        size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(8)
        if len(head) < 8:
            raise SafetensorsFileError(f"{self.path} has {size} bytes, too few for a safetensors header: truncated")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsFileError(
                f"{self.path}: its header claims {n} bytes but the file has {size}: truncated or not safetensors"
            )
        try:
            header = json.loads(self._file.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SafetensorsFileError(f"{self.path}: the header is not valid JSON; the file is damaged") from None
        if not isinstance(header, dict):
            raise SafetensorsFileError(f"{self.path}: the header is not a JSON object; the file is damaged")
        metadata = header.pop("__metadata__", None) or {}
        end = 0
        for name, info in header.items():
            try:
                start, stop = info["data_offsets"]
                itemsize = TORCH_DTYPES[info["dtype"]].itemsize
                ok = 0 <= start <= stop and stop - start == math.prod(info["shape"]) * itemsize
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise SafetensorsFileError(f"{self.path}: tensor {name!r:.80} has a malformed header entry")
            end = max(end, stop)
        if 8 + n + end != size:
            raise SafetensorsFileError(
                f"{self.path} has {size} bytes but its header describes {8 + n + end}: the file is truncated or damaged"
            )
        return header, metadata, 8 + n

    def keys(self) -> list[str]:
        return list(self.header)

    def dtype(self, key: str) -> torch.dtype:
        return TORCH_DTYPES[self.header[key]["dtype"]]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.header[key]["shape"])

    def nbytes(self, key: str) -> int:
        start, stop = self.header[key]["data_offsets"]
        return stop - start

    def offset(self, key: str) -> int:
        return self.header[key]["data_offsets"][0]

    def read(self, key: str, lead: tuple[int, ...] = (), rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``tensor[lead][rows[0]:rows[1]]`` (``lead``: indices into the leading dimensions; ``rows``: a range of
        the next one), read from the file into a new tensor: a contiguous part of the data, so one read."""
        shape, dtype = self.shape(key), self.dtype(key)
        inner = shape[len(lead) :]
        start_row, stop_row = rows if rows is not None else (0, inner[0] if inner else 1)
        flat = 0
        for i, n in zip(lead, shape, strict=False):
            flat = flat * n + i
        per_row = math.prod(inner[1:]) if inner else 1
        first = (flat * (inner[0] if inner else 1) + start_row) * per_row
        out_shape = ((stop_row - start_row, *inner[1:]) if rows is not None else inner) if inner else ()
        out = torch.empty(out_shape, dtype=dtype)
        self._file.seek(self.data_start + self.offset(key) + first * dtype.itemsize)
        view = raw_bytes(out)
        got = self._file.readinto(view) if len(view) else 0
        if got != len(view):
            raise SafetensorsFileError(f"{self.path}: {key!r:.80} ends early; the file is truncated")
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorWriter:
    """A safetensors file whose tensors are declared first (``entries``: name -> (dtype, shape), written in that
    order) and then written one at a time with ``write``; ``close`` returns ``{"sha256", "bytes"}`` (the
    digest only with ``hashed``; an HF export has no use for it)."""

    def __init__(
        self,
        path: str | Path,
        entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        hashed: bool = True,
    ):
        self.path = Path(path)
        self._order = list(entries)
        self._next = 0
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self._specs = {}
        for name, (dtype, shape) in entries.items():
            if dtype not in DTYPES:
                raise TypeError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._specs[name] = (dtype, tuple(shape))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)
        self.bytes = 8 + len(text) + offset
        self._digest = hashlib.sha256() if hashed else None
        self._file = open(self.path, "wb")
        self._put(struct.pack("<Q", len(text)))
        self._put(text)

    def _put(self, block) -> None:
        self._file.write(block)
        if self._digest is not None:
            self._digest.update(block)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next declared tensor's value (converted to its declared dtype if it differs)."""
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise ValueError(f"{self.path}: wrote {name!r}, expected {expected!r} (tensors go in declared order)")
        dtype, shape = self._specs[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: {name!r} has shape {tuple(tensor.shape)}, declared {shape}")
        raw = raw_bytes(tensor.detach().to("cpu", dtype).contiguous())
        for start in range(0, len(raw), CHUNK):
            self._put(raw[start : start + CHUNK])
        self._next += 1

    def close(self, fsync: bool = True) -> dict[str, object]:
        if self._next != len(self._order):
            self._file.close()
            raise ValueError(f"{self.path}: {len(self._order) - self._next} declared tensors were never written")
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        return {"sha256": self._digest.hexdigest() if self._digest else None, "bytes": self.bytes}
