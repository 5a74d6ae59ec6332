"""A safetensors file written in one pass, hashed as it is written.

``safetensors.torch.save_file`` copies every tensor to a bytes object before writing, and the checkpoint then
read the whole file back to hash it: three passes over memory for each byte saved. ``write_tensors`` writes
the format itself (an 8-byte little-endian header length, the JSON header padded with spaces to a multiple of
8, then each tensor's bytes in header order) straight from each tensor's memory, and feeds the same slices to
SHA-256 while they are still in cache. Any safetensors reader loads the result.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from modelpar.model.safetensors_io import DTYPES, raw_bytes

CHUNK = 4 << 20  # bytes written and hashed at a time: small enough to hash from cache


def write_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], fsync: bool = True) -> dict[str, object]:
    """Write ``tensors`` to ``path`` as safetensors; returns ``{"sha256", "bytes"}`` of the file."""
    ready = {name: t.detach().contiguous().cpu() for name, t in sorted(tensors.items())}
    header: dict[str, object] = {}
    offset = 0
    for name, t in ready.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name here")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for block in (struct.pack("<Q", len(text)), text):
            f.write(block)
            digest.update(block)
        for t in ready.values():
            raw = raw_bytes(t)
            for start in range(0, len(raw), CHUNK):
                part = raw[start : start + CHUNK]
                f.write(part)
                digest.update(part)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "bytes": 8 + len(text) + offset}
