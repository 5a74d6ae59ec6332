"""Shard directories and window sets: what training reads when ``data.path`` is a folder or a blend.

A shard directory is what ``modelpar-data prepare --output DIR`` writes (``modelpar.data.prepare_shards``)::

    DIR/manifest.json        tokenizer, dtype, sources, shards (file, tokens, documents, sha256), bad records
    DIR/shard-00000.npy ...  memory-mapped token files, read without pickle
    DIR/val/                 the held-out split, itself a shard directory

Windows never cross a shard boundary: shard ``k``'s windows are numbered after those of shards ``0..k-1``, and a
shard's tail shorter than one window is not read (at most ``seq_len`` tokens per shard)::

    shard 0: windows 0..n0-1    shard 1: windows n0..n0+n1-1    ...
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from modelpar.data.token_file import DataError, TokenFile, open_tokens

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
VAL_SPLIT = "val"


def is_shard_dir(path: str | Path) -> bool:
    return Path(path).is_dir()


def read_manifest(folder: str | Path) -> dict:
    """The manifest of a finished prepare in ``folder``; a missing, unreadable or unfinished one is a DataError."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{folder} has no {MANIFEST}; prepare a corpus into it with `modelpar-data prepare FILES --output {folder}`"
        )
    try:
        manifest = json.loads(path.read_text())
        complete, shards = manifest["complete"], manifest["shards"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"cannot read {path} ({type(e).__name__}: {e}); prepare {folder} again with --overwrite"
        ) from None
    if not complete:
        raise DataError(
            f"{folder} is an unfinished prepare ({len(shards)} shards so far); run the same `modelpar-data prepare` "
            "command again to finish it"
        )
    return manifest


def tokenizer_file_of(folder: str | Path) -> Path | None:
    """The tokenizer.json a shard directory was prepared with (None: the byte tokenizer)."""
    name = read_manifest(folder)["tokenizer"].get("file")
    return (Path(folder) / name).resolve() if name else None


def held_out(folder: str | Path) -> Path | None:
    """The held-out split prepared with shard directory ``folder`` (``folder/val``), or None."""
    folder = Path(folder)
    val = folder / VAL_SPLIT
    return val if read_manifest(folder).get("val") and (val / MANIFEST).is_file() else None


def eval_split(path: str | Path) -> str:
    """What to evaluate on for training data ``path``: a shard directory's held-out split when it has one, else
    ``path`` itself."""
    if is_shard_dir(path):
        return str(held_out(path) or path)
    return str(path)


@dataclass(frozen=True, eq=False)
class WindowSet:
    """Windows of several token files numbered one after another (window ``i`` lies in one file only).

    ``parts``: the token files, each with at least one window; ``starts: [len(parts) + 1]`` the first window of
    each part (the last entry is ``num_windows``). Reads like a :class:`TokenFile`: ``batch``, ``window``.
    """

    path: str
    parts: tuple[TokenFile, ...] = field(repr=False)
    vocab_size: int
    seq_len: int
    starts: np.ndarray = field(repr=False)

    @classmethod
    def of(cls, path: str, parts: Sequence[TokenFile]) -> WindowSet:
        if not parts:
            raise DataError(f"{path} holds no window of tokens; add data or shorten seq_len")
        starts = np.concatenate([[0], np.cumsum([p.num_windows for p in parts])]).astype(np.int64)
        return cls(path, tuple(parts), parts[0].vocab_size, parts[0].seq_len, starts)

    @property
    def num_windows(self) -> int:
        return int(self.starts[-1])

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.parts)

    def __len__(self) -> int:
        return self.num_windows

    def window(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch([i])
        return inputs[0], targets[0]

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows ``indices: [n]`` as ``(inputs: [n, seq_len], targets: [n, seq_len])``, int64."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        bad = indices[(indices < 0) | (indices >= self.num_windows)]
        if len(bad):
            raise IndexError(f"window {int(bad[0])} is outside 0..{self.num_windows - 1} of {self.path}")
        part = np.searchsorted(self.starts, indices, side="right") - 1
        windows = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        steps = np.arange(self.seq_len + 1)
        for p in np.unique(part):
            chosen = part == p
            offsets = (indices[chosen] - self.starts[p])[:, None] * self.seq_len + steps
            windows[chosen] = self.parts[p].tokens[offsets]
        windows = torch.from_numpy(windows)
        return windows[:, :-1], windows[:, 1:]


def shard_files(folder: str | Path, vocab_size: int, seq_len: int) -> list[TokenFile]:
    """The shards of a finished prepare in ``folder``, memory-mapped, each checked against the model.

    Ids are not scanned: the manifest's tokenizer bounds them, so its vocabulary is checked instead. Shards
    shorter than one window (a short last shard) are left out.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    vocab = manifest["tokenizer"]["vocab_size"]
    if vocab > vocab_size:
        raise DataError(
            f"{folder} was tokenised with a {vocab}-id vocabulary but vocab_size is {vocab_size}; "
            f"raise model.vocab_size to at least {vocab} or prepare it with the model's tokenizer"
        )
    files = []
    for shard in manifest["shards"]:
        if shard["tokens"] < seq_len + 1:
            continue
        path = folder / shard["file"]
        tokens = open_tokens(path)
        if len(tokens) != shard["tokens"] or str(tokens.dtype) != manifest["dtype"]:
            raise DataError(
                f"{path} holds {len(tokens)} {tokens.dtype} tokens but {folder / MANIFEST} says {shard['tokens']} "
                f"{manifest['dtype']}; prepare {folder} again with --overwrite"
            )
        files.append(TokenFile(path=path, tokens=tokens, vocab_size=vocab_size, seq_len=seq_len))
    if not files:
        total = sum(s["tokens"] for s in manifest["shards"])
        raise DataError(
            f"{folder} has no shard of {seq_len + 1} tokens ({total} tokens in {len(manifest['shards'])} shards); "
            "use a shorter seq_len, more text or a larger --shard-tokens"
        )
    return files


def open_dataset(path: str | Path, vocab_size: int, seq_len: int) -> TokenFile | WindowSet:
    """The windows of ``path``: a token file (``.npy``) or a shard directory."""
    if is_shard_dir(path):
        return WindowSet.of(str(path), shard_files(path, vocab_size, seq_len))
    return TokenFile.open(path, vocab_size, seq_len)
