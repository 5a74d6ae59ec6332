"""Data provenance: a token file's fingerprint (size and SHA-256), computed once and cached beside the file.

A checkpoint records the fingerprint of the data it was trained on; the sampler position it saves is only
meaningful on the same bytes, so resuming on a changed file is refused unless ``data.allow_changed=true``.
The cache (``<file>.fingerprint.json``) is trusted only while the file's size and modification time match.
A shard directory's fingerprint covers its manifest and every shard; a blend's covers each dataset and weight.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from modelpar.data.blend import Blend
from modelpar.data.shards import MANIFEST, read_manifest
from modelpar.data.token_file import DataError

_CHUNK = 1 << 22


def _cache_of(path: Path) -> Path:
    return path.with_name(path.name + ".fingerprint.json")


def fingerprint(path) -> dict:
    """``{"size": bytes, "sha256": hex}`` of ``path`` (a token file, a shard directory or a ``Blend``)."""
    if isinstance(path, Blend):  # by position and weight: the same datasets moved elsewhere are the same data
        return _combined([(f"dataset {i} weight {w!r}", fingerprint(p)) for i, (p, w) in enumerate(path.parts)])
    path = Path(path)
    if path.is_dir():
        files = [MANIFEST, *(shard["file"] for shard in read_manifest(path)["shards"])]
        return _combined([(name, _file_fingerprint(path / name)) for name in files])
    return _file_fingerprint(path)


def _combined(named: list[tuple[str, dict]]) -> dict:
    digest = hashlib.sha256(json.dumps(named, sort_keys=True).encode())
    return {"size": sum(fp["size"] for _, fp in named), "sha256": digest.hexdigest()}


def _file_fingerprint(path: Path) -> dict:
    """One file's fingerprint, from the cache when the file is unchanged since."""
    try:
        st = path.stat()
    except OSError as exc:
        raise DataError(f"cannot fingerprint {path}: {exc.strerror}") from None
    cache = _cache_of(path)
    try:
        cached = json.loads(cache.read_text())
        if cached["size"] == st.st_size and cached["mtime_ns"] == st.st_mtime_ns:
            return {"size": cached["size"], "sha256": cached["sha256"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    out = {"size": st.st_size, "sha256": digest.hexdigest()}
    try:  # a read-only data directory just means no cache
        tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**out, "mtime_ns": st.st_mtime_ns}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return out


def describe(fp: dict) -> str:
    return f"{fp['size']} bytes, sha256 {fp['sha256'][:16]}"


def check_same_data(saved: dict | None, path, allow_changed: bool, ckpt: str | Path) -> None:
    """Raise ``DataError`` (one line, both fingerprints) if ``path`` is not the data ``ckpt`` was trained on."""
    if not saved or allow_changed:
        return
    now = fingerprint(path)
    if now["size"] != saved["size"] or now["sha256"] != saved["sha256"]:
        raise DataError(
            f"{path} ({describe(now)}) is not the data {ckpt} was trained on ({describe(saved)}); its sampler "
            "position means nothing on other data: use the original file, or data.allow_changed=true"
        )


def data_source(path) -> dict:
    """Where a run's training data is, as a checkpoint records it: ``{"path": ...}`` (absolute) or
    ``{"blend": [[path, weight], ...]}``; what ``modelpar-eval`` scores when it is given no data."""
    if isinstance(path, Blend):
        return {"blend": [[str(Path(p).resolve()), w] for p, w in path.parts]}
    return {"path": str(Path(path).resolve())}
