"""A split's shard files as a prepare writes them: ``shard-00000.npy``, ... cut every ``shard_tokens`` ids, the
one being filled kept under a hidden name beside its final one, so a resumed prepare finds it and truncates it
to what the manifest vouches for (``modelpar.data.prepare_shards``)."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.npy"


def _header(length: int, dtype: np.dtype) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (length,)}
    )
    return buffer.getvalue()


class PartialShard:
    """The shard being filled, under a fixed hidden name beside its final one so a resumed prepare finds it.

    numpy pads the header so the length field grows in place; it is rewritten when the shard is committed.
    """

    def __init__(self, dest: Path, dtype: np.dtype, tokens: int = 0, documents: int = 0):
        self.dest, self.dtype, self.length, self.documents = dest, dtype, tokens, documents
        self.tmp = dest.with_name(f".{dest.name}.partial")
        self.offset = len(_header(0, dtype))
        if tokens and not self.tmp.exists() and dest.exists():
            os.replace(dest, self.tmp)  # committed after the manifest was last saved: take it up again
        if tokens:  # resuming: keep what the manifest vouches for, drop anything written after it
            self.file = self.tmp.open("r+b")
            self.file.truncate(self.offset + tokens * dtype.itemsize)
            self.file.seek(0, os.SEEK_END)
        else:
            self.file = self.tmp.open("w+b")
            self.file.write(_header(0, dtype))

    def append(self, ids: np.ndarray, documents: int) -> None:
        self.file.write(np.ascontiguousarray(ids, dtype=self.dtype).data)
        self.length += len(ids)
        self.documents += documents

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def commit(self) -> dict:
        """Finish the header, fsync, move into place; returns the shard's manifest entry."""
        self.file.seek(0)
        self.file.write(_header(self.length, self.dtype))
        self.sync()
        self.file.seek(0)
        digest = hashlib.file_digest(self.file, "sha256").hexdigest()
        self.file.close()
        os.replace(self.tmp, self.dest)
        return {"file": self.dest.name, "tokens": self.length, "documents": self.documents, "sha256": digest}

    def close(self) -> None:
        self.file.close()

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class SplitWriter:
    """One split's shards: committed ones and the partial one, cut every ``shard_tokens`` ids."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, state: dict | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards: list[dict] = list(state["shards"]) if state else []
        partial = state["partial"] if state else {"tokens": 0, "documents": 0}
        self.current = self._open(partial["tokens"], partial["documents"])

    def _open(self, tokens: int = 0, documents: int = 0) -> PartialShard:
        return PartialShard(self.folder / shard_name(len(self.shards)), self.dtype, tokens, documents)

    def write(self, ids: np.ndarray, doc_ends: np.ndarray) -> int:
        """Append ``ids: [n]`` whose documents end at offsets ``doc_ends`` (exclusive); returns shards committed."""
        committed, pos = 0, 0
        while pos < len(ids):
            take = min(len(ids) - pos, self.shard_tokens - self.current.length)
            documents = np.searchsorted(doc_ends, pos + take, "right") - np.searchsorted(doc_ends, pos, "right")
            self.current.append(ids[pos : pos + take], int(documents))
            pos += take
            if self.current.length == self.shard_tokens:
                self.shards.append(self.current.commit())
                self.current = self._open()
                committed += 1
        return committed

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + (self.current.length if self.current else 0)

    @property
    def documents(self) -> int:
        return sum(s["documents"] for s in self.shards) + (self.current.documents if self.current else 0)

    def state(self) -> dict:
        self.current.sync()
        return {
            "shards": list(self.shards),
            "partial": {"tokens": self.current.length, "documents": self.current.documents},
        }

    def finish(self) -> None:
        if self.current.length:
            self.shards.append(self.current.commit())
        else:
            self.current.discard()
        self.current = None
